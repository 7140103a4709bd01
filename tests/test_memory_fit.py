"""rl.micro_batches=auto and the refusal of a set count that does not fit (rl/memory_plan.py,
run/memory_fit.py), on the 8-device CPU mesh against a budget the config sets
(run.memory_budget_gib): the expected counts are worked out here from the compiled programs' own
memory figures, read by hand (arguments + temporaries + outputs - aliased)."""

import jax
import pytest

from helpers import ATTENTION_LAYERS, tiny_config
from hybridmoe.cli import main
from hybridmoe.rl.loop import run_rl
from hybridmoe.rl.memory_plan import plan_updates, update_program
from hybridmoe.run import memory_fit
from hybridmoe.run.run_dir import RunError
from hybridmoe.run.setup import build

GIB = 2**30
# 16 prompts x 4 completions = 64 rows over the mesh's 8 batch shards: the counts 1, 2, 4 and 8. (At
# 32 rows the update at 2 micro-batches needs more than at 1: tiny shapes are no guide.) Attention
# layers only (helpers.ATTENTION_LAYERS): the searches read whatever the compiled programs need, at
# about half of a two-mixer model's compile for each of the file's programs.
WORDS = ("rl.prompts_per_step=16", "rl.group_size=4", "rl.max_prompt_len=6", "rl.max_new_tokens=10",
         "rl.warmup_steps=0", "rl.steps=1", "gdn.chunk_size=8", *ATTENTION_LAYERS)


def by_hand(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


@pytest.fixture(scope="module")
def measured():
    """The set-up and the GRPO update's bytes per device at 1 and 2 micro-batches (the programs are
    kept on the set-up: the search below compiles nothing again)."""
    setup = build(tiny_config(*WORDS))
    need = {M: by_hand(update_program(setup, False, M)) for M in (1, 2)}
    assert need[1] > need[2], need  # fewer rows per micro-batch, fewer temporaries
    return setup, need


def between(need) -> int:
    """A budget that the update at 2 micro-batches fits and the one at 1 does not."""
    return (need[1] + need[2]) // 2


def check_auto_choice(setup, need):
    plan = plan_updates(setup, False, between(need), setting="auto")
    assert plan.micro_batches == 2
    assert plan.update.compiled is update_program(setup, False, 2)  # the program measured is the one the run calls
    assert plan_updates(setup, False, need[1], setting="auto").micro_batches == 1  # fits exactly: the fewest


def test_auto_chooses_the_fewest_micro_batches_whose_update_fits_the_budget(measured):
    check_auto_choice(*measured)


def test_without_a_budget_on_cpu_auto_is_one_micro_batch(measured):
    setup, _ = measured
    assert memory_fit.memory_budget_bytes(setup.cfg) is None  # a CPU reports no memory limit
    assert plan_updates(setup, False, None, setting="auto").micro_batches == 1


def test_a_set_count_that_fits_is_kept_and_one_that_does_not_is_refused_naming_the_count_that_fits(measured):
    setup, need = measured
    assert plan_updates(setup, False, between(need), setting=2).micro_batches == 2
    with pytest.raises(RunError) as e:
        plan_updates(setup, False, between(need), setting=1)
    message = str(e.value)
    assert "\n" not in message and message.startswith("rl.micro_batches=1: the GRPO update needs")
    assert "the smallest count that fits is rl.micro_batches=2" in message


def test_hybridmoe_rl_refuses_the_set_count_in_one_line_before_any_rollout(measured, tmp_path, capsys, monkeypatch):
    _, need = measured
    monkeypatch.setattr("hybridmoe.rl.loop._sample_groups", lambda *a: pytest.fail("a rollout ran"))
    out = tmp_path / "run"
    code = main(["rl", *WORDS, "rl.micro_batches=1", f"run.memory_budget_gib={between(need) / GIB!r}", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "rl.micro_batches=1:" in err[0] and "rl.micro_batches=2" in err[0] and "Traceback" not in err[0]
    assert not (out / "metrics.jsonl").exists()


def test_an_auto_run_trains_with_the_count_chosen_for_its_budget(measured, tmp_path):
    _, need = measured
    cfg = tiny_config(*WORDS, "rl.rollout_batches=2", f"run.memory_budget_gib={between(need) / GIB!r}")
    history = run_rl(cfg, tmp_path / "run", progress=False)
    assert [(rec["micro_batches"], rec["rollout_batches"]) for rec in history] == [(2.0, 2.0)]


def test_a_memory_error_at_run_time_is_one_line(monkeypatch, capsys):
    def out_of_memory(args, words):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 21 GiB\nmore detail")

    monkeypatch.setitem(__import__("hybridmoe.cli").cli.COMMANDS, "train", (out_of_memory, "train"))
    assert main(["train", "recipe=tiny"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating 21 GiB):" in err[0]


class DeviceWithStatistics:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


@pytest.mark.parametrize("stats,words", [
    # A chip: what is in use at the refusal, of its limit, and the largest block left.
    ({"bytes_in_use": 3 * GIB // 2, "bytes_limit": 16 * GIB, "largest_free_block_bytes": GIB // 4},
     ", with 1.50 GiB of arrays in use of the device's 16.00 (largest free block 0.25 GiB):"),
    ({"bytes_in_use": 5 * GIB, "bytes_limit": 15 * GIB}, ", with 5.00 GiB of arrays in use of the device's 15.00:"),
    (None, ":"),  # a device without statistics (a CPU): the line as before
])
def test_a_memory_error_names_what_the_device_had_in_use(stats, words, monkeypatch, capsys):
    def out_of_memory(args, words):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 21 GiB")

    monkeypatch.setitem(__import__("hybridmoe.cli").cli.COMMANDS, "train", (out_of_memory, "train"))
    monkeypatch.setattr(jax, "local_devices", lambda: [DeviceWithStatistics(stats)])
    assert main(["train", "recipe=tiny"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"allocating 21 GiB){words}" in err[0], err


def test_broken_search_is_caught(broken_fit, measured):
    with pytest.raises(AssertionError):
        check_auto_choice(*measured)


def test_auto_sampler_passes_hold_the_fewest_rows_in_flight_that_fit_beside_the_optimizer_state(measured):
    """rl.rollout_batches: the sampler's program at 16 and at 8 prompts a pass (64 and 32 rows of
    KV cache and GDN state in flight); the budget less the optimizer state it runs beside."""
    from hybridmoe.rl.loop import sampling_options
    from hybridmoe.data.tokenizer import load_tokenizer
    from hybridmoe.rl.memory_plan import plan_rollout, sampler_program

    setup, _ = measured
    opts = sampling_options(setup.cfg, load_tokenizer(None))
    need = {n: by_hand(sampler_program(setup, opts, 16 // n)) for n in (1, 2)}
    assert need[1] > need[2], need
    beside = memory_fit.per_device_bytes(setup.abstract_state()["opt_state"])
    chosen = plan_rollout(setup, opts, False, between(need) + beside, setting="auto")
    assert chosen.count == 2 and chosen.compiled is sampler_program(setup, opts, 8)
    with pytest.raises(RunError, match=r"^rl.rollout_batches=1: .* the smallest count that fits is rl.rollout_batches=2 "):
        plan_rollout(setup, opts, False, between(need) + beside, setting=1)


class _FakeProgram:
    """A compiled program's memory_analysis with the given bytes (all temporaries)."""

    def __init__(self, nbytes):
        self.nbytes = nbytes

    def memory_analysis(self):
        from types import SimpleNamespace

        return SimpleNamespace(argument_size_in_bytes=0, temp_size_in_bytes=self.nbytes, output_size_in_bytes=0,
                               alias_size_in_bytes=0)


def _compiler(need_gib, refuse=(), refusal_gib=None):
    """(compile_at, the counts it compiled): a program needing need_gib(M) GiB; counts in `refuse`
    are refused by the 'compiler' with its figure (refusal_gib(M), else need_gib(M))."""
    compiled = []

    def compile_at(m):
        compiled.append(m)
        if m in refuse:
            raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                                             f"for HLO temporaries ({(refusal_gib or need_gib)(m):.2f}G) exceeds "
                                             "available HBM (15.75G).")
        return _FakeProgram(int(need_gib(m) * GIB))

    return compile_at, compiled


def _search(need_gib, budget_gib, refuse=(), counts=(1, 2, 4, 8, 16), fixed_gib=0.0, refusal_gib=None):
    """fewest_that_fit over `counts` with _compiler's program. Returns (the count found, the counts compiled)."""
    compile_at, compiled = _compiler(need_gib, refuse, refusal_gib)
    fit = memory_fit.fewest_that_fit(list(counts), compile_at, int(budget_gib * GIB), int(fixed_gib * GIB))
    return (None if fit is None else fit.count), compiled


def test_counts_the_first_need_rules_out_are_not_compiled():
    """need(M) = 2 + 64 / M GiB against 12: 66, 34, 18, 10, 6. The first count's 66 GiB scaled by 1/M
    rules out 2 (33) and 4 (16.5) without a compile; 8 (8.25 under 12) is compiled and fits. The same
    from the compiler's refusal of count 1 (its temporaries' figure). A count whose scaled floor is
    under the budget is compiled even when it will not fit: need 10 + 8 / M against 15 (M = 1: 18
    GiB, floor 9 at M = 2, which fits at 14)."""
    assert _search(lambda m: 2 + 64 / m, 12) == (8, [1, 8])
    assert _search(lambda m: 2 + 64 / m, 12, refuse={1}) == (8, [1, 8])
    assert _search(lambda m: 10 + 8 / m, 15) == (2, [1, 2])
    # No count fits, and the first rules out every other: 66 / 16 = 4.1 GiB is over 3.5.
    assert _search(lambda m: 2 + 64 / m, 3.5) == (None, [1])


def test_a_search_from_a_first_count_above_one_scales_its_floor_from_that_count():
    """The counts of a mesh whose batch shards rule out 1 start higher. need(M) = 2 + 64 / M GiB
    against 12 from M = 2: 34 GiB, a floor of 34 x 2 / M after it: 17 at 4 (over 12: not compiled),
    8.5 at 8 (compiled: 10 GiB, fits). A floor scaled by 1 / M alone (8.5 at 4) compiles 4 for nothing:
    a minute of a chip's compile per count."""
    assert _search(lambda m: 2 + 64 / m, 12, counts=(2, 4, 8, 16)) == (8, [2, 8])
    # From M = 4 (18 GiB): 18 x 4 / 8 = 9 at 8 is compiled (10, fits); 9 / 8 would be too, 16 never is.
    assert _search(lambda m: 2 + 64 / m, 12, counts=(4, 8, 16)) == (8, [4, 8])


def test_the_counts_split_the_rows_into_micro_batches_that_each_split_over_the_shards():
    # 64 rows over 8 shards: 64 / M must be a multiple of 8 -> 1, 2, 4, 8 (16 would leave 4 rows a micro-batch).
    assert memory_fit.divisor_counts(64, 8) == [1, 2, 4, 8]
    # 48 rows over 8 shards: 48, 24, 16, 8 rows -> M = 1, 2, 3, 6 (4 would leave 12, 8 would leave 6).
    assert memory_fit.divisor_counts(48, 8) == [1, 2, 3, 6]
    assert memory_fit.divisor_counts(12) == [1, 2, 3, 4, 6, 12]
    assert memory_fit.divisor_counts(12, 24) == []


def test_a_programs_need_counts_its_donated_state_once():
    """arguments 10 GiB (the state among them) + temporaries 3 + outputs 2 - aliased 4 (the outputs
    written in the donated arguments' place) = 11 GiB."""
    from types import SimpleNamespace

    figures = SimpleNamespace(argument_size_in_bytes=10 * GIB, temp_size_in_bytes=3 * GIB,
                              output_size_in_bytes=2 * GIB, alias_size_in_bytes=4 * GIB)
    program = SimpleNamespace(memory_analysis=lambda: figures)
    assert memory_fit.program_bytes(program) == 11 * GIB


def test_the_budget_is_the_set_figure_else_the_devices_free_memory(monkeypatch):
    """run.memory_budget_gib=0.5 -> 2^29 bytes; unset, the device's bytes_limit less what is in use
    (16 GiB with 1.25 in use: 14.75 GiB, 15837691904 bytes); a device with no limit (a CPU): None."""
    from types import SimpleNamespace

    def config(gib):
        return SimpleNamespace(run=SimpleNamespace(memory_budget_gib=gib))

    def device(stats):
        return lambda: [SimpleNamespace(memory_stats=lambda: stats)]

    assert memory_fit.memory_budget_bytes(config(0.5)) == 536870912
    monkeypatch.setattr(memory_fit.jax, "local_devices", device({"bytes_limit": 16 * GIB, "bytes_in_use": 5 * GIB // 4}))
    assert memory_fit.memory_budget_bytes(config(None)) == 15837691904
    assert memory_fit.memory_budget_bytes(config(3.0)) == 3 * GIB  # the set figure wins over the device's
    monkeypatch.setattr(memory_fit.jax, "local_devices", device(None))
    assert memory_fit.memory_budget_bytes(config(None)) is None


def test_the_pi_old_pass_runs_at_its_own_count():
    """With several updates a rollout the pi_old pass has a program of its own, compiled at the count
    its own search chose (here 4, the update's 2): the loop splits its batch at that count; with one
    update a rollout there is no such pass and the update's count stands."""
    from hybridmoe.rl.memory_plan import UpdatePlan

    plan = UpdatePlan(memory_fit.Fit(2, "update", 10), memory_fit.Fit(4, "pi_old", 8))
    assert (plan.micro_batches, plan.old_logprobs_micro_batches) == (2, 4)
    assert UpdatePlan(memory_fit.Fit(2, "update", 10), None).old_logprobs_micro_batches == 2


def test_the_state_a_program_holds_at_every_count_is_not_scaled():
    """The chip's update at the one-chip recipe's 16 x 8 x 512 batch: 2.67 GiB of state at every
    count and 58.6 GiB of temporaries at one micro-batch, which the compiler refuses (15.75 GiB
    free). need(M) = 2.67 + 58.6 / M: with the state held fixed the floor at 4 is 2.67 + 14.65 =
    17.32, over 15.75, so 4 is never compiled and 8 (9.995) is the next compile; scaling the state
    too (a floor of 14.65 at 4) compiles 4 for nothing."""
    need = lambda m: 2.67 + 58.6 / m  # noqa: E731
    temps = lambda m: 58.6 / m  # noqa: E731  the refusal's figure: its temporaries
    assert _search(need, 15.75, refuse={1}, fixed_gib=2.67, refusal_gib=temps) == (8, [1, 8])
    assert _search(need, 15.75, refuse={1}, refusal_gib=temps) == (8, [1, 4, 8])
    # From a compiled first count: 2.67 + 58.6 = 61.27 GiB at M = 1 against a 20 GiB budget: the floor
    # at 4 is 2.67 + 58.6 / 4 = 17.32 (compiled: fits); scaled whole it would be the same 4.
    assert _search(need, 20, fixed_gib=2.67) == (4, [1, 4])
    # A budget of 17 GiB: the floor at 4 (17.32) is over it, 8 is compiled (9.995).
    assert _search(need, 17, fixed_gib=2.67) == (8, [1, 8])
    assert _search(need, 17) == (8, [1, 4, 8])


def test_a_set_count_refused_rules_out_the_counts_its_own_figure_rules_out():
    """rl.micro_batches=1 with need(M) = 2 + 64 / M GiB against 12: the set count (66 GiB) is over,
    and its figure rules out 2 (33) and 4 (16.5), so the refusal compiles 1 and 8 alone (the search
    for the smaller count used to start afresh at 2: on a chip, a minute or more of compile a count).
    Refused by the compiler, the message gives its figure, not a need it never read."""
    for refuse, words in (((), "the GRPO update needs 66.00 GiB per device"),
                          ({1}, "the device's compiler refused the GRPO update for memory (66.00 GiB of temporaries)")):
        compile_at, compiled = _compiler(lambda m: 2 + 64 / m, refuse)
        with pytest.raises(RunError) as e:
            memory_fit.choose_count("rl.micro_batches", 1, [1, 2, 4, 8, 16], compile_at, 12 * GIB, "the GRPO update")
        assert compiled == [1, 8], compiled
        assert str(e.value).startswith(f"rl.micro_batches=1: {words}, over the budget of 12.00 GiB"), str(e.value)
        assert "the smallest count that fits is rl.micro_batches=8" in str(e.value)


def test_the_counts_each_plan_offers_by_hand(monkeypatch):
    """4 prompts x 4 completions = 16 rows over 4 batch shards, 4 updates in 2 epochs (2 mini-batches
    of 8 rows): the update is offered the counts splitting 8 rows in shard-whole micro-batches (1, 2),
    the pi_old pass over the whole rollout those of 16 (1, 2, 4); the sampler the passes whose rows
    split over the shards (1, 2, 4: 16, 8 or 4 rows a pass, though 2 or 1 prompts a pass do not), its
    budget the set one less the optimizer state it runs beside."""
    from types import SimpleNamespace

    import hybridmoe.rl.memory_plan as mp

    offered = {}

    def choose_count(key, setting, counts, compile_at, budget, what, fixed_bytes=0):
        offered[what] = (list(counts), budget)
        return memory_fit.Fit(counts[0], None, 0)

    monkeypatch.setattr(mp, "choose_count", choose_count)
    monkeypatch.setattr(mp, "batch_shards", lambda setup: 4)
    monkeypatch.setattr(mp, "per_device_bytes", lambda tree: tree if isinstance(tree, int) else sum(tree.values()))
    cfg = tiny_config("rl.prompts_per_step=4", "rl.group_size=4", "rl.updates_per_rollout=4", "rl.epochs_per_rollout=2")
    setup = SimpleNamespace(cfg=cfg, abstract_state=lambda: {"opt_state": 300, "params": 100})
    mp.plan_updates(setup, False, 1000, setting="auto")
    mp.plan_rollout(setup, None, False, 1000, setting="auto")
    assert offered == {"the GRPO update": ([1, 2], 1000), "the pi_old pass": ([1, 2, 4], 1000),
                       "the sampler": ([1, 2, 4], 1000 - 300)}
