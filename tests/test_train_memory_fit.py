"""train.micro_batches=auto and the refusal of a set count that does not fit (run/step_plan.py,
run/memory_fit.py), on the 8-device CPU mesh against a budget the config sets
(run.memory_budget_gib): the expected counts are worked out here from the compiled training steps'
own memory figures, read by hand (arguments + temporaries + outputs - aliased). The data a step
trains on is packed for the whole step and split after, so the count changes the memory, not the
rows or the loss."""

import json

import numpy as np
import pytest

from broken_variants import BROKEN_SPLIT
from helpers import ATTENTION_LAYERS, tiny_config
from hybridmoe.cli import main
from hybridmoe.data.packing import split_micro_batches
from hybridmoe.data.synthetic import synthetic_batch
from hybridmoe.run.run_dir import RunError
from hybridmoe.run.setup import build
from hybridmoe.train.loop import train
from hybridmoe.run.step_plan import plan_train, train_program

GIB = 2**30
# 16 sequences of 128 a step over the mesh's 8 batch shards (data 2 x fsdp 4): the counts 1 and 2 (at 32
# tokens a sequence the step at 2 needs more than at 1: tiny shapes are no guide). Attention layers only
# (helpers.ATTENTION_LAYERS): the search reads whatever the compiled step needs, at about half of a
# two-mixer model's compile for each of the file's step programs.
WORDS = ("train.batch_size=16", "train.seq_len=128", "train.steps=2", "train.log_every=1", "gdn.chunk_size=8",
         *ATTENTION_LAYERS)


def by_hand(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


@pytest.fixture(scope="module")
def measured():
    """The set-up and the training step's bytes per device at 1 and 2 micro-batches (kept on the
    set-up: the searches below compile nothing again)."""
    setup = build(tiny_config(*WORDS))
    need = {M: by_hand(train_program(setup, M)) for M in (1, 2)}
    assert need[1] > need[2], need  # 16 rows at once hold more activations than 8
    return setup, need


def between(need) -> int:
    """A budget that the step at 2 micro-batches fits and the one at 1 does not."""
    return (need[1] + need[2]) // 2


def check_auto_choice(setup, need):
    fit = plan_train(setup, between(need), setting="auto")
    assert fit.count == 2
    assert fit.compiled is train_program(setup, 2)  # the program measured is the one the run calls
    assert plan_train(setup, need[1], setting="auto").count == 1  # fits exactly: the fewest


def test_auto_chooses_the_fewest_micro_batches_whose_step_fits_the_budget(measured):
    check_auto_choice(*measured)


def test_without_a_budget_auto_is_the_fewest_count(measured):
    setup, _ = measured
    assert plan_train(setup, None, setting="auto").count == 1


def test_a_set_count_that_fits_is_kept_and_one_that_does_not_is_refused_naming_the_count_that_fits(measured):
    setup, need = measured
    assert plan_train(setup, between(need), setting=2).count == 2
    with pytest.raises(RunError) as e:
        plan_train(setup, between(need), setting=1)
    message = str(e.value)
    assert "\n" not in message and message.startswith("train.micro_batches=1: the training step needs")
    assert f"{need[1] / GIB:.2f} GiB" in message
    assert "the smallest count that fits is train.micro_batches=2" in message


def test_broken_search_is_caught(broken_fit, measured):
    with pytest.raises(AssertionError):
        check_auto_choice(*measured)


def test_hybridmoe_train_refuses_the_set_count_in_one_line_before_any_step(measured, tmp_path, capsys):
    _, need = measured
    out = tmp_path / "run"
    code = main(["train", *WORDS, "train.micro_batches=1", f"run.memory_budget_gib={between(need) / GIB!r}",
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "train.micro_batches=1:" in err[0] and "train.micro_batches=2" in err[0] and "Traceback" not in err[0]
    assert not (out / "metrics.jsonl").exists()


def check_same_rows_at_any_count():
    one = synthetic_batch(3, 5, 1, 16, 32, 256)
    two = synthetic_batch(3, 5, 2, 8, 32, 256)
    for k in one:
        assert two[k].shape == (2, 8, 32)
        np.testing.assert_array_equal(two[k].reshape(16, 32), one[k][0])
        np.testing.assert_array_equal(split_micro_batches(one, 2)[k], two[k])


def test_the_step_s_rows_are_the_same_at_any_count():
    """Packed for the whole step, then split: at 2 micro-batches of 8 the rows of 1 of 16, in order."""
    check_same_rows_at_any_count()
    with pytest.raises(ValueError, match="16 rows do not split into 3"):
        split_micro_batches(synthetic_batch(3, 5, 1, 16, 32, 256), 3)


@pytest.mark.parametrize("variant", list(BROKEN_SPLIT))
def test_broken_split_is_caught(variant, monkeypatch):
    for module, attr, fn in BROKEN_SPLIT[variant]:
        monkeypatch.setattr(module, attr, fn)
    with pytest.raises(AssertionError):
        check_same_rows_at_any_count()


def test_an_auto_run_trains_at_the_chosen_count_and_computes_what_one_micro_batch_does(measured, tmp_path):
    """The run with a budget that holds 2 micro-batches only takes them (its records say so) and,
    on the same rows, computes the losses and gradient norms of the run at 1 (no budget), to f32
    rounding: the count is a memory matter."""
    _, need = measured
    planned = train(tiny_config(*WORDS, f"run.memory_budget_gib={between(need) / GIB!r}"), tmp_path / "a",
                    progress=False)
    plain = train(tiny_config(*WORDS), tmp_path / "b", progress=False)
    assert [r["micro_batches"] for r in planned] == [2, 2] and [r["micro_batches"] for r in plain] == [1, 1]
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["micro_batches"] for r in records if "loss" in r] == [2, 2]
    for a, b in zip(planned, plain):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) < 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * b["grad_norm"], (a["grad_norm"], b["grad_norm"])


def test_the_rl_warm_up_step_takes_the_count_its_budget_fits(measured, tmp_path):
    """`hybridmoe rl`'s supervised warm-up runs the same training step: under a budget that holds 2
    micro-batches only, it takes 2 (and 1 without a budget)."""
    from hybridmoe.rl.loop import run_rl

    _, need = measured
    words = (*WORDS, "rl.warmup_steps=2", "rl.steps=0")
    planned = run_rl(tiny_config(*words, f"run.memory_budget_gib={between(need) / GIB!r}"), tmp_path / "a",
                     progress=False)
    plain = run_rl(tiny_config(*words), tmp_path / "b", progress=False)
    assert [r["warmup_micro_batches"] for r in planned] == [2.0, 2.0]
    assert [r["warmup_micro_batches"] for r in plain] == [1.0, 1.0]
    for a, b in zip(planned, plain):
        assert abs(a["warmup_loss"] - b["warmup_loss"]) < 1e-5 * abs(b["warmup_loss"]), (a, b)
