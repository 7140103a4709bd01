"""Every kernel case timed on this host's TPU chip, beside the chip's measured matmul ceiling.

    python3 benchmarks/tpu_kernels.py                        # on a TPU host (docs/tpu.md), ~6 minutes
    python3 benchmarks/tpu_kernels.py --geometry one_chip    # one geometry, merged into the record
    python3 benchmarks/tpu_kernels.py --only gdn_cell,attention_one_chip
    python3 benchmarks/tpu_kernels.py --missing              # the cases the record has no figures for
    python3 benchmarks/tpu_kernels.py --tiny                 # CPU, interpret mode, tiny shapes: a smoke run

The cases are hybridmoe/tools/chip_cases.py's (grouped matmul, MoE MLP, GDN core, flash attention,
the context-parallel M and dS scans) at the seed cell's per-device shapes (`<family>_cell`) and at
the one-chip recipe's (`<family>_one_chip`), every backend of each: ours (XLA and Pallas), jax's
ragged_dot and splash attention, tokamax's where it imports. Per case: its float32 reference first
(nothing else on the chip), then its inputs (shared by its backends), each backend compiled (its
compile seconds recorded) and run once (the relative error from that run: max |out - ref| / max |ref|
over the output and every gradient), then `--rounds` rounds of every backend, forward and forward +
backward, in a rotating order (tools: benchmarks/harness.py's interleaved), each call waited for;
the median. A backend that fails records its error and the rest go on. The chip's ceiling is a bf16
8192^3 matmul, median of 10, in the same process.

Time: a case starts only while less than --budget-s seconds have passed; the others are left out
(run them with --only or --geometry). The cases run in a child process that this one watches: a case
still running after --case-share-s seconds (a kernel that hangs, a compile that never ends) is
stopped with its process, recorded as cut with the reason (how long, and the last thing it printed:
which backend, compile or timing), and the cases after it go on in a fresh child. An existing record of the same device is merged into: the
cases run now replace theirs, the others keep their earlier figures and the commit they were
measured at, beside that run's ceiling (cases: name -> commit, ceiling_tflops). The record is rewritten after every case, so a run cut short
keeps what it finished.

Writes benchmarks/records/tpu_kernels.json: device, commit, ceiling_tflops, kernels: name ->
backend -> {ms (forward + backward where the family has a backward, else forward), fwd_ms, tflops
(useful, of ms), fwd_tflops, rel_err, fwd_rel_err, compile_s}; cases: name -> shape, useful flops,
skipped backends and why, the reference's seconds, or why the case was not run.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

GEOMETRIES = ("cell", "one_chip")


def matmul_ceiling_tflops(size: int, repeats: int = 10) -> float:
    """bf16 size^3 matmul: useful TFLOP/s, median of `repeats` after one warm call."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    mm = jax.jit(jnp.matmul).lower(a, b).compile()
    jax.block_until_ready(mm(a, b))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(a, b))
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e12


def _error_text(e: BaseException) -> str:
    lines = [ln for ln in traceback.format_exception_only(e)[-1].strip().splitlines() if ln.strip()]
    return " ".join(lines)[:600]


def device_ops(compiled, args, calls: int = 2, top: int = 8) -> dict:
    """Where one compiled program's device time goes: `calls` runs under JAX's profiler
    (tools/profile.trace_ops), each op's own milliseconds per call, named by its Pallas kernel where it
    is one (analysis/hlo_cost's reading of the Mosaic call) else by its HLO instruction with the
    model's category: {"ops": the `top` heaviest [{op, category, ms}], "other_ms": the rest,
    "traced_ms": all of them}."""
    from hybridmoe.analysis.hlo_cost import Estimator
    from hybridmoe.tools import profile

    text = compiled.as_text()
    ops = profile.trace_ops(lambda: compiled(*args), calls, profile.module_name(text))
    named = {name: c for name, c, _ in Estimator(text).named_ops()}
    rows = []
    for name, op in ops.items():
        c = named.get(name)
        rows.append({"op": c.kernel if c is not None and c.kernel else name,
                     "category": c.category if c is not None else profile.UNMATCHED, "ms": 1e3 * op.seconds})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return {"ops": rows[:top], "other_ms": total - sum(r["ms"] for r in rows[:top]), "traced_ms": total}


def run_case(case, rounds: int, log, profile_ops: int = 0) -> tuple[dict, dict]:
    """(backend -> figures, the case's own facts) of one chip_cases.Case; with profile_ops > 0 each
    backend's programs also run under the profiler (device_ops: that many heaviest ops, `<part>_ops`)."""
    import jax

    from hybridmoe.tools.chip_cases import relative_error

    facts = {"shape": case.shape, "flops_fwd": case.flops[0], "flops_fwd_bwd": case.flops[1],
             "skipped": dict(case.skipped)}
    t0 = time.perf_counter()
    try:
        ref = case.reference()
    except Exception as e:  # noqa: BLE001 - recorded, the timings still run
        ref, facts["reference_error"] = None, _error_text(e)
    facts["reference_s"] = round(time.perf_counter() - t0, 2)
    inputs = case.make_inputs()
    programs, out = {}, {}
    for name, build in case.backends.items():
        row = out[name] = {"compile_s": {}}
        try:
            built = build(inputs)
            for part, pair in (("fwd", built.fwd), ("fwd_bwd", built.fwd_bwd)):
                if pair is None:
                    continue
                fn, args = pair
                t0 = time.perf_counter()
                compiled = fn.lower(*args).compile()
                row["compile_s"][part] = round(time.perf_counter() - t0, 2)
                result = jax.block_until_ready(compiled(*args))
                if ref is not None:
                    expected = ref.fwd if part == "fwd" else ref.fwd_bwd
                    backward = part == "fwd_bwd"
                    row[f"{part}_rel_err"] = relative_error(case.view(built.restore(result, backward), backward=backward),
                                                            expected)
                del result
                programs[(name, part)] = (compiled, args)
        except Exception as e:  # noqa: BLE001 - one backend's failure is recorded, the others run
            row["error"] = _error_text(e)
            for part in ("fwd", "fwd_bwd"):
                programs.pop((name, part), None)
        log(f"  {case.name} {name}: compiled {row['compile_s']}" + (f" ERROR {row['error']}" if "error" in row else ""))
    for part in ("fwd", "fwd_bwd"):
        calls = {name: (lambda c=c, a=a: c(*a)) for (name, p), (c, a) in programs.items() if p == part}
        if not calls:
            continue
        times = harness.interleaved(calls, rounds)
        for name, t in times.items():
            out[name][f"{part}_ms"] = 1e3 * statistics.median(t["wall_s"])
        if profile_ops:
            for (name, p), (compiled, args) in programs.items():
                if p == part:
                    traced = out[name][f"{part}_ops"] = device_ops(compiled, args, top=profile_ops)
                    log(f"  {case.name} {name} {part} on the device, {traced['traced_ms']:.2f} ms traced: "
                        + ", ".join(f"{r['op']} {r['ms']:.2f}" for r in traced["ops"])
                        + f", other {traced['other_ms']:.2f}")
    for name, row in out.items():
        flops_fwd, flops_both = case.flops
        if "fwd_ms" in row:
            row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
        both = "fwd_bwd_ms" in row
        row["ms"] = row.get("fwd_bwd_ms" if both else "fwd_ms")
        row["tflops"] = (flops_both if both else flops_fwd) / row["ms"] / 1e9 if row["ms"] else None
        row["rel_err"] = row.get("fwd_bwd_rel_err" if both else "fwd_rel_err")
        row["fwd_rel_err"] = row.get("fwd_rel_err")
    del programs, inputs
    gc.collect()
    return out, facts


def format_table(kernels: dict, facts: dict, ceiling: float | None) -> str:
    lines = [f"{'case':<22}{'backend':<20}{'fwd ms':>9}{'ms':>9}{'TFLOP/s':>9}{'of peak':>8}"
             f"{'rel err':>10}{'fwd err':>10}"]
    fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"  # noqa: E731
    for name, backends in kernels.items():
        for backend, why in facts.get(name, {}).get("skipped", {}).items():
            lines.append(f"{name:<22}{backend:<20}  skipped: {why}")
        for backend, r in backends.items():
            if "error" in r and r.get("ms") is None:
                lines.append(f"{name:<22}{backend:<20}  error: {r['error'][:70]}")
                continue
            share = r["tflops"] / ceiling if ceiling and r.get("tflops") else None
            lines.append(f"{name:<22}{backend:<20}{fmt(r.get('fwd_ms'), '9.2f')}{fmt(r.get('ms'), '9.2f')}"
                         f"{fmt(r.get('tflops'), '9.1f')}{fmt(share, '8.0%')}{fmt(r.get('rel_err'), '10.1e')}"
                         f"{fmt(r.get('fwd_rel_err'), '10.1e')}")
    return "\n".join(lines)


def run_watched(args) -> int:
    """The cases of `args` in watched child processes (harness.watched): a case past its share is
    stopped and recorded as cut in the record, and the cases after it run in a fresh child."""
    from hybridmoe.tools import chip_cases

    geometries = ("tiny",) if args.tiny else tuple(args.geometry or GEOMETRIES)
    # Names only: this process never starts JAX's backend (the chip is held by one process at a time).
    names = args.only.split(",") if args.only else [f"{f}_{g}" for g in geometries for f in chip_cases.FAMILY_NAMES]
    if args.missing:
        timed = set(_read(Path(args.out)).get("kernels", {}))
        print(f"--missing: {', '.join(sorted(timed & set(names))) or 'none'} already timed in {args.out}; left out",
              flush=True)
        names = [n for n in names if n not in timed]
    cuts: dict[str, str] = {}
    start = time.perf_counter()
    while names:
        left = args.budget_s - (time.perf_counter() - start)
        child = [sys.executable, __file__, "--in-process", "--only", ",".join(names), "--rounds", str(args.rounds),
                 "--budget-s", str(max(left, 0.0)), "--out", args.out, "--profile-ops", str(args.profile_ops)]
        if args.compile_cache:
            child += ["--compile-cache", args.compile_cache]
        if args.tiny:
            child.append("--tiny")
        ended = harness.watched(child, args.case_share_s)
        if ended.cut is None:
            break
        cuts[ended.cut] = ended.reason(args.case_share_s)
        print(f"{ended.cut}: cut, {cuts[ended.cut]}", flush=True)
        record_cut(Path(args.out), ended.cut, cuts[ended.cut])
        names = names[names.index(ended.cut) + 1:]
    for name, reason in cuts.items():  # again at the end: a later child rewrites the record
        record_cut(Path(args.out), name, reason)
    return 0 if ended.cut is not None else (ended.returncode or 0)


def _read(out: Path) -> dict:
    """The record at `out` ({} when there is none yet)."""
    return json.loads(out.read_text()) if out.is_file() and out.stat().st_size else {}


def record_cut(out: Path, name: str, reason: str) -> None:
    """Write into the record that case `name` was cut, and why; its earlier figures, if any, go (they
    would read as this commit's)."""
    from hybridmoe.tools.record import source_commit, write_record

    record = _read(out) or None
    if record is None:  # cut before any case was written: the device, ceiling and machine come with the next
        record = {"benchmark": "tpu_kernels", "commit": source_commit(), "kernels": {}, "cases": {}}
    record["kernels"].pop(name, None)
    record["cases"][name] = {"cut": reason, "commit": source_commit()}
    write_record(out, record)


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--geometry", choices=GEOMETRIES, action="append",
                   help="cell or one_chip (repeatable; default both, cell first)")
    p.add_argument("--only", help="comma-separated case names (e.g. gdn_cell,gmm_one_chip); merged into --out")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median); default 5")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="start no case after this many seconds (default 330: the whole run within ~6 minutes)")
    p.add_argument("--case-share-s", type=float, default=150.0,
                   help="stop a case that runs longer than this and record it as cut (default 150)")
    p.add_argument("--missing", action="store_true",
                   help="only the cases (of --geometry or --only) the record at --out has no figures for, at any commit")
    p.add_argument("--in-process", action="store_true",
                   help="run the cases in this process, unwatched (what each watched child does)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU, interpret mode, the tiny geometry; writes a temporary record unless --out is given")
    p.add_argument("--compile-cache", help="JAX's persistent compile cache folder (a second run compiles nothing)")
    p.add_argument("--profile-ops", type=int, default=0, metavar="N",
                   help="also run each program twice under JAX's profiler and record its N heaviest device ops "
                   "(Pallas kernels by name) per call: <part>_ops (default 0: no profile)")
    args = p.parse_args(argv)
    if args.tiny and args.out == p.get_default("out"):
        args.out = tempfile.mkstemp(prefix="tpu_kernels_tiny_", suffix=".json")[1]
    if not args.in_process:
        return run_watched(args)
    harness.configure(cpu_only=args.tiny, cache_dir=args.compile_cache)
    import jax

    from hybridmoe.tools import chip_cases

    if not args.tiny and jax.default_backend() != "tpu":
        raise SystemExit(f"tpu_kernels times the kernels on a TPU chip; this host's JAX sees {jax.default_backend()} "
                         "(--tiny runs the tiny geometry interpreted on CPU)")
    geometries = ("tiny",) if args.tiny else tuple(args.geometry or GEOMETRIES)
    all_cases = {n: c for g in geometries for n, c in chip_cases.cases(g, interpret=args.tiny).items()}
    names = args.only.split(",") if args.only else list(all_cases)
    unknown = sorted(set(names) - set(all_cases))
    if unknown:
        raise SystemExit(f"--only: unknown cases {unknown}; known: {', '.join(all_cases)}")

    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)  # noqa: E731
    from hybridmoe.tools.record import machine_record, source_commit

    kernels, facts = {}, {}
    previous = Path(args.out)
    if previous.is_file() and previous.stat().st_size:  # the same device's earlier cases stay (their commits)
        old = json.loads(previous.read_text())
        if old.get("device") in (None, machine_record()["device"]):  # None: only cuts written so far
            kernels, facts = old.get("kernels", {}), old.get("cases", {})
    ceiling = matmul_ceiling_tflops(256 if args.tiny else 8192, 3 if args.tiny else 10)
    log(f"bf16 matmul ceiling {ceiling:.1f} TFLOP/s on {jax.devices()[0].device_kind}")

    def write():
        harness.write(args.out, "tpu_kernels", ceiling_tflops=ceiling, kernels=kernels, cases=facts,
                      rounds=args.rounds, interpret=args.tiny,
                      versions=harness.package_versions("tokamax"),
                      method="tools/chip_cases.py's cases; per case its float32 reference, then every backend compiled "
                             "and run once (rel_err: max |out - ref| / max |ref| over the output and the gradients), "
                             f"then {args.rounds} rounds of the backends interleaved (rotating order, each call waited "
                             "for), the median; ms is forward + backward where the family has one; tflops are useful "
                             "FLOPs (chip_cases' docstring) per second; ceiling: a bf16 8192^3 matmul, median of 10")

    for name in names:
        if time.perf_counter() - start > args.budget_s:
            if name not in kernels:
                facts[name] = {"not_run": f"past the {args.budget_s:.0f} s budget: run it with --only {name}"}
            log(f"{name}: left out (budget)" + (f"; the record keeps the run at {facts[name].get('commit')}"
                                                 if name in kernels else ""))
            continue
        log(f"{name} ...")
        harness.mark("start", name)
        case_start = time.perf_counter()
        kernels[name], facts[name] = run_case(all_cases[name], args.rounds, log, args.profile_ops)
        facts[name].update(seconds=round(time.perf_counter() - case_start, 1), commit=source_commit(),
                           ceiling_tflops=ceiling)
        write()
        harness.mark("done", name)
    write()
    print(format_table({n: kernels[n] for n in names if n in kernels}, facts, ceiling))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
