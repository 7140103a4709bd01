"""The figures benchmarks/rollout.py and benchmarks/train_step.py record, from hand-chosen worker
answers (no worker process, no compile): rates, warm-up rounds, ratios and which side divides."""

import sys
from types import SimpleNamespace

import pytest

from helpers import benchmark_script


class FakeWorker:
    """A worker whose answers are a function of (its name, the request)."""

    answers = None  # set per test: (name, request) -> dict

    def __init__(self, argv, name):
        self.name = name

    def ask(self, **req):
        if req["cmd"] == "info":
            return {"side": self.name, "tokens_per_step": 8}
        return type(self).answers(self.name, req)

    def close(self):
        pass


def _run_main(module, monkeypatch, argv, answers):
    records = []
    FakeWorker.answers = staticmethod(answers)
    monkeypatch.setattr(module, "Worker", FakeWorker)
    monkeypatch.setattr(module, "pin", lambda cores: None)
    monkeypatch.setattr(module.harness, "configure", lambda *a, **k: None)
    monkeypatch.setattr(module.harness, "write", lambda out, name, **fields: records.append((name, fields)))
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    module.main()
    assert len(records) == 1
    return records[0]


# rollout: Q = 1 prompt x G = 2 rows (B = 2), P = 4 prompt tokens, N = 5 new tokens.
ROLLOUT_ARGV = ["--hf-python", "python", "--arms", "ours", "--prompts", "1", "--group-size", "2",
                "--prompt-len", "4", "--new-tokens", "5", "--rounds", "2", "--warmup", "1"]
# (wall, cpu) seconds of the 1-token call and the N-token call; the warm-up round (seed 0) takes 100 s.
ROLLOUT_TIMES = {"ours": {1: (0.5, 0.4), 5: (2.5, 2.0)}, "reference": {1: (1.0, 0.5), 5: (6.0, 4.0)}}


def _rollout_answer(name, req):
    assert req["cmd"] == "generate" and req["group_size"] == 2 and len(req["prompts"]) == 1
    wall, cpu = ROLLOUT_TIMES[name][req["new_tokens"]]
    if req["seed"] == 0:
        wall, cpu = 100.0, 100.0
    return {"wall_s": wall, "cpu_s": cpu, "rows": 2, "new_tokens": 2 * req["new_tokens"]}


def test_rollout_rates_are_tokens_over_seconds_of_timed_rounds_only(monkeypatch):
    """ours: B x N = 10 tokens in 2.5 s = 4 tok/s; decode B x (N - 1) = 8 tokens in 2.5 - 0.5 s = 4
    tok/s; prefill 0.5 s; CPU 10 / 2.0 = 5 tok/s. The warm-up round's 100 s counts nowhere."""
    module = benchmark_script("rollout")
    name, rec = _run_main(module, monkeypatch, ROLLOUT_ARGV, _rollout_answer)
    assert name == "rollout_small"
    wall, cpu = rec["sides"]["ours"]["wall"], rec["sides"]["ours"]["cpu"]
    assert wall["rollout_tokens_per_s"]["n"] == 2 and len(rec["sides"]["ours"]["calls"]) == 2
    assert wall["rollout_tokens_per_s"]["median"] == pytest.approx(4.0)
    assert wall["rollout_tokens_per_s"]["max"] == pytest.approx(4.0)  # no warm-up round among them
    assert wall["decode_tokens_per_s"]["median"] == pytest.approx(4.0)
    assert wall["prefill_s"]["median"] == pytest.approx(0.5)
    assert wall["call_s"]["median"] == pytest.approx(2.5)
    assert cpu["rollout_tokens_per_s"]["median"] == pytest.approx(5.0)
    assert cpu["decode_tokens_per_s"]["median"] == pytest.approx(8 / (2.0 - 0.4))
    ref = rec["sides"]["reference"]["wall"]
    assert ref["rollout_tokens_per_s"]["median"] == pytest.approx(10 / 6.0)
    assert ref["decode_tokens_per_s"]["median"] == pytest.approx(8 / (6.0 - 1.0))
    assert [c["round"] for c in rec["sides"]["ours"]["calls"]] == [0, 1]
    assert rec["shape"] == {"prompts": 1, "group_size": 2, "rows": 2, "prompt_len": 4, "new_tokens": 5,
                            "dtype": "float32", "sampling": "temperature 1, no top-p / top-k, no EOS"}
    assert rec["method"]["rounds"] == 2 and rec["method"]["warmup_rounds"] == 1
    assert len(rec["load_average"]["per_round"]) == 2


def test_rollout_ratios_are_ours_over_the_reference_and_prefill_speed_the_inverse(monkeypatch):
    """Rollout 4 / (10 / 6) = 2.4; decode 4 / (8 / 5) = 2.5; prefill speed = reference's seconds over
    ours = 1.0 / 0.5 = 2 (> 1: ours is faster); CPU rollout 5 / (10 / 4) = 2."""
    module = benchmark_script("rollout")
    _, rec = _run_main(module, monkeypatch, ROLLOUT_ARGV, _rollout_answer)
    ratio = rec["ratios_over_reference"]["ours"]
    assert set(rec["ratios_over_reference"]) == {"ours"}
    assert ratio["wall"]["rollout_tokens_per_s"]["median"] == pytest.approx(2.4)
    assert ratio["wall"]["decode_tokens_per_s"]["median"] == pytest.approx(2.5)
    assert ratio["wall"]["prefill_speed"]["median"] == pytest.approx(2.0)
    assert ratio["cpu"]["rollout_tokens_per_s"]["median"] == pytest.approx(2.0)
    assert ratio["cpu"]["decode_tokens_per_s"]["median"] == pytest.approx((8 / 1.6) / (8 / 3.5))


def test_rollout_decode_rate_is_nan_when_the_one_token_call_is_as_slow_as_the_whole(monkeypatch):
    import math

    def answer(name, req):
        out = _rollout_answer(name, req)
        return {**out, "wall_s": 3.0} if name == "ours" else out

    module = benchmark_script("rollout")
    _, rec = _run_main(module, monkeypatch, ROLLOUT_ARGV, answer)
    assert math.isnan(rec["sides"]["ours"]["wall"]["decode_tokens_per_s"]["median"])
    assert rec["sides"]["ours"]["wall"]["rollout_tokens_per_s"]["median"] == pytest.approx(10 / 3.0)


def test_rollout_routing_replay_bytes_are_int32_ids_per_row_token_layer_and_k(monkeypatch):
    """small: 4 bytes x B = 2 rows x (P + N) = 9 tokens x 4 layers x k = 4 = 1152; Qwen3.5-35B-A3B per
    1k tokens: 4 x 1024 x 40 layers x k = 8 = 1,310,720."""
    module = benchmark_script("rollout")
    _, rec = _run_main(module, monkeypatch, ROLLOUT_ARGV, _rollout_answer)
    ids = rec["routing_replay_ids_bytes"]
    assert ids["small_this_rollout"] == 1152
    assert ids["qwen3.5-35b-a3b_per_1k_tokens"] == 1_310_720


def test_rollout_without_a_reference_records_no_ratios(monkeypatch):
    module = benchmark_script("rollout")
    argv = [a for a in ROLLOUT_ARGV if a not in ("--hf-python", "python")]
    _, rec = _run_main(module, monkeypatch, argv, _rollout_answer)
    assert rec["ratios_over_reference"] == {} and set(rec["sides"]) == {"ours"}


# train_step: 2 rounds x 3 steps per round, 1 warm-up step; tokens per step 8 (FakeWorker's info).
def _train_answer(name, req):
    """Step seconds by (side, batch index): ours round 0 steps 1, 2, 9 s (median 2), round 1 steps
    3, 4, 5 s (median 4); the reference (sent the tokens of that index) twice as slow on the wall,
    3x on the CPU; `fast` half as slow; warm-up batches (10**6 + w) 1000 s."""
    _train_answer.asked.append((name, req.get("index")))
    if req["cmd"] == "tokens":
        return {"tokens": [[req["index"], 7]]}
    index = req["tokens"][0] if name == "reference" else req["index"]
    wall = {0: 1.0, 1: 2.0, 2: 9.0, 3: 3.0, 4: 4.0, 5: 5.0}.get(index, 1000.0)
    wall_x, cpu_x = {"ours": (1, 1), "fast": (0.5, 0.5), "reference": (2, 3)}[name]
    return {"wall_s": wall * wall_x, "cpu_s": wall / 2 * cpu_x, "loss": 1.0, "token_sum": 6, "shape": [1, 2]}


def test_train_step_seconds_are_the_median_of_each_rounds_median_and_warmup_is_untimed(monkeypatch):
    """ours: round medians 2 and 4 s -> median 3 s/step, min 2, max 4; 8 tokens / 3 s; an arm at half
    the time: 1.5 s. Ratios ours / reference per round: 2/4 and 4/8 = 0.5 (wall); CPU (w/2) / (3w/2) = 1/3.
    The warm-up step asks for batch 10**6, never a timed one."""
    module = benchmark_script("train_step")
    _train_answer.asked = []
    name, rec = _run_main(module, monkeypatch, ["--hf-python", "python", "--rounds", "2", "--steps-per-round", "3",
                                               "--warmup", "1", "--arm", "fast:train.lr=1"], _train_answer)
    assert name == "train_step_small"
    ours = rec["sides"]["ours"]
    assert ours["seconds_per_step"]["median"] == pytest.approx(3.0)
    assert (ours["seconds_per_step"]["min"], ours["seconds_per_step"]["max"]) == pytest.approx((2.0, 4.0))
    assert ours["seconds_per_step"]["n"] == 2 and len(ours["steps"]) == 6
    assert ours["cpu_seconds_per_step"]["median"] == pytest.approx(1.5)
    assert ours["tokens_per_s_at_median"] == pytest.approx(8 / 3.0)
    assert rec["sides"]["fast"]["seconds_per_step"]["median"] == pytest.approx(1.5)
    assert rec["sides"]["reference"]["seconds_per_step"]["median"] == pytest.approx(6.0)
    assert rec["ratios"]["ours"]["time_ratio"]["median"] == pytest.approx(0.5)
    assert rec["ratios"]["fast"]["time_ratio"]["median"] == pytest.approx(0.25)
    assert rec["ratios"]["ours"]["cpu_time_ratio"]["median"] == pytest.approx(1 / 3)
    assert _train_answer.asked[0] == ("ours", 10**6) and ("ours", 0) not in _train_answer.asked[:3]
    assert set(rec["ratios"]) == {"ours", "fast"}
    assert rec["tokens_per_step"] == 8 and rec["same_tokens"] is True
    assert rec["arms"]["fast"]["overrides"] == [*module.ONE_DEVICE, "train.lr=1"]
    assert rec["method"]["warmup_steps"] == 1 and rec["method"]["steps_per_round"] == 3
    assert len(rec["load_average"]["per_round"]) == 2


def test_train_step_an_arm_is_name_commit_and_overrides_on_the_one_device_base():
    module = benchmark_script("train_step")
    assert module.parse_arm("x@abc:a.b=1,c.d=2") == ("x", [*module.ONE_DEVICE, "a.b=1", "c.d=2"], "abc")
    assert module.parse_arm("y:") == ("y", module.ONE_DEVICE, None)
    for bad in ("reference:a.b=1", ":a.b=1"):
        with pytest.raises(SystemExit):
            module.parse_arm(bad)


class _Compiled:
    """A compiled program stand-in: `lower(...).compile()` gives it back; calling it runs `fn`."""

    def __init__(self, fn):
        self.fn = fn

    def lower(self, *args):
        return self

    def compile(self):
        return self

    def __call__(self, *args):
        return self.fn(*args)


def _worker_handlers(module, monkeypatch, run, arg):
    import contextlib

    import hybridmoe.run.setup as setup_module

    setup = SimpleNamespace(context=contextlib.nullcontext, batch_sharding=lambda n: None, abstract_state=lambda: None)
    monkeypatch.setattr(setup_module, "build", lambda cfg: setup)
    monkeypatch.setattr(setup_module, "init_state", lambda setup, key: {"n": 0})
    monkeypatch.setattr(setup_module, "jit_train_step", lambda setup: _Compiled(run))
    handlers = {}
    monkeypatch.setattr(module, "serve", lambda h: handlers.update(h))
    module.our_worker(arg)
    return handlers


def test_train_step_worker_reports_tokens_per_step_and_its_batch(monkeypatch):
    """`small` one-device: 4 rows x 512 tokens = 2048 tokens a step; batch index 3's tokens in one
    micro-batch [1, 4, 512], their sum as the side's check that both sides trained on the same."""
    from hybridmoe.data.synthetic import synthetic_batch

    module = benchmark_script("train_step")
    handlers = _worker_handlers(module, monkeypatch, lambda state, batch: ({"n": state["n"] + 1}, {"loss": 2.5}),
                                module.ONE_DEVICE)
    assert handlers["info"]({})["tokens_per_step"] == 2048
    got = handlers["step"]({"index": 3})
    assert got["shape"] == [1, 4, 512] and got["loss"] == 2.5
    assert got["token_sum"] == int(synthetic_batch(0, 3, 1, 4, 512, 1024)["tokens"].sum())
    assert handlers["tokens"]({"index": 3})["tokens"] == synthetic_batch(0, 3, 1, 4, 512, 1024)["tokens"].tolist()


@pytest.mark.parametrize("share", [True, False])
def test_rollout_worker_prefills_each_prompt_once_or_every_row(share, monkeypatch):
    """Q = 2 prompts of 3 tokens, G = 4: shared, the sampler gets 2 rows and group 4; unshared, the
    8 rows (each prompt repeated 4 times) and group 1. Rows and new tokens are counted from the
    rollout's lengths (5 each: 8 rows, 40 tokens)."""
    import numpy as np

    import hybridmoe.model.params as params_module
    import hybridmoe.rl.sampler as sampler
    import hybridmoe.run.setup as setup_module

    module = benchmark_script("rollout")
    made = []

    def make_generate(cfg, options, group_size):
        made.append(group_size)
        return _Compiled(lambda params, tokens, seg, pos, key: (made.append(tokens.shape[0]),
                                                                {"lengths": np.full(8, 5)})[1])

    import contextlib

    monkeypatch.setattr(module.harness, "configure", lambda *a, **k: None)
    monkeypatch.setattr(setup_module, "build", lambda cfg: SimpleNamespace(context=contextlib.nullcontext))
    monkeypatch.setattr(params_module, "init_params", lambda specs, key: {})
    monkeypatch.setattr(sampler, "make_generate", make_generate)
    handlers = {}
    monkeypatch.setattr(module, "serve", lambda h: handlers.update(h))
    module.our_worker({"overrides": [], "share": share})
    got = handlers["generate"]({"prompts": [[5, 6, 7], [8, 9, 10]], "group_size": 4, "new_tokens": 5, "seed": 0})
    assert made[:2] == ([4, 2] if share else [1, 8])
    assert (got["rows"], got["new_tokens"]) == (8, 40)
    info = handlers["info"]({})
    assert info["prefill_once_per_prompt"] is share and list(info["compile_s"]) == [f"G{4 if share else 1}_N5"]


def test_rollout_refuses_arms_it_does_not_have(monkeypatch):
    module = benchmark_script("rollout")
    for arms in ("ours,bogus", ","):
        with pytest.raises(SystemExit, match="--arms"):
            _run_main(module, monkeypatch, ["--arms", arms], _rollout_answer)


def test_train_step_refuses_two_arms_of_one_name(monkeypatch):
    module = benchmark_script("train_step")
    for argv in (["--arm", "a:x.y=1", "--arm", "a:x.y=2"], ["--arm", "ours:x.y=1"]):
        with pytest.raises(SystemExit, match="distinct"):
            _run_main(module, monkeypatch, argv, _train_answer)
