"""The record rows of the layer benchmarks (gdn_core, gmm, gmm_vmem, decode_moe, fp8_hoist) from
hand-made timings and program facts: means, ratios to the right baseline arm, units, the
bisection's resolution, the fastest path, the collectives counted per loop. Nothing compiles; the
scripts' JAX set-up on import is stubbed so this process keeps its own."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import benchmark_script_unconfigured

_load = benchmark_script_unconfigured


def _gdn_arm(what, code, backend, chunk, times, cpu_times, **more):
    return {"what": what, "code": code, "backend": backend, "chunk_size": chunk, "times": times,
            "cpu_times": cpu_times, "gflops": 1.5, "temp_bytes": 2048, "core_residual_bytes": 4096, **more}


def test_gdn_core_ratios_are_to_the_before_autodiff_arm_of_the_same_kind():
    """Layer baseline: mean of 0.1, 0.3 s = 200 ms (CPU 0.4 s = 400 ms); core baseline 10 ms (CPU 20).
    `layer now custom` 50 ms (CPU 100): 0.25 both; `core now custom` 5 ms (CPU 5): 0.5 and 0.25.
    A Pallas core off its platform: residual bytes, no times."""
    gdn = _load("gdn_core")
    arms = {
        "layer before autodiff C64": _gdn_arm("layer", "before", "xla_autodiff", 64, [0.1, 0.3], [0.4, 0.4]),
        "layer now custom C64": _gdn_arm("layer", "now", "xla", 64, [0.04, 0.06], [0.1, 0.1]),
        "core before autodiff C64": _gdn_arm("core", "before", "xla_autodiff", 64, [0.01, 0.01], [0.02, 0.02]),
        "core now custom C64": _gdn_arm("core", "now", "xla", 64, [0.004, 0.006], [0.005, 0.005]),
        "core now pallas_tpu C64": {"what": "core", "code": "now", "backend": "pallas_tpu", "chunk_size": 64,
                                    "times": None, "core_residual_bytes": 777},
    }
    rows = {r["arm"]: r for r in gdn.table_rows(arms, "cpu")}
    base = rows["layer before autodiff C64"]
    assert base["mean_ms"] == pytest.approx(200.0) and base["time_ratio_to_baseline"] == pytest.approx(1.0)
    assert base["min_ms"] == pytest.approx(100.0) and base["std_ms"] == pytest.approx(100.0)
    assert base["mean_cpu_ms"] == pytest.approx(400.0)
    layer = rows["layer now custom C64"]
    assert layer["mean_ms"] == pytest.approx(50.0) and layer["time_ratio_to_baseline"] == pytest.approx(0.25)
    assert layer["cpu_time_ratio_to_baseline"] == pytest.approx(0.25)
    core = rows["core now custom C64"]
    assert core["time_ratio_to_baseline"] == pytest.approx(0.5) and core["cpu_time_ratio_to_baseline"] == pytest.approx(0.25)
    assert (core["gflops"], core["temp_bytes"], core["core_residual_bytes"]) == (1.5, 2048, 4096)
    assert (core["what"], core["code"], core["backend"], core["chunk_size"]) == ("core", "now", "xla", 64)
    pallas = rows["core now pallas_tpu C64"]
    assert pallas["timed"] is False and pallas["why_not_timed"] == "interpreted on cpu"
    assert pallas["core_residual_bytes"] == 777 and "mean_ms" not in pallas
    assert gdn.BASELINE == {"layer": "layer before autodiff C64", "core": "core before autodiff C64"}


def test_gdn_core_residual_bytes_are_elements_times_item_size(monkeypatch):
    """Residuals f32 [2, 3, 4] (96 bytes) and bf16 [5] (10 bytes): 106."""
    gdn = _load("gdn_core")
    residuals = [SimpleNamespace(shape=(2, 3, 4), dtype=np.float32), SimpleNamespace(shape=(5,), dtype="bfloat16")]
    monkeypatch.setattr(gdn.program, "saved_residuals", lambda f, *args: residuals)
    assert gdn.core_residual_bytes((), None, "xla", 64, None) == 106


def test_gdn_core_pallas_cores_are_interpreted_off_their_platform(monkeypatch):
    gdn = _load("gdn_core")
    monkeypatch.setattr(gdn.jax, "default_backend", lambda: "cpu")
    assert gdn.interpreted("pallas_tpu") and gdn.interpreted("pallas_gpu") and not gdn.interpreted("xla")
    monkeypatch.setattr(gdn.jax, "default_backend", lambda: "tpu")
    assert not gdn.interpreted("pallas_tpu") and gdn.interpreted("pallas_gpu")


def test_gmm_ratio_is_each_arms_mean_over_the_levers_off_arms():
    """off: mean of 0.2, 0.4 s = 300 ms, spread 100 ms; wi+wo: 150 ms -> 0.5; all three 450 ms -> 1.5."""
    gmm = _load("gmm")
    arm = lambda times, extra=(): {"times": times, "overrides": list(extra), "bytes_accessed": 10,  # noqa: E731
                                   "temp_bytes": 20, "flops": 30.0}
    rows = {r["arm"]: r for r in gmm.table_rows({"wi+wo": arm([0.1, 0.2], ["a=1"]), "off": arm([0.2, 0.4]),
                                                  "all three": arm([0.45, 0.45])})}
    assert rows["off"]["mean_ms"] == pytest.approx(300.0) and rows["off"]["std_ms"] == pytest.approx(100.0)
    assert rows["off"]["time_ratio_to_off"] == pytest.approx(1.0)
    assert rows["wi+wo"]["mean_ms"] == pytest.approx(150.0) and rows["wi+wo"]["time_ratio_to_off"] == pytest.approx(0.5)
    assert rows["all three"]["time_ratio_to_off"] == pytest.approx(1.5)
    assert rows["wi+wo"]["overrides"] == ["a=1"]
    assert (rows["wi+wo"]["bytes_accessed"], rows["wi+wo"]["temp_bytes"], rows["wi+wo"]["flops"]) == (10, 20, 30.0)


def test_gmm_vmem_bisection_finds_the_smallest_accepted_limit_to_4_kib():
    """The compiler accepts from 50.95 MiB: the answer is the first 4 KiB step at or above it, within
    4 KiB (52172.8 KiB -> between 52172 and 52176 KiB)."""
    vmem = _load("gmm_vmem")
    got = vmem.smallest_limit_mib(lambda mib: mib >= 50.95)
    assert 50.95 <= got <= 50.95 + 4 / 1024
    assert vmem.smallest_limit_mib(lambda mib: True) == 4 / 1024  # accepted everywhere: one step
    assert vmem.smallest_limit_mib(lambda mib: mib >= 16) == 16.0
    assert vmem.SEED_TILE == (512, 4096, 1024)


def test_decode_moe_per_call_seconds_are_a_rounds_time_over_its_calls_and_fastest_by_cpu():
    """A round is CALLS_PER_ROUND = 20 calls: rounds of 2, 4, 6 s CPU -> median 0.2 s a call. The
    fastest path is by median CPU time even when its wall time is the slowest."""
    moe = _load("decode_moe")
    assert moe.CALLS_PER_ROUND == 20
    times = {"ragged_dot": {"cpu_s": [2.0, 4.0, 6.0], "wall_s": [1.0, 1.0, 1.0]},
             "every_expert": {"cpu_s": [1.0, 1.0, 9.0], "wall_s": [8.0, 8.0, 8.0]}}
    per_call, fastest = moe.per_call_figures(times)
    assert per_call["ragged_dot"]["cpu_s"]["median"] == pytest.approx(0.2)
    assert per_call["ragged_dot"]["cpu_s"]["max"] == pytest.approx(0.3)
    assert per_call["ragged_dot"]["wall_s"]["median"] == pytest.approx(0.05)
    assert per_call["every_expert"]["cpu_s"]["median"] == pytest.approx(0.05)
    assert fastest == "every_expert"


def _collective(kind, *, shape=(2, 4, 8), nbytes=128, depth=2, loop="while#1", trip=None, dtype="f8e4m3fn",
                op_name=""):
    return SimpleNamespace(kind=kind, shape=shape, bytes=nbytes, loop_depth=depth, loop=loop, trip_count=trip,
                           dtype=dtype, op_name=op_name)


def test_fp8_hoist_counts_expert_gathers_per_layer_loop_and_absmax_reduces_per_step():
    """Lowered: two expert-shaped f8 gathers in while#1 (128 + 64 bytes), one bf16 in while#2, and gathers
    that do not count (another shape, the micro-batch loop's depth 1, an all-reduce). Compiled: absmax
    all-reduces, two in a loop of 3 trips and one outside (1 trip): 3 + 3 + 1 = 7 executed, by loop
    {depth 1, trip 3: 2; depth 0, trip None: 1}; an all-reduce outside the scope is not counted."""
    fp8 = _load("fp8_hoist")
    assert fp8.LAYER_LOOP_DEPTH == 2
    shapes = {(2, 4, 8), (2, 8, 4)}
    lowered = [_collective("all-gather"), _collective("all-gather", shape=(2, 8, 4), nbytes=64),
               _collective("all-gather", loop="while#2", dtype="bf16", nbytes=256),
               _collective("all-gather", shape=(9, 9)), _collective("all-gather", depth=1, loop="while#0"),
               _collective("all-reduce")]
    scope = "jit(step)/fp8_absmax/reduce_max"
    compiled = [_collective("all-reduce", depth=1, trip=3, op_name=scope),
                _collective("all-reduce", depth=1, trip=3, op_name=scope),
                _collective("all-reduce", depth=0, trip=None, op_name=scope),
                _collective("all-reduce", depth=1, trip=3, op_name="jit(step)/grad_norm"),
                _collective("all-gather", depth=1, trip=3, op_name=scope)]
    got = fp8.collective_facts(lowered, compiled, shapes)
    assert got["expert_weight_gathers_per_layer_iteration"] == [
        {"loop": "while#1", "ops": 2, "bytes": 192, "dtypes": ["f8e4m3fn"]},
        {"loop": "while#2", "ops": 1, "bytes": 256, "dtypes": ["bf16"]}]
    assert got["absmax_all_reduces_executed_per_step"] == 7
    assert got["absmax_all_reduce_ops_by_loop"] == {"depth 1, trip count 3": 2, "depth 0, trip count None": 1}


def test_fp8_hoist_expert_weight_shapes_are_a_devices_share_of_wi_and_wo():
    """16 experts over 2-way expert parallelism: 8 a device; D = 256, F = 128: wi [8, 256, 256] (gate
    and up side by side), wo [8, 128, 256]."""
    fp8 = _load("fp8_hoist")
    m = SimpleNamespace(num_experts=16, d_model=256, moe_intermediate_size=128)
    assert fp8.expert_weight_shapes(m, 2) == {(8, 256, 256), (8, 128, 256)}
    assert fp8.expert_weight_shapes(m, 1) == {(16, 256, 256), (16, 128, 256)}


def test_gmm_vmem_record_rows_model_mib_disagreements_seed_and_triton(monkeypatch):
    """The compiler stubbed: it agrees with the model except at the first tile. gmm at tiles (256, 512,
    256), bf16: lhs 256 x 512 x 2 + rhs 512 x 256 x 2 + out 256 x 256 x 4 bytes = 768 KiB, two buffers
    each: 1.5 MiB against the 4 MiB limit. The seed's wi forward tile: 53 MiB at depth 2, 37 at depth
    1 (one weight buffer of 4096 x 2048 x 2 bytes = 16 MiB fewer); the compiler's bisection at 52.75
    -> 52.75. Triton at blocks 32 x 32, 3 stages, head dim 256: 114 / 130 / 130 KiB of 227."""
    import hybridmoe.tools.train_program as train_program

    vmem = _load("gmm_vmem")
    sweep = vmem.vmem_sweep
    first = sweep.POINTS[0]
    monkeypatch.setattr(train_program, "tpu_target", lambda topology: SimpleNamespace(devices=["dev"]))
    monkeypatch.setattr(sweep, "compile_verdict", lambda k, t, lim, dev: (
        (not sweep.model_verdict(k, t, lim), "vmem") if (k, t) == first else (sweep.model_verdict(k, t, lim), "")))
    monkeypatch.setattr(vmem, "seed_tile_compiles", lambda dev, depth, lim: lim >= 52.75)
    records = []
    monkeypatch.setattr(vmem.harness, "write", lambda out, name, **f: records.append(f))
    monkeypatch.setattr(sys, "argv", ["gmm_vmem.py"])
    vmem.main()
    (rec,) = records
    assert rec["disagree"] == 1 and len(rec["rows"]) == len(sweep.POINTS)
    gmm = rec["rows"][0]
    assert (gmm["kernel"], gmm["tiles"], gmm["model_mib"], gmm["limit_mib"]) == ("gmm", [256, 512, 256], 1.5, 4.0)
    assert gmm["model_fits"] is True and gmm["compiler_fits"] is False and gmm["compiler_error"] == "vmem"
    assert rec["rows"][1]["compiler_error"] is None
    assert [(s["depth"], s["model_mib"], s["compiler_min_limit_mib"]) for s in rec["seed_tile"]] == [
        (2, 53.0, 52.75), (1, 37.0, 52.75)]
    fits = rec["triton"][3]
    assert fits["blocks"] == "fits" and fits["limit_kib"] == 227.0
    assert fits["shared_kib"] == {"flash_attention_forward": 114.0, "flash_attention_dq": 130.0,
                                  "flash_attention_dkv": 130.0}


def test_gdn_core_inputs_have_the_layers_head_shapes_and_model_gates():
    """q, k [B, T, key heads 2, key dim 8]; v [B, T, value heads 4, value dim 6]; g = -0.1 softplus(.)
    in (-inf, 0); beta a sigmoid in (0, 1); both [B, T, value heads]."""
    gdn = _load("gdn_core")
    m = SimpleNamespace(gdn_num_key_heads=2, gdn_key_dim=8, gdn_num_value_heads=4, gdn_value_dim=6)
    q, k, v, g, beta = gdn.core_inputs(m, 3, 5)
    assert q.shape == k.shape == (3, 5, 2, 8) and v.shape == (3, 5, 4, 6)
    assert g.shape == beta.shape == (3, 5, 4)
    assert float(g.max()) < 0 and float(g.min()) > -0.1 * 10  # softplus of a standard normal stays below 10
    assert 0 < float(beta.min()) and float(beta.max()) < 1


def test_gdn_core_main_records_gflops_temporaries_and_skips_pallas_off_its_platform(monkeypatch):
    """Every program: 2.5e9 FLOPs (2.5 GFLOP); a layer step's temporaries 3 MiB, a core's 1 MiB; layer
    arms take 0.2 s, core arms 0.1 s, `now` arms half that: ratio 0.5 to the before-autodiff baseline
    of their kind. On CPU the two Pallas cores record residual bytes only."""
    gdn = _load("gdn_core")

    def tagged(tag):
        def fn(*args):
            return tag
        fn.tag = tag
        return fn

    fake_jax = SimpleNamespace(jit=lambda f: tagged("core"), grad=lambda f, argnums=None: f,
                               block_until_ready=lambda x: x, default_backend=lambda: "cpu",
                               devices=lambda: [SimpleNamespace(device_kind="cpu")])
    monkeypatch.setattr(gdn, "jax", fake_jax)
    monkeypatch.setattr(gdn, "before_code", lambda: ("rule_before", "layer_before"))
    monkeypatch.setattr(gdn, "core_inputs", lambda m, b, t: ("core",))
    monkeypatch.setattr(gdn, "core_residual_bytes", lambda args, rule, backend, chunk, seg: 4096)
    monkeypatch.setattr(gdn, "layer_step", lambda layer, m, backend, chunk: tagged("layer"))
    monkeypatch.setattr(gdn.harness, "layer_case", lambda cfg, kind, part: ("p", "x", "seg"))
    monkeypatch.setattr(gdn.program, "analyze", lambda fn, *a: SimpleNamespace(
        temp_bytes=(3 if fn.tag == "layer" else 1) * 2**20, cost={"flops": 2.5e9}))

    def interleaved(fns, rounds):
        out = {}
        for name in fns:
            what, version = gdn.ARMS[name][:2]
            s = (0.2 if what == "layer" else 0.1) * (0.5 if version == "now" else 1.0)
            out[name] = {"wall_s": [s] * rounds, "cpu_s": [2 * s] * rounds}
        return out

    monkeypatch.setattr(gdn.harness, "interleaved", interleaved)
    records = []
    monkeypatch.setattr(gdn.harness, "write", lambda out, name, **f: records.append(f))
    assert gdn.main(["--steps", "2"]) == 0
    rows = {r["arm"]: r for r in records[0]["rows"]}
    assert len(rows) == 12
    timed = [r for r in rows.values() if r.get("timed", True)]
    assert len(timed) == 10 and all(r["gflops"] == 2.5 for r in timed)
    assert rows["layer now custom C32"]["temp_bytes"] == 3 * 2**20 and rows["core now custom C32"]["temp_bytes"] == 2**20
    assert rows["layer now custom C32"]["mean_ms"] == pytest.approx(100.0)
    assert rows["layer now custom C32"]["time_ratio_to_baseline"] == pytest.approx(0.5)
    assert rows["core now autodiff C64"]["mean_ms"] == pytest.approx(50.0)
    assert rows["core now autodiff C64"]["cpu_time_ratio_to_baseline"] == pytest.approx(0.5)
    assert rows["core now pallas_gpu C64"]["timed"] is False and rows["core now pallas_gpu C64"]["core_residual_bytes"] == 4096


def test_gmm_main_runs_each_arm_with_its_levers_and_records_its_program(monkeypatch):
    """A stubbed program whose bytes say which levers its config turned on (wi 1, wo 2, router 4):
    each arm's row carries its own; `all three` 7. Its temporaries are 10 x the batch: the command
    line's train.batch_size=3 reaches every arm (30). Times: off 0.4 s, every lever arm 0.1 s: 0.25."""
    gmm = _load("gmm")

    def layer_step(cfg):
        levers = cfg.moe.wi_fused_swiglu * 1 + cfg.moe.wo_fused_dswiglu * 2 + cfg.moe.router_grad_from_wo_input * 4

        def fn(*args):
            return levers
        fn.levers, fn.batch = levers, cfg.train.batch_size
        return fn

    monkeypatch.setattr(gmm, "_layer_step", layer_step)
    monkeypatch.setattr(gmm.harness, "layer_case", lambda cfg, kind, part: ("p", "x", "seg"))
    monkeypatch.setattr(gmm.program, "analyze", lambda fn, *a: SimpleNamespace(
        bytes_accessed=fn.levers, temp_bytes=10 * fn.batch, cost={"flops": 100.0 * fn.levers}))
    monkeypatch.setattr(gmm.harness, "interleaved", lambda fns, rounds: {
        n: {"wall_s": [0.4 if n == "off" else 0.1] * rounds, "cpu_s": [0.0] * rounds} for n in fns})
    records = []
    monkeypatch.setattr(gmm.harness, "write", lambda out, name, **f: records.append(f))
    assert gmm.main(["recipe=tiny", "train.batch_size=3", "--steps", "2"]) == 0
    rows = {r["arm"]: r for r in records[0]["rows"]}
    assert {n: r["bytes_accessed"] for n, r in rows.items()} == {
        "off": 0, "wi_fused_swiglu": 1, "wo_fused_dswiglu": 2, "router_grad_from_wo_input": 4, "wi+wo": 3,
        "all three": 7}
    assert all(r["temp_bytes"] == 30 for r in rows.values()) and rows["wi+wo"]["flops"] == 300.0
    assert rows["wi+wo"]["time_ratio_to_off"] == pytest.approx(0.25) and rows["off"]["mean_ms"] == pytest.approx(400.0)


def _fp8_stubbed(monkeypatch, argv):
    fp8 = _load("fp8_hoist")
    calls = []

    def program_facts(overrides, recipe="small", common=None):
        calls.append((recipe, tuple(overrides)))
        return {"expert_weight_gathers_per_layer_iteration": [{"bytes": 8, "dtypes": ["f8e4m3fn"]}],
                "absmax_all_reduces_executed_per_step": 1, "memory": {"temp": 2**20},
                "absmax_all_reduce_ops_by_loop": {}, "recipe": recipe}

    monkeypatch.setattr(fp8, "program_facts", program_facts)
    monkeypatch.setattr(fp8, "run_bench", lambda recipe, common, arms, rounds: {
        name: {"seconds_per_step": 1.0 + i} for i, (name, _) in enumerate(arms)})
    records = []
    monkeypatch.setattr(fp8.harness, "write", lambda out, name, **f: records.append(f))
    monkeypatch.setattr(sys, "argv", ["fp8_hoist.py", *argv])
    fp8.main()
    return fp8, calls, records


def test_fp8_hoist_records_every_arms_facts_the_two_block_ones_and_the_timed_steps(monkeypatch):
    """Arms no_fake_quant, off, absmax, gather8 (the hoist modes with the fake quant on); the two-block
    stack for the three fake-quant arms only, on `tiny`; step times from the interleaved run."""
    fp8, calls, records = _fp8_stubbed(monkeypatch, ["--rounds", "2"])
    (rec,) = records
    assert list(rec["program"]) == ["no_fake_quant", "off", "absmax", "gather8"]
    assert list(rec["program_two_blocks"]) == ["off", "absmax", "gather8"]
    assert all(f["recipe"] == "tiny" for f in rec["program_two_blocks"].values())
    assert dict(fp8.ARMS)["absmax"] == ["quant.fp8_moe_fake_quant=true", "quant.fp8_fake_quant_hoist=absmax"]
    assert rec["step_time"]["gather8"]["seconds_per_step"] == 4.0 and rec["recipe"] == "small"
    _, _, facts_only = _fp8_stubbed(monkeypatch, ["--facts-only"])
    assert facts_only[0]["step_time"] is None


def test_fp8_hoist_program_only_keeps_the_records_step_times(monkeypatch, tmp_path):
    import hybridmoe.tools.record as record

    out = tmp_path / "fp8_hoist.json"
    out.write_text(json.dumps({"benchmark": "fp8_hoist", "step_time": {"off": {"seconds_per_step": 9.0}},
                               "program": {"old": 1}}))
    monkeypatch.setattr(record, "machine_record", lambda: {"date": "d2", "commit": "c2"})
    _fp8_stubbed(monkeypatch, ["--program-only", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["step_time"] == {"off": {"seconds_per_step": 9.0}} and "old" not in got["program"]
    assert got["program_regenerated"] == {"date": "d2", "commit": "c2"} and list(got["program"])[0] == "no_fake_quant"


def test_decode_moe_records_per_token_count_the_prediction_and_the_fastest_path(monkeypatch):
    """Paths stubbed to the identity (all agree); `small`'s MoE: 16 experts, top-4, D 256, F 128,
    128-row tiles, which the prediction is asked with (T, k, E, tile rows). Rounds of 20 calls:
    tiled128 0.1 s of CPU a round (0.005 s a call) is the fastest."""
    import numpy as np

    import benchmarks.pinned as pinned
    import hybridmoe.model.moe as moe
    import hybridmoe.model.params as params_module

    dm = _load("decode_moe")
    asked = []
    monkeypatch.setattr(pinned, "pin", lambda cores: None)
    monkeypatch.setattr(dm.harness, "configure", lambda *a, **k: None)
    monkeypatch.setattr(params_module, "init_params", lambda specs, key: {"blocks": [{"moe": {
        "router": np.zeros((1, 256, 16), np.float32), "wi": np.zeros((1, 1), np.float32),
        "wo": np.zeros((1, 1), np.float32)}}]})
    monkeypatch.setattr(moe, "route", lambda router, x, m: (None, None, None))
    for name in ("sparse_experts", "tiled_experts"):
        monkeypatch.setattr(moe, name, lambda x, *a, **k: x)
    monkeypatch.setattr(moe, "every_expert_rows", lambda x, *a: x)
    monkeypatch.setattr(moe, "every_expert_is_cheaper", lambda *a: asked.append(a) or True)
    cpu = {"ragged_dot": 0.4, "tiled128": 0.1, "row_tiles8": 0.8, "every_expert": 0.2}
    monkeypatch.setattr(dm.harness, "interleaved", lambda fns, rounds: {
        n: {"cpu_s": [cpu[n]] * rounds, "wall_s": [1.0] * rounds} for n in fns})
    records = []
    monkeypatch.setattr(dm.harness, "write", lambda out, name, **f: records.append(f))
    monkeypatch.setattr(sys, "argv", ["decode_moe.py", "--tokens", "8,16", "--steps", "2"])
    dm.main()
    (rec,) = records
    assert asked == [(8, 4, 16, 128), (16, 4, 16, 128)]
    assert rec["shape"] == {"experts": 16, "top_k": 4, "d_model": 256, "moe_intermediate_size": 128,
                            "dtype": "float32", "tile_rows_default": 128}
    t8 = rec["tokens"]["8"]
    assert t8["fastest_by_cpu_time"] == "tiled128" and t8["every_expert_is_cheaper"] is True
    assert t8["per_call"]["every_expert"]["cpu_s"]["median"] == pytest.approx(0.01)
    assert t8["max_abs_diff_vs_ragged_dot"] == {"ragged_dot": 0.0, "tiled128": 0.0, "row_tiles8": 0.0, "every_expert": 0.0}
    assert rec["method"]["calls_per_round"] == 20 and rec["method"]["rounds"] == 2 and list(rec["tokens"]) == ["8", "16"]


def test_fp8_hoist_program_facts_read_gathers_from_the_lowered_text_and_reduces_from_the_compiled(monkeypatch):
    """`small` in bf16 at 8 rows: 16 experts, D 256, F 128, no expert axis: wi [16, 256, 256]. The
    lowered program's collectives give the gathers, the compiled program's the absmax all-reduces."""
    import contextlib

    fp8 = _load("fp8_hoist")
    scope = "jit(step)/fp8_absmax/x"
    texts = {"lowered": [_collective("all-gather", shape=(16, 256, 256), nbytes=64)],
             "compiled": [_collective("all-reduce", depth=1, trip=4, op_name=scope)]}

    class Lowered:
        def as_text(self):
            return "lowered"

        def compile(self):
            return SimpleNamespace(as_text=lambda: "compiled")

    setup = SimpleNamespace(batch_sharding=lambda n: None, context=contextlib.nullcontext, abstract_state=lambda: None)
    monkeypatch.setattr(fp8, "build", lambda cfg: setup)
    monkeypatch.setattr(fp8, "jit_train_step", lambda s: SimpleNamespace(lower=lambda *a: Lowered()))
    monkeypatch.setattr(fp8, "parse_stablehlo", lambda text: texts[text])
    monkeypatch.setattr(fp8, "parse_hlo", lambda text: texts[text])
    monkeypatch.setattr(fp8, "memory_figures", lambda compiled: {"temp": 5})
    got = fp8.program_facts([])
    assert got["expert_weight_gathers_per_layer_iteration"] == [{"loop": "while#1", "ops": 1, "bytes": 64,
                                                                  "dtypes": ["f8e4m3fn"]}]
    assert got["absmax_all_reduces_executed_per_step"] == 4
    assert got["absmax_all_reduce_ops_by_loop"] == {"depth 1, trip count 4": 1}
    assert (got["num_blocks"], got["layers_per_scan_iteration"], got["memory"]) == (1, 4, {"temp": 5})
