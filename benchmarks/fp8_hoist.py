"""The fp8 fake-quant hoist on the `small` recipe's training step: program facts and step time.

Arms (8 simulated CPU devices, mesh data 2 x fsdp 4, 8 x 512 tokens, bfloat16 weights and compute, full remat
over the layer scan): no fake quantization, then quant.fp8_moe_fake_quant with the hoist off,
absmax and gather8. Per arm, from the step's programs:
- the routed-expert weight all-gathers inside each layer loop (forward, backward): dtype and
  bytes per iteration, read from the LOWERED text (the CPU backend widens f8 collectives to
  f32 when it compiles, so the compiled text shows what the CPU runs, not what a TPU/GPU moves);
- the fake quant's absmax all-reduces inside the layer loops and outside them (compiled text,
  the collectives named under the "fp8_absmax" scope);
- the compiled memory figures;
then the step time of every arm, measured interleaved in one run (hybridmoe.tools.bench).
The train step's outer loop is the micro-batch scan: the layer loops are at depth 2.

  .venv/bin/python benchmarks/fp8_hoist.py [--rounds 6]

Prints a table and writes benchmarks/records/fp8_hoist.json.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

# A compilation cache shared by the facts and the timed arms (the same programs); --cache-dir
# reuses one from an earlier run.
harness.configure(cpu_devices=8, cache=True,
                  cache_dir=sys.argv[sys.argv.index("--cache-dir") + 1] if "--cache-dir" in sys.argv else None)

import jax  # noqa: E402

from hybridmoe.analysis.program import memory_figures, parse_hlo, parse_stablehlo  # noqa: E402
from hybridmoe.tools.record import machine_record, write_record  # noqa: E402
from hybridmoe.recipe import load_config  # noqa: E402
from hybridmoe.quant.expert_fp8 import ABSMAX_SCOPE  # noqa: E402
from hybridmoe.tools.bench import run_bench  # noqa: E402
from hybridmoe.run.setup import build, jit_train_step  # noqa: E402

RECIPE = "small"
COMMON = ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16", "train.batch_size=8"]
ARMS = [("no_fake_quant", []),
        *[(mode, ["quant.fp8_moe_fake_quant=true", f"quant.fp8_fake_quant_hoist={mode}"])
          for mode in ("off", "absmax", "gather8")]]
LAYER_LOOP_DEPTH = 2  # lowered text: the micro-batch scan, then the layer scans
TWO_BLOCKS = ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16", "model.num_layers=2",
              "model.layer_pattern=[attention]", "mesh.expert=2"]


def program_facts(overrides: list[str], recipe: str = RECIPE, common=COMMON) -> dict:
    cfg = load_config(recipe, [*common, *overrides])
    m, setup = cfg.model, build(cfg)
    t = cfg.train
    batch = {k: jax.ShapeDtypeStruct((t.fewest_micro_batches, t.rows_per_micro_batch, t.seq_len), jax.numpy.int32,
                                     sharding=setup.batch_sharding(1))
             for k in ("tokens", "segment_ids", "positions")}
    with setup.context():
        lowered = jit_train_step(setup).lower(setup.abstract_state(), batch)
        compiled = lowered.compile()
    expert_shapes = expert_weight_shapes(m, cfg.mesh.expert)
    facts = collective_facts(parse_stablehlo(lowered.as_text()), parse_hlo(compiled.as_text()), expert_shapes)
    return {
        "absmax_all_reduce_ops_by_loop": facts["absmax_all_reduce_ops_by_loop"],
        "absmax_all_reduces_executed_per_step": facts["absmax_all_reduces_executed_per_step"],
        "num_blocks": m.num_blocks,
        "expert_weight_gathers_per_layer_iteration": facts["expert_weight_gathers_per_layer_iteration"],
        "memory": memory_figures(compiled),
        "layers_per_scan_iteration": len(m.layer_pattern),
    }


def expert_weight_shapes(m, expert: int) -> set:
    """The shapes of one layer's routed-expert weights on a device of an `expert`-way expert mesh:
    wi [E / expert, D, 2F] (gate and up) and wo [E / expert, F, D]."""
    e_local = m.num_experts // expert
    return {(e_local, m.d_model, 2 * m.moe_intermediate_size), (e_local, m.moe_intermediate_size, m.d_model)}


def collective_facts(lowered_collectives, compiled_collectives, expert_shapes) -> dict:
    """The expert-weight all-gathers per layer-loop iteration (the lowered program's, at
    LAYER_LOOP_DEPTH, of the expert weights' shapes): ops, bytes, dtypes per loop; and the fake
    quant's absmax all-reduces (the compiled program's): ops by loop and executed per step."""
    per_loop: dict = defaultdict(lambda: {"ops": 0, "bytes": 0, "dtypes": set()})
    for c in lowered_collectives:
        if c.kind == "all-gather" and c.loop_depth == LAYER_LOOP_DEPTH and c.shape in expert_shapes:
            row = per_loop[c.loop]
            row["ops"] += 1
            row["bytes"] += c.bytes
            row["dtypes"].add(c.dtype)
    absmax = [c for c in compiled_collectives if c.kind == "all-reduce" and ABSMAX_SCOPE in c.op_name]
    # XLA removes while loops of one trip (the micro-batch scan at micro_batches=1, and the layer
    # scan of a one-block stack such as `small`'s): in the compiled text a layer loop is a loop
    # whose trip count is the number of blocks, at whatever depth.
    by_loop = defaultdict(int)
    for c in absmax:
        by_loop[f"depth {c.loop_depth}, trip count {c.trip_count}"] += 1
    return {
        "absmax_all_reduce_ops_by_loop": dict(by_loop),
        "absmax_all_reduces_executed_per_step": sum(c.trip_count or 1 for c in absmax),
        "expert_weight_gathers_per_layer_iteration": [
            {"loop": k, "ops": v["ops"], "bytes": v["bytes"], "dtypes": sorted(v["dtypes"])}
            for k, v in sorted(per_loop.items())],
    }


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cache-dir", help="a compilation cache directory to reuse")
    ap.add_argument("--facts-only", action="store_true", help="program facts only, no timed steps")
    ap.add_argument("--program-only", action="store_true",
                    help="recompute the program facts into an existing record at --out, keeping its step times")
    args = ap.parse_args()
    facts = {name: program_facts(o) for name, o in ARMS}
    # The layer loop of a two-block stack (the tests' model: two attention layers, experts over
    # data 2 x fsdp 2 x expert 2): where the in-loop absmax all-reduces are visible.
    two_blocks = {name: program_facts(o, "tiny", TWO_BLOCKS) for name, o in ARMS if name != "no_fake_quant"}
    if args.program_only:
        record = json.loads(Path(args.out).read_text())
        record.update({"program": facts, "program_two_blocks": two_blocks, "two_blocks": TWO_BLOCKS,
                       "program_regenerated": machine_record()})
        write_record(Path(args.out), record)
        return
    if args.facts_only:
        timed = {name: {"seconds_per_step": float("nan")} for name, _ in ARMS}
    else:
        timed = run_bench(RECIPE, COMMON, ARMS, args.rounds)
    base = timed["off"]["seconds_per_step"]
    print(f"{'arm':<14} {'gather B/iter fwd,bwd':>22} {'dtype':>10} {'absmax AR/step':>15} "
          f"{'temp MiB':>9} {'s/step':>8} {'vs off':>7}")
    for name, f in facts.items():
        g = f["expert_weight_gathers_per_layer_iteration"]
        print(f"{name:<14} {','.join(str(x['bytes']) for x in g):>22} {','.join(sorted({d for x in g for d in x['dtypes']})):>10} "
              f"{f['absmax_all_reduces_executed_per_step']:>15} "
              f"{f['memory'].get('temp', 0) / 2**20:>9.2f} {timed[name]['seconds_per_step']:>8.3f} "
              f"{timed[name]['seconds_per_step'] / base:>7.3f}")
    for name, f in two_blocks.items():
        print(f"two blocks {name:<8} absmax all-reduce ops by loop {f['absmax_all_reduce_ops_by_loop']}")
    harness.write(args.out, "fp8_hoist", recipe=RECIPE, common=COMMON, program=facts, program_two_blocks=two_blocks,
                  two_blocks=TWO_BLOCKS, step_time=None if args.facts_only else timed)


if __name__ == "__main__":
    main()
