"""docs/performance.md's sections on compiled programs and the step-time model (the 35B memory, the
depth extrapolation, the memory-only read, the seed cell's arms and the step estimates), rendered by
benchmarks/make_performance_doc.py from the records under benchmarks/records/."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from performance_doc_common import GiB, f, gib, load, mib, source, table  # noqa: E402  (puts the repository on the path)

from hybridmoe.analysis import peak_memory  # noqa: E402
from hybridmoe.analysis.step_estimate import op_path  # noqa: E402
from hybridmoe.tools.train_program import format_count_search  # noqa: E402


def inspect_35b() -> str:
    name = "inspect_qwen3.5-35b-a3b_tpu7x-2x2x1.json"
    rec = load(name)
    rows = []
    for which, p in rec["programs"].items():
        m = p["memory"]
        rows.append([which, ", ".join(f"`{o}`" for o in p["overrides"] if o != "mesh.cpu_devices=0") or "recipe defaults",
                     gib(m["argument"]), gib(m["temp"]), gib(m["total"]), f"{m['total'] / m['hbm']:.0%}",
                     "yes" if m["fits"] else "NO"])
    hbm = next(iter(rec["programs"].values()))["memory"]["hbm"]
    return f"""## Qwen3.5-35B-A3B on TPU: per-device memory from a CPU host

`hybridmoe inspect --target {rec['target']}` compiles the training step for compile-only TPU
devices (libtpu) and reads the per-device memory from the compiled program (GiB; total =
arguments + outputs - donated + temporaries; of the target's {gib(hbm)} GiB per device; batch 8 x
4096 tokens, `remat.policy=full` as the recipe pins it).

{table(["program", "overrides", "arguments", "temporaries", "total", "of HBM", "fits"], rows)}

{source(rec, name, "benchmarks/inspect_tpu_memory.sh")}
"""


def inspect_depth() -> str:
    name = "inspect_depth.json"
    rec = load(name)
    full = next(d for d in rec["depths"] if d["layers"] == rec["full_layers"])
    ms = lambda s: "-" if s is None else f"{1e3 * s:.4g}"  # noqa: E731
    rows = [[d["layers"], d["layers"] // rec["block_layers"], mib(d["argument"]), mib(d["temp"]), mib(d["total"]),
             ms(d.get("step_s")), f"{d['compile_s']:.0f}"] for d in rec["depths"]]
    ext = [[f"`--layers {e['layers_flag']}` ({e['compiled'][0]} and {e['compiled'][1]})", mib(e["per_block"]["temp"]),
            mib(e["extrapolated"]["temp"]), mib(e["extrapolated"]["total"]), mib(full["total"]),
            f"{100 * e['relative_error']['temp']:+.1f}%", f"{100 * e['relative_error']['total']:+.1f}%",
            "-" if "step_estimate" not in e else f"{100 * e['step_estimate']['relative_error']:+.1f}%",
            f"{e['compile_s']:.0f}"] for e in rec["extrapolations"]]
    overrides = " ".join(f"`{o}`" for o in rec["overrides"] if o != "mesh.cpu_devices=0")
    return f"""## Memory against depth: `inspect --layers`

The decoder runs its layers as a scan over blocks (one block = one pass of `model.layer_pattern`).
A compiled step holds one copy of the block's body, whose temporaries do not depend on the number
of blocks; what the blocks add is what the loop stacks: parameters and optimizer state (the
arguments), the per-block gradients, and the residuals the forward saves per block for the
backward. So per-device memory is affine in the number of blocks, and `hybridmoe inspect --layers
N` compiles the step at N layers and at N + one block and extrapolates along that line to the
model's depth (per block = the difference). It is not exact: the compiler schedules and packs the
deeper program on its own (buffers of one block's body can overlap the stacks differently), and a
loop of one iteration is removed outright, so N is at least two blocks. The step-time estimate
(the section above) extrapolates along the same line: it counts the layer loop's body once per
block, so it is affine while the compiler makes the same body at each depth. Below: `{rec['recipe']}`
({overrides}) for `{rec['target']}`, blocks of {rec['block_layers']} layers, compiled at each depth
and whole at {rec['full_layers']} layers (MiB per device; compile seconds on this host).

{table(["layers", "blocks", "arguments", "temporaries", "total", "step estimate (ms)", "compile s"], rows)}

{table(["extrapolation", "temporaries per block", f"temporaries at {rec['full_layers']}",
        f"total at {rec['full_layers']}", "full compile's total", "error (temporaries)", "error (total)",
        "error (step estimate)", "compile s (both)"], ext)}

{_depth_reading(rec, full)}

{source(rec, name, "python benchmarks/inspect_depth.py")}
"""


def inspect_memory_only() -> str:
    name = "inspect_memory_only.json"
    rec = load(name)
    labels = {"default_space": "XLA's default memory space", "argument": "arguments",
              "peak_buffers": "the largest buffers at the peak", "peak_categories": "the peak itemised by category",
              "collectives": "collectives", "step_estimate_s": "step estimate (collectives not overlapped)"}
    value = lambda k, v: "-" if v is None else (f"{v / GiB:.2f} GiB" if k in ("default_space", "argument")  # noqa: E731
                                                 else f"{v:.2f} s")
    rows = [[labels[k], "equal" if f["equal"] else "different",
             *((value(k, f["memory_only"]), value(k, f["whole"])) if "whole" in f else ("", ""))]
            for k, f in rec["figures"].items()]
    est = rec["figures"]["step_estimate_s"]
    est_note = ("" if est["equal"] or est["whole"] is None else
                f" The step estimate differs by {100 * (est['memory_only'] / est['whole'] - 1):+.2f}%: it is read "
                "from the optimised HLO as XLA dumped it at buffer assignment, the whole compile's from the "
                "executable's HLO, which the compiler's later passes still change.")
    return f"""## The fastest answer to "does it fit": `inspect --memory-only`

`hybridmoe inspect --memory-only` reads the compile at its buffer assignment, when XLA has written the
optimised HLO, the buffers live at the peak and its memory-usage report, and ends the process before
code generation (analysis/program.py, `read_buffer_assignment`). At `{rec['recipe']}` for
`{rec['target']}` ({rec['program']} program, the recipe's arm of the seed cell) the read came
{rec['read_s']:.0f} s into the call (mesh, tracing, lowering and the compiler's HLO passes) and the same
compile, left to finish, ended at {rec['whole_s']:.0f} s: {rec['read_s'] / rec['whole_s']:.0%} of the time (one compile, one
machine load; the machine was shared). Its figures against the whole compile's record
(`{rec['against']}`, commit {rec['against_commit'][:7]}):

{table(["figure", "against the whole compile", "memory-only", "whole compile"], rows)}

What it does not give: the compiler's memory analysis (temporaries, total, generated code), XLA's
FLOP count, and code generation's own checks (the Pallas kernels' on-chip memory, which the
validator's VMEM model refuses at load).{est_note}

{source(rec, name, "python benchmarks/inspect_memory_only.py --against " + rec["against"])}
"""


def _estimate_error_by_category(rec: dict) -> str:
    """Which categories carry the estimate's extrapolation error, and which extrapolate within 1%."""
    errs = [e["step_estimate"].get("category_relative_error", {}) for e in rec["extrapolations"] if "step_estimate" in e]
    if not errs:
        return ""
    worst = {c: max(abs(e.get(c, 0.0)) for e in errs) for c in errs[0]}
    exact = [c for c, w in worst.items() if w < 0.01]
    off = sorted((c for c in worst if c not in exact), key=lambda c: -worst[c])
    return (f" By category, {', '.join(exact)} extrapolate within 1% from every pair"
            + (f"; the error is in {' and '.join(off)} (up to {100 * worst[off[0]]:.0f}%: the ops outside the "
               f"named scopes, which do not grow block by block)." if off else "."))


def _depth_reading(rec: dict, full: dict) -> str:
    """What the depth record says, in words drawn from its figures."""
    errs = {e["layers_flag"]: e["relative_error"]["total"] for e in rec["extrapolations"]}
    best = min(errs, key=lambda n: abs(errs[n]))
    slower = [e for e in rec["extrapolations"] if e["compile_s"] > full["compile_s"]]
    time = (f"Compile time does not shrink with depth (the loop body is compiled once; times on this shared "
            f"host are noisy): the two shallow "
            f"compiles took {slower[0]['compile_s']:.0f} s together against {full['compile_s']:.0f} s for the "
            f"whole model, so at this size `--layers` saves no time; it saves time only where the whole "
            f"model's compile takes longer than two shallow ones." if slower else "")
    steps = {d["layers"]: d.get("step_s") for d in rec["depths"]}
    shallow = sorted(n for n in steps if n != rec["full_layers"] and steps[n] is not None)
    per_block = [(a, b, (steps[b] - steps[a]) * 1e3) for a, b in zip(shallow, shallow[1:])]
    est_errs = {e["layers_flag"]: e["step_estimate"]["relative_error"] for e in rec["extrapolations"]
                if "step_estimate" in e}
    estimate = ("" if not est_errs else
                f" The step estimate's extrapolation is off by "
                f"{', '.join(f'{100 * e:+.1f}% from `--layers {n}`' for n, e in est_errs.items())}; per block it "
                f"rises {', '.join(f'{ms:.3g} ms ({a} to {b} layers)' for a, b, ms in per_block)}, so where the "
                f"compiler's program changes between two depths the line through them misses."
                + _estimate_error_by_category(rec))
    return textwrap.fill(
        f"The extrapolation from {', '.join(f'`--layers {n}` ({100 * e:+.1f}%)' for n, e in errs.items())} "
        f"is closest from `--layers {best}`: the temporaries per block still grow between the shallowest "
        f"depths.{estimate} {time}", 100)


BEFORE_LM_HEAD_FIX = {"db17658", "557f88b"}  # seed-cell records compiled before f645318


def seed_cell() -> str:
    name = "seed_cell.json"
    rec = load(name)
    arms = {a["arm"]: a for a in rec["arms"]}
    labels = {"before": "masked XLA attention core", "default": "no lever",
              **{lever: f"+ {lever}" for lever in rec["order"]}, "grpo": "GRPO update, every lever",
              "sample": "sampler (prefill + decode loop), every lever"}
    rows = []
    for arm in [a for a in labels if a in arms]:
        m = arms[arm]["memory"]
        need = m["total"] if m.get("default_space") is None else m["default_space"]  # train_program.fit_bytes
        rows.append([f"`{arm}`", labels[arm], arms[arm]["program"], gib(m["argument"]), gib(m["temp"]),
                     gib(m["total"]), "-" if m.get("default_space") is None else gib(m["default_space"]),
                     f"{need / m['hbm']:.0%}", f"{need / 2**30 - rec['seed_total_gib']:+.2f}",
                     "yes" if m["fits"] else "NO", f"`{arms[arm]['commit'][:7]}`"])
    peaks = []
    for arm in [a for a in labels if a in arms]:
        for b in arms[arm]["peak_buffers"][:3]:
            peaks.append([f"`{arm}`", gib(b["bytes"]), f"`{b['shape']}`", b["where"], f"`{b['op_name'][-80:]}`"])
    itemised = _itemised_peaks(arms, labels)
    full = arms.get(rec["order"][-1], {}).get("memory", {})
    if full.get("default_space") is not None:
        beyond = full["temp"] - (full["default_space"] - full["argument"])
        uncounted = (f"at the recipe's arm, {gib(beyond)} GiB that no allocation of the buffer-assignment dump "
                     f"holds; the compiler accepted that program, {gib(full['total'])} GiB by the analysis, for "
                     f"{gib(full['hbm'])} GiB of HBM")
    else:
        uncounted = "the recipe's arm is not recorded with the report"
    # Arms recorded before a fix that changes their program, and what the fix removes.
    before_fix = [f"`{a}` ({arms[a]['commit'][:7]})" for a in arms if arms[a]["commit"][:7] in BEFORE_LM_HEAD_FIX]
    stale = (f"\n{', '.join(before_fix)} predates f645318 (the LM head's chunk loop on each device's own tokens), which "
             "removes the two 32 GiB bf16 [tokens, 4096] buffers at its peak; to be recompiled.\n") if before_fix else ""
    search = arms.get("grpo", {}).get("count_search")
    searched = "" if not search else (
        "\nThe GRPO update's micro-batches are `rl.micro_batches=auto` in the recipe, chosen by the same search a "
        "run makes (`hybridmoe/run/memory_fit.py`, `hybridmoe inspect` printing it): "
        + format_count_search(search) + ".\n")
    return f"""## The seed's cell: Qwen3.5-397B-A17B on 128 TPU v7x chips

`recipe={rec['recipe']}` compiled for `{rec['target']}` (256 devices; mesh fsdp 32 x context 4 x
expert 2; one 65,536-token sequence per context group, 16,384 tokens per device per micro-batch,
9 micro-batches). `every lever` is the recipe; each lever arm turns the levers after it in the
seed's order ({", ".join(rec["order"])}) off (the arms' overrides are in the record). GiB per
device: total = arguments + outputs - donated + temporaries, by the compiler's memory analysis (a
refused compile: the compiler's temporaries figure); `default space` = XLA's memory-usage report of
the same compile, the arguments and the heap its buffer assignment packed, which is what the TPU
compiler allocates and checks against HBM, and what the seed states its build in ("78.00 GiB in
the default memory space"). On TPU the analysis' temporaries count more than that heap ({uncounted}),
so `of HBM`, `vs seed` (against the seed's
{rec['seed_total_gib']:.2f} GiB) and `fits` read the default space where an arm has it, total
otherwise (the refused arms: inspect reads no report from a compile the compiler refused). Each arm's commit.

{table(["arm", "what", "program", "arguments", "temporaries", "total", "default space", "of HBM", "vs seed",
        "fits", "commit"], rows)}
{stale}{searched}
The largest buffers live at the peak (XLA's buffer assignment, per device):

{table(["arm", "GiB", "shape", "where", "made by"], peaks)}
{itemised}
{source(rec, name, "python benchmarks/seed_cell.py")}
"""


def _itemised_peaks(arms: dict, labels: dict) -> str:
    """The temporaries at each arm's peak by what made them (`inspect`'s itemised peak), for the
    arms recorded with it."""
    have = [a for a in labels if a in arms and arms[a].get("peak_by_category")]
    if not have:
        return ""
    cats = list(dict.fromkeys(r["category"] for a in have for r in arms[a]["peak_by_category"]["categories"]))
    rows = []
    for a in have:
        peak = arms[a]["peak_by_category"]
        by = {r["category"]: r["bytes"] for r in peak["categories"]}
        heap = peak_memory.heap_share(peak, arms[a]["memory"])
        rows.append([f"`{a}`", *(gib(by[c]) if c in by else "-" for c in cats), gib(peak["itemised"]),
                     f"{peak['share']:.0%}" if peak.get("share") is not None else "-",
                     "-" if heap is None else f"{heap:.0%}"])
    return f"""
The temporaries live at the peak by what made each buffer (GiB per device; `itemised` = their
sum, `of temporaries` = its share of the compiler's temporaries figure, `of heap` = its share of the
default memory space less the arguments, the heap buffer assignment packed; analysis/peak_memory.py
says what counts where):

{table(["arm", *cats, "itemised", "of temporaries", "of heap"], rows)}
"""


def cell_reading(rec: dict) -> str:
    """Where the `cell` arm's estimated time goes, category by category, from the record."""
    a = rec["arms"].get("cell")
    if not a or "step_s" not in a:
        return "(the seed's cell is not in this record yet)"
    seed = rec["seed"]
    cats = sorted(((c, r) for c, r in a["categories"].items() if r["s"] > 0), key=lambda kv: -kv[1]["s"])
    parts = []
    for c, r in cats:
        if c == "collectives":
            parts.append(f"{c} {r['s']:.1f} s")
            continue
        split = max(("compute", r["compute_s"]), ("memory", r["memory_s"]), ("grid steps", r["grid_s"]),
                    key=lambda kv: kv[1])
        parts.append(f"{c} {r['s']:.1f} s (mostly {split[0]}: {split[1]:.1f} s)")
    designed = a.get("designed_flops_per_device")
    flops = ("" if not designed else
             f" Its FLOPs per device, {a['hlo_flops_per_device'] / 1e12:,.0f} TFLOP as compiled (each Pallas call at "
             f"its stated count), are {a['hlo_flops_per_device'] / designed - 1:+.1%} off the design count "
             f"({designed / 1e12:,.0f} TFLOP).")
    scheduled = ("" if a.get("scheduled_step_s") is None else
                 f", and {a['scheduled_step_s']:.1f} s as the program's schedule overlaps them "
                 f"({a['exposed_async_s']:.1f} s of asynchronous work left exposed)")
    return textwrap.fill(
        f"At the seed's cell with every lever (`cell`), the estimate is {a['step_s']:.1f} s per step with the "
        f"collectives added to the compute and {a['overlapped_step_s']:.1f} s with them hidden under it{scheduled}, "
        f"against the seed's measured {seed['step_s']} s: {', '.join(parts)}.{flops}", 100) + "\n\n" + costliest_ops(a)


def costliest_ops(a: dict, per_category: int = 3, exposed: int = 5) -> str:
    """The arm's costliest code paths per category and its most exposed async work, from the
    estimate's top_op_groups and top_exposed (benchmarks/step_estimate.py keeps them): what stands
    between the estimate and a faster step."""
    top = a.get("top_op_groups")
    if not top:
        return ("(this arm's estimate predates the per-op reading: `benchmarks/step_estimate.py --from-inspect` "
                "of a new inspect record adds it)")
    rows = []
    for cat in sorted(top, key=lambda c: -a["category_s"].get(c, 0.0)):
        for r in top[cat][:per_category]:
            rows.append([cat, f"`{r['path']}`", f"{r['instructions']}", f"{r['runs']:,.0f}", f"{r['s']:.2f}",
                         f"{r['bytes'] / r['runs'] / 2**30:,.2f}" if r["runs"] else "-"])
    waits = [[f"`{op_path(r['op_name']) or '-'}`", f"`{r['name']}`", f"{r['exposed_s']:.2f}"]
             for r in (a.get("top_exposed") or [])[:exposed]]
    wait_table = ("" if not waits else "\n\nThe asynchronous work the schedule leaves most exposed (seconds per "
                  "step the compute stream waits at its done; an empty op name: the compiler kept none):\n\n"
                  + table(["op", "start", "exposed s"], waits))
    return ("Where each category's seconds go: its costliest code paths (the tail of the jax op_name the compiler "
            "kept, every instruction that runs it summed: each layer's, forward and replay), seconds per step and "
            "GiB per run:\n\n" + table(["category", "op", "instructions", "runs", "s", "GiB per run"], rows)
            + wait_table)


def step_estimate() -> str:
    name = "step_estimate.json"
    rec = load(name)
    cats = ["grouped matmuls", "attention", "GDN", "dense matmuls", "collectives", "the rest"]

    def sec(x):
        return "-" if x is None else (f"{x:.3g}" if x < 1 else f"{x:.2f}")

    rows, kernels, collectives = [], [], []
    for arm, a in rec["arms"].items():
        if "step_s" not in a:
            rows.append([f"`{arm}`", f"`{a['recipe']}` {' '.join(a['overrides'])}", a["target"], "refused"] + ["-"] * 13)
            continue
        depths = a.get("extrapolated_from")
        how = f" (extrapolated from {' and '.join(depths)} layers)" if depths else ""
        designed = a.get("designed_flops_per_device")
        rows.append([f"`{arm}`", f"`{a['recipe']}` {' '.join(a['overrides'])}{how}", a["target"], a["hardware"],
                     *(sec(a["category_s"][c]) for c in cats), sec(a["step_s"]), sec(a["overlapped_step_s"]),
                     sec(a.get("scheduled_step_s")),
                     f"{a['tokens_per_s_per_chip']:,.0f}", "-" if a["mfu"] is None else f"{a['mfu']:.1%}",
                     "-" if not designed else f"{a['hlo_flops_per_device'] / designed - 1:+.1%}",
                     a.get("commit", "")[:7] or "-"])
        for k, r in sorted(a["kernels"].items(), key=lambda kv: -kv[1]["s"]):
            kernels.append([f"`{arm}`", f"`{k}`", f"{r['calls']:.0f}", f"{r['grid_steps']:,.0f}", sec(r["s"])])
        for kind, r in sorted(a["collectives"].items(), key=lambda kv: -kv[1]["s"]):
            collectives.append([f"`{arm}`", kind, f"{r['wire_bytes'] / 2**30:,.1f}", sec(r["s"])])
    seed = rec["seed"]
    levers = []
    for arm, lever in rec.get("seed_lever_effects", {}).items():
        on, off = rec["arms"].get("cell", {}), rec["arms"].get(arm, {})
        if "step_s" in on and "step_s" in off:
            lo, hi = lever["seed_s"]
            # Two programs compiled at other commits differ in more than the lever: no effect is read.
            same = on.get("commit") == off.get("commit")
            effect = (f"{on['step_s'] - off['step_s']:+.2f}" if same else
                      f"- (compiled at {off.get('commit', '')[:7]}, the cell at {on.get('commit', '')[:7]})")
            levers.append([lever["lever"], f"`{arm}`", effect, f"{lo:+.2f}" if lo == hi else f"{lo:+.2f} to {hi:+.2f}"])
    lever_table = (table(["lever", "arm with it off", "estimated effect (s/step)", "seed, measured (s/step)"], levers)
                   if levers else "(no lever arm recorded at the cell yet)")
    return f"""## Step time on the target, estimated from the compiled program

`hybridmoe inspect` and `benchmarks/step_estimate.py` estimate a step's time on its target from
the program the compiler made for it (`hybridmoe/analysis/hlo_cost.py` counts each op's work,
`hybridmoe/analysis/step_estimate.py` prices it on the target); nothing runs on the
target. Each instruction of the optimised HLO costs the larger of its compute time (dot,
convolution and ragged-dot FLOPs from their shapes; a float32 dot at HIGHEST precision as 6 MXU
passes) and its memory time (operand and result bytes over HBM bandwidth; a slice, or an update
in place such as a loop writing one row of a stack, at the bytes it touches), times the trip counts
of the loops around it (XLA's own cost analysis counts a loop body once). A Pallas call costs what
the kernel states in its `pl.CostEstimate` (each of our TPU kernels states one, checked against
its reference in the default suite) plus a fixed cost per grid step (the grid read from the
compiled kernel); a collective, the bytes a ring algorithm sends per device over the chip's
inter-chip bandwidth. The hardware figures (bf16 and fp8 peak, HBM bandwidth, VMEM, link
bandwidth for TPU7x, H100 and H200, per device: a TPU7x chip is two devices) sit in one table in
that module, each with its public source. Seconds per step by category; `serial` adds the
collectives to the compute, `overlapped` hides them under it, `scheduled` reads the program's
schedule: asynchronous work (a collective's start and done, the SparseCore's offloaded calls) runs
while the compute between its start and its done runs, and what is left at the done is exposed
(`-`: an estimate made before the schedule was read); tokens/s per chip and MFU (the model's FLOPs
over the bf16 peak) are the serial total's.

{table(["arm", "config", "target", "on", *cats, "serial s", "overlapped s", "scheduled s", "tokens/s/chip", "MFU",
        "FLOPs vs design", "commit"], rows)}

`FLOPs vs design`: the compiled step's FLOPs per device (loops' trip counts applied, each Pallas
call at its stated count) against the count the implementation is designed to run
(`analysis/flops.designed_step_flops`: the model's matmuls with the remat policy's replay, the
chunked GDN core, the flash backward's recomputation); within 10% is the check (`-`: a remat
policy of `auto`, resolved at trace time, has no design count).

When the lever arms were last compiled (their commit in the table above), neither estimate
matched its measurement: the model gave the wi forward tile about ten times the gain the seed
measured (the fixed cost of the grid steps and the re-read bytes it saves charged at face value),
and read the GDN m scan as slightly slower than the tree it replaces, where the seed measured it
faster: the m scan was then an XLA loop whose [heads, K, K] product went through HBM at every chunk.
It is a Mosaic kernel on TPU now (`hybridmoe/kernels/gdn/pallas_cp_scans.py`), and the cell's GDN
core the XLA path; an effect is read only between programs compiled at one commit.

Each of the seed's levers at the cell, estimated (the `cell` arm's step minus the arm with the lever
off) beside the seed's measurement (each against a control in the same pod):

{lever_table}

What these arms show, read from the programs: with the Pallas kernels at their default
128 x 128 x 128 tiles the grouped matmuls' time is mostly the fixed cost of their many grid steps;
with the XLA grouped matmul on TPU the compiler computes `ragged_dot`'s weight gradient as one
masked matmul per expert over every row (a `convolution_select_fusion`, E times the useful work),
which the dense-matmul column holds where the compiler left it no name.

The seed's measured step at its cell, for comparison: {seed['step_s']} s, {seed['tokens_per_s_per_chip']:,.0f}
tokens/s per chip.

{cell_reading(rec)}

Collectives (GiB a device sends per step by a ring algorithm, estimated seconds at the link bandwidth):

{table(["arm", "kind", "GiB sent", "s"], collectives) if collectives else "(none in these arms)"}

Pallas calls (calls and grid steps per step, estimated seconds):

{table(["arm", "kernel", "calls", "grid steps", "s"], kernels) if kernels else "(none in these arms)"}

What the estimate cannot know, and so leaves out or guesses:
- overlap: the compiler's schedule decides what hides under what; the two totals bound it only if
  compute and memory themselves never overlap across ops (they do), so the truth can lie below
  the overlapped figure as well;
- the fixed cost per Pallas grid step ({rec['arms'][next(iter(rec['arms']))].get('grid_step_s', 0) * 1e6:.2f} us) is an assumed
  constant, not measured (no TPU here); `--grid-step-us` changes it;
- data-dependent work: a conditional costs its heaviest branch; a loop whose bound is data (the
  XLA flash attention's key loop) counts once and is listed; a kernel's schedule that skips
  blocks at run time (documents, padding) is costed at the static causal count its cost estimate
  states; a grouped matmul's dynamic grid at its static upper bound;
- elementwise work rides under the memory time (no vector-unit or transcendental throughput);
  fusions are costed at their boundaries (intermediates assumed on chip); layouts, padding to
  MXU tiles, DMA efficiency, ICI topology (every collective at the full per-device link
  bandwidth) and host work are not modelled;
- categories come from name scopes in the ops' metadata; an op the compiler made without any
  (and whose operands have none) falls into its loop's category or, failing that, dense matmuls
  or the rest;
- on a CPU target the program is the CPU compiler's (float32, other fusions), so an estimate for
  a TPU or GPU from it says little beyond the FLOP count.

{source(rec, name, "python benchmarks/step_estimate.py --recipe RECIPE --target TARGET --arm NAME=OVERRIDES")}
"""
