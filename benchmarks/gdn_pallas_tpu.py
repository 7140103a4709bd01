"""The chunk-parallel Pallas GDN core (kernels/gdn/pallas_tpu.py) against the XLA path: the variants a
TPU chip should time, and what this CPU host can say without one.

    python -m benchmarks.gdn_pallas_tpu --tiny            # CPU: every variant interpreted at tiny shapes
    python -m benchmarks.gdn_pallas_tpu --time cell       # on a TPU: time the variants (docs/tpu.md)
    python -m benchmarks.gdn_pallas_tpu                   # CPU: compile-only facts for a TPU target

`benchmark_case(geometry)` is tools/chip_cases.py's gdn case (its inputs, float32 reference and
view) with more backends: `xla`, `pallas_tpu` (the defaults: precision "bfloat16x3_bf16_inverse", every
product three bfloat16 passes but the triangular inverse's doubling; the default chunks per grid step),
`pallas_tpu_bfloat16x3` (every product three passes, the XLA path's errors), `pallas_tpu_bfloat16`
(one pass where the field's tolerance allows: faster, larger errors), `pallas_tpu_steps_1` and
`pallas_tpu_steps_4` (one and four chunks per grid step). It runs through
benchmarks/tpu_kernels.py's `run_case` (each backend compiled, run once for its relative error
against the reference, then timed in interleaved rounds), so one call on the chip measures them all:

    from benchmarks.gdn_pallas_tpu import benchmark_case
    from benchmarks.tpu_kernels import run_case
    rows, facts = run_case(benchmark_case("cell"), rounds=5, log=print)

Without --time or --tiny: jax.grad of sum(o) compiled for one device of a compile-only TPU topology
(libtpu, the test extra) at one geometry (one_chip: Qwen3.5-35B-A3B's per-device layer), per backend: compile seconds on this host, the compiled
program's memory, the Pallas kernels' stated FLOPs and bytes (their cost estimates) and their
modelled VMEM. No chip runs anything then: no time. Writes benchmarks/records/gdn_pallas_tpu.json.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure()  # the commit the record names, read before anything runs

MIB = 2**20
# Variant name -> pallas_tpu.gated_delta_rule's keyword arguments (xla: the XLA path).
VARIANTS = {
    "xla": None,
    "pallas_tpu": {},
    "pallas_tpu_bfloat16x3": {"precision": "bfloat16x3"},
    "pallas_tpu_bfloat16": {"precision": "bfloat16"},
    "pallas_tpu_steps_1": {"chunks_per_step": 1},
    "pallas_tpu_steps_4": {"chunks_per_step": 4},
}


def _rule(g: dict, interpret: bool, options):
    from hybridmoe.kernels.gdn import gated_delta_rule, pallas_tpu

    if options is None:
        return lambda q, k, v, gate, beta, seg: gated_delta_rule(
            q, k, v, gate, beta, segment_ids=seg, chunk_size=g["chunk"], backend="xla")[0]
    return lambda q, k, v, gate, beta, seg: pallas_tpu.gated_delta_rule(
        q, k, v, gate, beta, segment_ids=seg, chunk_size=g["chunk"], interpret=interpret, **options)[0]


def benchmark_case(geometry: str = "cell", *, interpret: bool | None = None, variants=tuple(VARIANTS)):
    """tools/chip_cases.py's gdn case at `geometry` (cell: the 397B cell's per-device layer; one_chip;
    edges; tiny) with a backend per variant (VARIANTS), each building jitted forward and forward +
    backward programs on the case's shared inputs."""
    import jax

    from hybridmoe.tools import chip_cases

    case = chip_cases.cases(geometry, interpret=interpret, families=["gdn"])[f"gdn_{geometry}"]
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret

    def builder(fn):
        def build(inputs=None):
            args, cot = case.make_inputs() if inputs is None else inputs
            return chip_cases.Built((jax.jit(fn), args),
                                    (jax.jit(chip_cases.with_gradients(fn, (0, 1, 2, 3, 4))), (*args, cot)))
        return build

    backends = {name: builder(_rule(case.shape, interpret, VARIANTS[name])) for name in variants}
    return dataclasses.replace(case, backends=backends)


def _time(geometry: str, rounds: int) -> dict:
    from benchmarks.tpu_kernels import run_case

    rows, facts = run_case(benchmark_case(geometry), rounds, log=print)
    return {"geometry": geometry, "rows": rows, "facts": facts}


# ---------------------------------------------------------------------------------------------
# Compile-only facts on this host


def _stated_costs(compiled_text: str) -> dict:
    """{kernel: {flops, bytes}} of the Mosaic calls' cost estimates in a compiled program."""
    from hybridmoe.analysis import hlo_cost

    comps, _ = hlo_cost.parse_module(compiled_text)
    out = {}
    for body in comps.values():
        types = {i.name: i.type_text for i in body}
        for i in body:
            if i.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in i.attrs:
                cost = hlo_cost.pallas_call_cost(i, types)
                out[cost["kernel"]] = {"flops": cost["flops"], "bytes": cost["bytes"]}
    return out


def compiled_facts(geometry: str, variant: str, device) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from hybridmoe.tools import chip_cases

    g = chip_cases.GEOMETRIES[geometry]["gdn"]
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))  # noqa: E731
    t, hk, hv = g["tokens"], g["key_heads"], g["value_heads"]
    args = (spec((1, t, hk, g["key_dim"]), jnp.bfloat16), spec((1, t, hk, g["key_dim"]), jnp.bfloat16),
            spec((1, t, hv, g["value_dim"]), jnp.bfloat16), spec((1, t, hv), jnp.float32), spec((1, t, hv), jnp.float32),
            spec((1, t), jnp.int32))
    rule = _rule(g, False, VARIANTS[variant])
    loss = lambda *a: jnp.sum(rule(*a).astype(jnp.float32))  # noqa: E731
    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    return {"backend": variant, "compile_s": round(time.perf_counter() - t0, 1),
            "argument_bytes": memory.argument_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
            "output_bytes": memory.output_size_in_bytes, "pallas_kernels": text.count("tpu_custom_call"),
            "kernels": _stated_costs(text)}


def vmem(geometry: str) -> dict:
    from hybridmoe.kernels.gdn import limits
    from hybridmoe.tools import chip_cases

    g = chip_cases.GEOMETRIES[geometry]["gdn"]
    needs = limits.vmem_needs(0.0, chunk_size=g["chunk"], key_dim=g["key_dim"], value_dim=g["value_dim"],
                              group=g["value_heads"] // g["key_heads"], itemsize=2)
    return {k: round(n.need_bytes / MIB, 2) for k, n in needs.items()}


def tiny_smoke() -> dict:
    """Every variant at the tiny geometry, interpreted on CPU: relative error of forward and
    forward + backward against the float32 reference (what the chip run reports, at small scale)."""
    import jax

    from hybridmoe.tools.chip_cases import relative_error

    case = benchmark_case("tiny", interpret=True)
    ref = case.reference()
    inputs = case.make_inputs()
    errors = {}
    for name, build in case.backends.items():
        built = build(inputs)
        fwd = jax.block_until_ready(built.fwd[0](*built.fwd[1]))
        both = jax.block_until_ready(built.fwd_bwd[0](*built.fwd_bwd[1]))
        errors[name] = {"fwd_rel_err": relative_error(case.view(built.restore(fwd, False), backward=False), ref.fwd),
                        "rel_err": relative_error(case.view(built.restore(both, True), backward=True), ref.fwd_bwd)}
    return errors


def main(argv=None) -> int:
    parser = harness.parser(__doc__, __file__)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: every variant interpreted at tiny shapes")
    parser.add_argument("--time", metavar="GEOMETRY", help="on a TPU: time the variants at a chip_cases geometry")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--geometry", default="one_chip", help="the compile-only facts' chip_cases geometry")
    args = parser.parse_args(argv)
    if args.tiny:
        for name, row in tiny_smoke().items():
            print(f"{name:<24} fwd rel_err {row['fwd_rel_err']:.2e}  fwd+bwd rel_err {row['rel_err']:.2e}")
        return 0
    if args.time:
        result = _time(args.time, args.rounds)
        for name, row in result["rows"].items():
            print(f"{name:<24} fwd {row.get('fwd_ms', float('nan')):8.2f} ms  fwd+bwd {row.get('ms') or float('nan'):8.2f} ms"
                  f"  rel_err {row.get('rel_err')}")
        return 0
    from hybridmoe.tools import chip_cases
    from hybridmoe.tools.train_program import tpu_target

    device = tpu_target(args.topology).devices[0]
    rows = []
    for variant in VARIANTS:
        rows.append(compiled_facts(args.geometry, variant, device))
        print(f"{variant:<24} compile {rows[-1]['compile_s']:6.1f} s  temp {rows[-1]['temp_bytes'] / MIB:8.1f} MiB  "
              f"kernels {rows[-1]['kernels']}")
    g = chip_cases.GEOMETRIES[args.geometry]["gdn"]
    harness.write(
        args.out, "gdn_pallas_tpu",
        config={"topology": args.topology, "geometry": args.geometry, "batch": 1, "tokens": g["tokens"],
                "key_heads": g["key_heads"], "value_heads": g["value_heads"], "key_dim": g["key_dim"],
                "value_dim": g["value_dim"], "chunk_size": g["chunk"], "documents": g["documents"],
                "variants": VARIANTS, "vmem_model_mib": vmem(args.geometry),
                "inputs": "q, k, v bfloat16; g, beta float32; packed documents (tools/chip_cases.py's gdn case)"},
        method="jax.grad of sum(o) w.r.t. q, k, v, g, beta lowered and compiled for one device of a compile-only "
               "TPU topology on this CPU host; memory from the compiled program; the kernels' FLOPs and bytes "
               "are their stated cost estimates (every bfloat16 pass counted)",
        rows=rows,
        not_measured="time: compile-only facts; on a TPU, --time GEOMETRY (or benchmark_case through "
                     "benchmarks/tpu_kernels.py's run_case) times every variant",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
