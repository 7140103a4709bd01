"""Write docs/performance.md from the records under benchmarks/records/ (so its figures cannot go stale).

    python benchmarks/make_performance_doc.py            # rewrite docs/performance.md
    python benchmarks/make_performance_doc.py --check    # exit 1 if it differs from the records

Every figure in the page is read from a record here; the prose says what was measured, never a
number of its own. A new benchmark adds a section function to SECTIONS (and its record);
`tests/test_docs.py` checks that the committed page equals this script's output. Records that are
known to be wrong or about to be remeasured are listed in PENDING and shown without figures.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from performance_doc_common import DOC, RECORDS, REFERENCE_PYTHON, ROOT, f, load, mib, source, table  # noqa: E402
from performance_doc_program import inspect_depth, inspect_memory_only, seed_cell, step_estimate  # noqa: E402

# record file -> why its figures are not shown until it is regenerated.
PENDING = {
    "step_anatomy_ours.json": "our side of an earlier step anatomy, superseded by `step_anatomy.json`",
    "inspect_qwen3.5-35b-a3b_tpu7x-2x2x1.json": "compiled before the chunked LM head and the weights over every "
                                                 "data-parallel axis changed the step; `benchmarks/inspect_tpu_memory.sh`",
}


# ------------------------------------------------------------------------------------------------
# Sections (those on compiled programs and the step-time model: performance_doc_program.py)


def demo_curves() -> str:
    name = "demo_curves.json"
    rec = load(name)
    rows = []
    for run, r in rec["runs"].items():
        rows.append([f"`{run}`", f"{f(r['reward_first'])} -> {f(r['reward_last'])}",
                     ", ".join(f(x) for x in r["reward_mean_per_10_steps"]), f(r["pg_clipfrac_mean"]),
                     f"{f(r['ratio_min_mean'])} / {f(r['ratio_max_mean'])}", f"{r['sampler_gap_mean_mean']:.1e}",
                     f(r["is_weight_mean_mean"], 4), f"{r['wall_s']:.0f} s"])
    first = next(iter(rec["runs"].values()))
    return f"""## The demo's GRPO curves

`make demo` (`demo` recipe) and its off-policy variant `demo-tis` (sampling at T = 0.8, two updates
per rollout, TIS). The supervised warm-up's loss falls {first['warmup_loss_first']:.2f} ->
{first['warmup_loss_last']:.2f}; then the mean reward of the sampled completions over the GRPO
steps (first -> last step, and averaged per 10 steps), the clip fraction, the ratio's min / max
(mean over steps), the mean |log pi_train - log pi_sampler| and the mean TIS weight:

{table(["run", "reward first -> last", "per 10 steps", "clipfrac", "ratio min / max", "sampler gap", "TIS weight", "wall"], rows)}

{source(rec, name, "python benchmarks/demo_curves.py")} Plots: `docs/demo_curves.png`,
`docs/demo_metrics.png`.
"""


def gmm_levers() -> str:
    name = "gmm.json"
    rec = load(name)
    rows = [[f"`{r['arm']}`", ", ".join(f"`{o}`" for o in r["overrides"]) or "-", f(r["mean_ms"], 1),
             f(r["time_ratio_to_off"]), f"{r['bytes_accessed'] / 1e6:.1f}", mib(r["temp_bytes"])] for r in rec["rows"]]
    return f"""## MoE grouped-matmul levers (CPU)

The MoE layer of the `small` recipe, forward + backward; {rec['method']}. On CPU the fused
epilogues are jnp either way, so these levers are at parity by construction: their speed is a
GPU/TPU matter, not measured yet (grouped-matmul TFLOP/s of the Pallas kernels, fused against
unfused backward, fraction of bf16 peak).

{table(["arm", "overrides", "ms", "time ratio to off", "bytes accessed (MB)", "temporaries (MiB)"], rows)}

{source(rec, name, "python -m benchmarks.gmm")}
"""


def row_tiles() -> str:
    name = "step_small_row_tiles.json"
    rec = load(name)
    rows = [[f"`{arm}`", ", ".join(f"`{o}`" for o in a["overrides"]) or "-", f(a["seconds_per_step"]),
             f"{a['tokens_per_s_per_device']:.0f}", mib(a["program"]["temp"])] for arm, a in rec["arms"].items()]
    return f"""## Row-tiled grouped matmul on CPU (`kernels.gmm.xla_impl`)

The `small` training step on one CPU device, the arms timed interleaved in one `hybridmoe bench`
run (overrides common to all: {", ".join(f"`{o}`" for o in rec["overrides"])}). On CPU
`jax.lax.ragged_dot` computes every expert for every row; row tiles run each expert only on its
own rows (`kernels.gmm.xla_impl=auto` picks them on CPU).

{table(["arm", "overrides", "s/step", "tokens/s/device", "compiled temporaries (MiB)"], rows)}

{source(rec, name, "hybridmoe bench recipe=small ... --arm ragged_dot --arm row_tiles:kernels.gmm.xla_impl=row_tiles")}
"""


def gmm_vmem() -> str:
    name = "gmm_vmem.json"
    rec = load(name)
    cfg = rec["config"]
    rows = [[r["kernel"], " x ".join(map(str, r["tiles"])), f(r["model_mib"], 3), "fits" if r["model_fits"] else "over",
             "fits" if r["compiler_fits"] else "overflows"] for r in rec["rows"]]
    seed = [[s["depth"], f(s["model_mib"], 2), f(s["compiler_min_limit_mib"], 2)] for s in rec["seed_tile"]]
    triton = [[t["blocks"], t["block_q"], t["block_k"], t["num_stages"],
               ", ".join(f"{k.removeprefix('flash_attention_')} {v:.0f}" for k, v in t["shared_kib"].items())]
              for t in rec["triton"]]
    return f"""## On-chip memory of the Pallas kernels (`kernels.*.vmem_limit_mib`, the per-kernel tiles)

Each Mosaic kernel alone, compiled for one device of a compile-only `{cfg['topology']}` topology, at
tiles on both sides of a {cfg['limit_mib']} MiB scoped limit (grouped matmuls: tm x tk x tn; flash
attention: block_q x block_k x head dim; GDN: chunk x key dim x value dim): the memory model's need
and verdict against the compiler's. They disagree at {rec['disagree']} of {len(rec['rows'])} tiles.

{table(["kernel", "tiles", "model (MiB)", "model", "compiler"], rows)}

The seed's wi forward tile {" x ".join(map(str, rec['seed']['wi_fwd_tile']))} (one N tile per half): the
model against the smallest limit the compiler accepts (the seed's kernel: {rec['seed']['depth2_mib']} MiB
at depth 2, of {rec['seed']['limit_mib']}).

{table(["weight depth", "model (MiB)", "compiler's smallest limit (MiB)"], seed)}

Triton flash kernels at head dim 256 (bf16): shared memory per program by the model (KiB), against a
GPU block's {rec['triton'][0]['limit_kib']:.0f} KiB; not measured (no GPU).

{table(["blocks", "block_q", "block_k", "stages", "shared memory (KiB)"], triton)}

{source(rec, name, "python -m benchmarks.gmm_vmem")}
"""


def tuned() -> str:
    g_name, b_name = "gates_tuned_small.json", "bench_tuned_small.json"
    gates, bench = load(g_name), load(b_name)
    g_rows = [[g["gate"], g["what"], f"{g['value']:.3g}", f"{g['reference_pair']:.3g}", f"{g['tolerance']:.3g}",
               "PASS" if g["passed"] else "FAIL"] for g in gates["gates"]]
    b_rows = []
    base = None
    for arm, a in bench["arms"].items():
        base = base or a["seconds_per_step"]
        b_rows.append([f"`{arm}`", ", ".join(f"`{o}`" for o in a["overrides"]) or "-", f(a["seconds_per_step"]),
                       f(a["seconds_per_step"] / base), f"{a['tokens_per_s_per_device']:.1f}", f"{a['mfu']:.1%}"])
    peak = next(iter(bench["arms"].values()))["peak_flops_per_device"]
    return f"""## The `tuned` recipe against `small`

Numerics gates: the reference run twice and the candidate (`recipe=tuned`) once, GRPO steps with
random advantages and fixed seeds; each gate's value, the reference pair's own spread and the
tolerance.

{table(["gate", "what", "value", "reference pair", "tolerance", "result"], g_rows)}

{source(gates, g_name, "hybridmoe gates recipe=small train.batch_size=8 rl.prompts_per_step=4 rl.group_size=4 --candidate recipe=tuned")}

The training step of both on one CPU device, timed interleaved in one run; MFU against a float32
matmul peak measured in the same run ({peak / 1e9:.1f} GFLOP/s).

{table(["arm", "overrides", "s/step", "ratio", "tokens/s", "MFU"], b_rows)}

{source(bench, b_name, "hybridmoe bench recipe=small mesh.cpu_devices=1 mesh.data=1 bench.steps=4 --arm default --arm tuned:recipe=tuned")}
"""


def fp8() -> str:
    h_name, g_name = "fp8_hoist.json", "fp8_gmm_train.json"
    hoist, gmm = load(h_name), load(g_name)
    p_rows = []
    for mode, p in hoist["program"].items():
        two = hoist["program_two_blocks"].get(mode, {})
        gathers = p.get("expert_weight_gathers_per_layer_iteration", [])
        gbytes = ", ".join(f"{g['ops']} ops {g['bytes']:,} B {'/'.join(g['dtypes'])}" for g in gathers[:1]) or "-"
        loops = two.get("absmax_all_reduce_ops_by_loop", {})
        p_rows.append([f"`{mode}`", ", ".join(f"{n} at {w}" for w, n in loops.items()) or "-",
                       two.get("absmax_all_reduces_executed_per_step", "-"), gbytes, mib(p["memory"]["temp"])])
    base = hoist["step_time"]["off"]["seconds_per_step"]
    t_rows = [[f"`{arm}`", f(a["seconds_per_step"], 2), f(a["seconds_per_step"] / base)]
              for arm, a in hoist["step_time"].items()]
    g_rows = [[f"`{arm}`", ", ".join(f"`{o}`" for o in a["overrides"]),
               f(sum(a["losses"][-10:]) / len(a["losses"][-10:]), 4)] for arm, a in gmm["arms"].items()]
    return f"""## fp8 experts

**Fake quantization and its hoist** (`quant.fp8_moe_fake_quant`, `quant.fp8_fake_quant_hoist`): the
`small` recipe with bf16 weights and compute ({", ".join(f"`{o}`" for o in hoist["common"])}). The
absmax all-reduces are counted on the two-block model of the tests
({", ".join(f"`{o}`" for o in hoist["two_blocks"])}), where the layer scan has two iterations (the
`small` recipe's one block makes XLA drop its one-trip loop); the expert-weight all-gathers of one
layer-loop iteration and the compiled temporaries are the `small` step's.

{table(["mode", "absmax all-reduces (two blocks), by loop", "executed per step", "expert-weight gathers per layer iteration", "temporaries (MiB)"], p_rows)}

Step time of each mode, interleaved in one run (on CPU the collectives are memory copies: the hoist
is no speed lever there; its effect is in the collectives and bytes above):

{table(["mode", "s/step", "ratio to off"], t_rows)}

{source(hoist, h_name, "python benchmarks/fp8_hoist.py")}

**fp8 grouped matmuls** (`quant.fp8_gmm`): the `{gmm['recipe']}` recipe trained {gmm['steps']} steps
in bf16 and with fp8 grouped matmuls; mean loss of the last 10 steps, gap
{gmm['final_gap']:+.4f} against the stated margin {gmm['margin']} ({'within' if gmm['within_margin'] else 'OUTSIDE'};
curves in `docs/fp8_gmm_loss.png`).

{table(["arm", "overrides", "final loss (mean of last 10)"], g_rows)}

{source(gmm, g_name, "python benchmarks/fp8_gmm_train.py")}
"""


def cp_attention() -> str:
    name = "cp_attention.json"
    rec = load(name)
    b_rows = [[what, " / ".join(map(str, b["natural"])), " / ".join(map(str, b["load_balanced"])),
               f"{b['spread_natural']:.2f} -> {b['spread_load_balanced']:.2f}"] for what, b in rec["balance"].items()]
    a_rows = []
    for arm, a in rec["arms"].items():
        c = a["program"]["compiled_collectives"]
        low = a["program"]["lowered_collectives_per_loop_iteration"]
        bwd = max(low.values(), key=lambda d: sum(d.values())) if low else {}
        ints = a["program"]["lowered_int32_permutes_per_loop_iteration"]
        bwd_key = max(low, key=lambda k: sum(low[k].values())) if low else None
        a_rows.append([f"`{arm}`", mib(a["program"]["temp"]),
                       f"{c.get('collective-permute f32', 0)} / {c.get('collective-permute s32', 0)}",
                       f"{sum(bwd.values())} ({ints.get(bwd_key, {}).get('collective-permute', 0)})"])
    return f"""## Context-parallel attention (`attention.cp_load_balance`, `..._hoist_ids`)

Per context rank, the (query, key) score entries the causal and segment mask leaves, `small`
recipe, natural order -> load-balanced order, and their spread (max - min) / mean:

{table(["batch, context", "natural", "load-balanced", "spread"], b_rows)}

The compiled step of each arm, `small` recipe on 8 simulated CPU devices
({", ".join(f"`{o}`" for o in rec["common_overrides"])}): compiled temporaries, the compiled
collective-permutes of the whole step (f32 / s32), and from the lowered program, which keeps the
layer loops, the collectives per iteration of the backward layer loop (its int32 permutes). The
step times are not shown: the arms do the same arithmetic, and the simulated devices share one
host's cores, so they say nothing about the keys; load balancing pays where context ranks are real
devices whose attention time is the critical path.

{table(["arm", "temporaries (MiB)", "collective-permutes f32 / s32", "backward layer loop: collectives / iteration (int32 permutes)"], a_rows)}

{source(rec, name, "python -m benchmarks.cp_attention")}
"""


def attention_cpu_backend() -> str:
    name = "attention_cpu_backend.json"
    rec = load(name)
    sh = rec["shape"]
    rows = [[f"`{arm}`", f"{1e3 * t:.1f}", f"{rec['ratio_to_blocked'][arm]:.3f}",
             f"{rec['max_rel_error_vs_masked'][arm]:.1e}"] for arm, t in rec["median_seconds"].items()]
    return f"""## Attention cores on CPU

`benchmarks/attention_cpu_backend.py`: forward + backward of one attention core at the `small`
recipe's shape ({sh['batch']} rows x {sh['tokens']} tokens of packed documents, {sh['query_heads']} query heads over
{sh['kv_heads']} kv heads of dim {sh['head_dim']}, {sh['dtype']}): `masked` the full masked core, `blocked` the masked core
over query blocks, `xla-bN` flash attention in XLA ops with blocks of N queries x N keys (what
`kernels.attention.backend=auto` runs on CPU). One device; every arm compiled first, then
{rec['rounds']} rounds of {rec['reps']} calls per arm, the arms taking turns; median ms per call, its ratio to
`blocked`, and the largest relative difference from `masked`:

{table(["arm", "median ms", "over blocked", "max rel diff from masked"], rows)}

{source(rec, name, "python -m benchmarks.attention_cpu_backend")}
"""


def gdn_core() -> str:
    name = "gdn_core.json"
    rec = load(name)
    rows = [[f"`{r['arm']}`", r["what"], r["code"], r["backend"], r["chunk_size"], f(r.get("time_ratio_to_baseline")),
             f(r.get("cpu_time_ratio_to_baseline")), f(r.get("gflops"), 2),
             mib(r["core_residual_bytes"]) if r.get("core_residual_bytes") else "-"] for r in rec["rows"]]
    method = textwrap.fill(f"The `small` shape; {rec['method']}.", 100)
    return f"""## Gated DeltaNet core and layer (CPU)

{method} The baselines are `{rec['baselines']['layer']}` and
`{rec['baselines']['core']}` (commit {rec['before_commit']}). The Pallas cores ran interpreted on CPU,
which is no speed measurement: their time on GPU/TPU is not measured yet.

{table(["arm", "what", "code", "backend", "chunk", "wall ratio", "CPU-time ratio", "GFLOP", "core saved residuals (MiB)"], rows)}

{source(rec, name, "python -m benchmarks.gdn_core --steps 20")}
"""


def gdn_cp() -> str:
    name = "gdn_cp.json"
    rec = load(name)
    geo = rec["config"]["scan_geometry"]
    s_rows = [[f"`{s['arm']}`", f(s["mean_ms"], 1), mib(s["temp_bytes"]), f"{s['rel_max_error_vs_tree']:.1e}"]
              for s in rec["scans"]]
    l_rows = [[r["ranks"], r["prefix"], f(r["time_ratio_to_1_device"], 2), mib(r["temp_bytes"]),
               mib(r["collective_bytes"])] for r in rec["layer"]]
    return f"""## Sequence-sharded GDN (`mesh.context`, `gdn.cp_m_scan`, `gdn.cp_dh_scan`)

The scan keys on one rank ({geo['tokens']} tokens, {geo['value_heads']} heads, dims {geo['dk']}, chunk
{geo['chunk']}): time, compiled temporaries and the relative max error against the float32
HIGHEST tree.

{table(["arm", "ms", "temporaries (MiB)", "error vs tree"], s_rows)}

The sequence-sharded layer (`{rec['config']['layer']}`) per context rank count and prefix; {rec['method']}

{table(["context ranks", "prefix", "time ratio to 1 device", "temporaries (MiB)", "collective bytes (MiB)"], l_rows)}

{source(rec, name, "python -m benchmarks.gdn_cp")}
"""


def gdn_pallas_tpu() -> str:
    name = "gdn_pallas_tpu.json"
    rec = load(name)
    c = rec["config"]
    rows = [[f"`{r['backend']}`", mib(r["temp_bytes"]), mib(r["argument_bytes"]), r["pallas_kernels"]] for r in rec["rows"]]
    return f"""## Pallas GDN core on TPU: compiled memory

The core's forward + backward compiled for one device of a compile-only `{c['topology']}` topology at
Qwen3.5-35B-A3B per-device shapes (batch {c['batch']}, {c['tokens']} tokens, {c['key_heads']} key /
{c['value_heads']} value heads, dims {c['key_dim']}, chunk {c['chunk_size']}; {c['inputs']}): compiled-memory
facts; the time on a TPU is not measured yet.

{table(["backend", "temporaries (MiB)", "arguments (MiB)", "Pallas kernels"], rows)}

{source(rec, name, "python -m benchmarks.gdn_pallas_tpu")}
"""


def hf_exports() -> str:
    name = "hf_exports.json"
    rec = load(name)
    v, tol, tol64 = rec["versions"], rec["tolerance_relative"], rec["float64_tolerance_relative"]

    def d(r: dict) -> str:
        return f"{r['max_abs']:.1e} ({r['max_rel']:.1e})"

    rows = [[layout, f"`{r['loaded_as']}`", f"{r['mean_logprob_float64']:.2f}", d(r["float32_gap"]),
             d(r["ours_float32_vs_float64"]), d(r["transformers_float32_vs_float64"]),
             d(r["float64_ours_vs_transformers"]), "yes" if r["passed"] else "no"]
            for layout, r in rec["layouts"].items()]
    tied = rec["layouts"]["tied"]
    worst32 = max(r["float32_gap"]["max_rel"] for r in rec["layouts"].values())
    worst64 = max(r["float64_ours_vs_transformers"]["max_abs"] for r in rec["layouts"].values())
    return f"""## Hugging Face exports of each layout

`scripts/check_hf_exports.sh` trains and exports a text-only checkpoint, one in the published
multimodal layout and one with tied embeddings, reloads each in transformers {v['transformers']} (torch
{v['torch']}) as its source's class and scores the fixture's token ids {rec['tokens_shape']} there and with
`hybridmoe score`, each side in float32 and in float64. Each cell: the largest log-prob difference,
and in brackets the largest relative to max(1, |log p|):

{table(["layout", "loaded as", "mean log-prob", "ours f32 vs transformers f32", "ours f32 vs f64",
        "transformers f32 vs f64", "ours f64 vs transformers f64", "passed"], rows)}

In float64 the two sides agree to {worst64:.0e} ({tol64:g} of max(1, |log p|) allowed): they compute the
same function, and what separates them in float32 is each side's own rounding (the two middle
columns; their sum bounds the gap). That rounding grows with the size of the log-prob: the tied
layout's head is the embedding table, its log-probs lie near {tied['mean_logprob_float64']:.0f} (the others' near
-7.5), and its absolute differences are several times the others' while the relative ones stay
alike, in float32 and in float64. Hence the float32 criterion is relative, |ours - transformers| <= {tol:g} of
max(1, |log p|) per token; the worst here, {worst32:.1e}, is {tol / worst32:.0f}x inside it. A wrong
tensor, layout or config field moves log-probs by O(1) and fails both criteria.

transformers loaded with `dtype=torch.float64` alone still casts to float32 in its norms, softmaxes,
Gated DeltaNet core and rotary angles
({tied['transformers_as_loaded_float64_vs_float64']['max_abs']:.1e} from float64 on the tied export); its float64 pass reads those casts as float64 and fails if any operation still
yields float32. Our float64 pass (`scripts/score_float64.py`) does the same on our side.

{source(rec, name, "scripts/check_hf_exports.sh")}
"""


def post_train_eval() -> str:
    name = "post_train_eval.json"
    rec = load(name)
    rows = [[task, t["prompts"], t["samples"], f(t["mean_reward"]), f(t["pass@1"]),
             f(t[f"pass@{rec['samples_per_prompt']}"])] for task, t in rec["tasks"].items()]
    g = rec["generation"]
    return f"""## The README's post-training walk-through: evaluation

`hybridmoe eval` of the README's GRPO export on `{rec['prompts']}` ({rec['samples_per_prompt']} samples
per prompt; the tiny model shows the pipeline, not a result). Generation: {g['batches']} batches of
{g['rows_per_batch']} rows, {g['tokens_per_s']:.0f} new tokens/s ({g['tokens_per_s_note']}).

{table(["task", "prompts", "samples", "mean reward", "pass@1", f"pass@{rec['samples_per_prompt']}"], rows)}

{source(rec, name, "hybridmoe eval --hf runs/grpo_hf ... --out benchmarks/records/post_train_eval.json")}
"""


def robustness() -> str:
    name = "robustness.json"
    rec = load(name)
    k_rows = []
    for cmd, k in rec["kill"].items():
        moments = {}
        for e in k["events"]:
            kind = "random" if e["moment"] == "random" else e["moment"].rsplit(" ", 1)[0]
            moments[kind] = moments.get(kind, 0) + 1
        k_rows.append([f"`{cmd}`", k["trials"], k["killed"], k["passed"],
                       ", ".join(f"{n} {m}" for m, n in moments.items())])
    fz = rec["fuzz"]
    return f"""## Kill -9 and config fuzz

Kill trials: each run is killed once (at random times, and exactly as a checkpoint or the export is
being written), resumed with `--resume`, and its metrics, TensorBoard and export compared with the
uninterrupted run's, bit for bit.

{table(["command", "trials", "killed", "passed", "kill moments"], k_rows)}

Config fuzz: {fz['draws']} random override sets gave {fz['valid']} valid configs whose step traced and
{fz['config_error']} ConfigErrors naming an overridden key; {len(fz['failures'])} other exceptions.

{source(rec, name, "python benchmarks/robustness.py --kill-trials 20 / --fuzz-draws 3000")}
"""


def _spread(sp: dict, scale: float = 1.0, digits: int = 3) -> str:
    return f"{sp['median'] * scale:.{digits}f} ({sp['p25'] * scale:.{digits}f}-{sp['p75'] * scale:.{digits}f})"


def _loads(per_round: list) -> str:
    ones = [x[0] for x in per_round]
    return f"{min(ones):.1f}-{max(ones):.1f}"


def cpu_step_vs_reference() -> str:
    name = "train_step_small.json"
    rec = load(name)
    meth, ref, ours = rec["method"], rec["sides"]["reference"], rec["sides"]["ours"]
    rv = ref["info"]["versions"]
    arms = rec.get("arms", {})
    label = lambda side: (f"{side} (commit {arms[side]['commit'][:7]})"  # noqa: E731
                          if isinstance(arms.get(side), dict) else side)
    rows = [[label(side), _spread(s["cpu_seconds_per_step"]), _spread(s["seconds_per_step"]),
             f"{rec['tokens_per_step'] / s['cpu_seconds_per_step']['median']:.0f}",
             _spread(rec["ratios"][side]["cpu_time_ratio"], digits=2) if side in rec["ratios"] else "1",
             _spread(rec["ratios"][side]["time_ratio"], digits=2) if side in rec["ratios"] else "1"]
            for side, s in rec["sides"].items()]
    ratio = rec["ratios"]["ours"]
    cpu_r = ratio["cpu_time_ratio"]["median"]
    verdict = ("as fast per token as the reference or faster" if cpu_r <= 1.0 else
               f"not yet as fast per token as the reference ({cpu_r:.2f}x its CPU time per step)")
    second = "met" if cpu_r <= 0.5 else "not met"
    pairs = ""
    for side in rec["sides"]:
        if side not in ("ours", "reference"):
            per = [a["cpu_s"] / b["cpu_s"] for a, b in zip(ours["steps"], rec["sides"][side]["steps"])]
            per.sort()
            pairs += (f" Ours over `{side}` (the same step at commit {arms[side]['commit'][:7]}), per round: CPU "
                      f"time {per[len(per) // 2]:.3f} (range {per[0]:.3f}-{per[-1]:.3f}).")
    return f"""## The CPU training step against the PyTorch reference

The default `small` step on one CPU device ({rec['tokens_per_step']} tokens a step, float32: forward,
next-token loss, backward, global-norm clip, AdamW) and the Hugging Face reference
(`{ref['info']['model_class']}`, transformers {rv['transformers']}, PyTorch {rv['torch']}, Python
{rv['python']}, attention `{ref['info']['attn_implementation']}`, experts
`{ref['info']['experts_implementation']}`, its pure-PyTorch GDN fallbacks) trained on the same
tokens with the same AdamW settings and clip, each in its own worker process. The method
(`benchmarks/pinned.py`): both pinned to cores {meth['cores']}, {meth['threads_per_side']}
compute thread(s) each (XLA's intra-op pool follows the affinity mask; the reference calls
`torch.set_num_threads`), {meth['warmup_steps']} warm-up steps each, then {meth['rounds']} rounds of
{meth['steps_per_round']} step(s) per side, the order alternating every round. The machine was shared
(1-minute load average {_loads(rec['load_average']['per_round'])} during the run on its
{rec['machine']['cores']} cores), so a process's wall time includes waiting for its core; the CPU
time (the process's own seconds, all threads) is the measure of the work each side does.
Median (quartiles) over the rounds:

{table(["side", "CPU s/step", "wall s/step", "tokens per CPU second", "over the reference (CPU time)",
        "over the reference (wall)"], rows)}

Ours over the reference, per round: CPU time **{_spread(ratio['cpu_time_ratio'], digits=2)}**,
wall time {_spread(ratio['time_ratio'], digits=2)} (min {ratio['cpu_time_ratio']['min']:.2f}, max
{ratio['cpu_time_ratio']['max']:.2f} CPU). Against the goal of the reference's time per step the default step is
{verdict}; the second goal (half the reference's time) is {second}.{pairs}

{source(rec, name, f"python benchmarks/train_step.py --hf-python {REFERENCE_PYTHON} --cores 0 --rounds 15 "
        "--arm before@49daae6")}
"""


def rollout_vs_reference() -> str:
    name = "rollout_small.json"
    rec = load(name)
    meth, shape, sides = rec["method"], rec["shape"], rec["sides"]
    ratios = rec["ratios_over_reference"]
    rv = sides["reference"]["info"]
    B, N, P = shape["rows"], shape["new_tokens"], shape["prompt_len"]

    def row(side):
        w, c = sides[side]["wall"], sides[side]["cpu"]
        r = ratios.get(side)
        return [side, _spread(w["rollout_tokens_per_s"], digits=0), _spread(c["rollout_tokens_per_s"], digits=0),
                _spread(w["prefill_s"], digits=2), _spread(c["prefill_s"], digits=2),
                _spread(w["decode_tokens_per_s"], digits=0),
                _spread(r["wall"]["rollout_tokens_per_s"], digits=2) if r else "1",
                _spread(r["cpu"]["rollout_tokens_per_s"], digits=2) if r else "1"]

    ours = ratios["ours"]["cpu"]["rollout_tokens_per_s"]["median"]
    verdict = ("met" if ours >= 2 else f"not met (ours {ours:.2f}x the reference's rollout tokens per CPU second)")
    shared = ""
    if "ours-unshared" in sides:
        per = sorted(b["full"]["cpu_s"] / a["full"]["cpu_s"] for a, b in zip(sides["ours"]["calls"],
                                                                            sides["ours-unshared"]["calls"]))
        pre = sorted(b["first_token"]["cpu_s"] / a["first_token"]["cpu_s"]
                     for a, b in zip(sides["ours"]["calls"], sides["ours-unshared"]["calls"]))
        shared = (f" Prefilling each prompt once (`ours`) against every row prefilling its own copy (`ours-unshared`, "
                  f"the sampler before), per round: the rollout {per[len(per) // 2]:.2f}x faster in CPU time (range "
                  f"{per[0]:.2f}-{per[-1]:.2f}), the 1-token call {pre[len(pre) // 2]:.2f}x (range {pre[0]:.2f}-{pre[-1]:.2f}).")
    return f"""## Rollouts against Hugging Face `generate`

`benchmarks/rollout.py`: the GRPO sampler (`hybridmoe/rl/sampler.py`, the `small` model on one CPU
device) and transformers' `Qwen3_5MoeForCausalLM.generate(num_return_sequences=G)` (transformers
{rv['transformers']}, PyTorch {rv['torch']}, Python {rv['python']}, its pure-PyTorch GDN fallbacks)
sample G = {shape['group_size']} completions of each of {shape['prompts']} prompts of {P} tokens ({B} rows),
exactly {N} new tokens each ({shape['sampling']}, {shape['dtype']}), with their caches. The pinned
method of the step comparison above: both pinned to cores {meth['cores']}, {meth['threads_per_side']}
compute thread(s) each, {meth['warmup_rounds']} warm-up round(s), then {meth['rounds']} rounds with the
sides' order rotating. Per round each side makes a 1-token call (the prefill, and the first token)
and the {N}-token call; decode tokens/s is {B} x {N - 1} tokens over the difference. The machine was shared
(1-minute load average {_loads(rec['load_average']['per_round'])} on its {rec['machine']['cores']} cores),
so wall time includes waiting for the core; CPU time is each side's own work. `generate` repeats
each prompt G times and prefills all {B} rows; `ours` prefills the {shape['prompts']} prompts once and
copies their state. Median (quartiles) over the rounds:

{table(["side", "rollout tok/s (wall)", "rollout tok per CPU s", "1-token call s (wall)", "1-token call CPU s",
        "decode tok/s (wall)", "over the reference (wall)", "over the reference (CPU)"],
       [row(side) for side in sides])}

Against the goal of rollout tokens/s at least 2x the reference's this is {verdict}.{shared}

{source(rec, name, f"python benchmarks/rollout.py --hf-python {REFERENCE_PYTHON} --arms ours,ours-unshared "
        f"--rounds {meth['rounds']} --prompt-len {P} --new-tokens {N}")}
"""


def step_anatomy() -> str:
    name = "step_anatomy.json"
    rec = load(name)
    ours, ref = rec["ours"], rec.get("reference", {})
    info = rec.get("reference_info", {})

    def cell(x, key):
        return f"{1e3 * x[key]:.1f}" if x else "-"

    rows = []
    for n, a in ours.items():
        b = ref.get(n)
        rows.append([f"{n} ({a['instances']})", cell(a, "all_instances_cpu_s"), cell(b, "all_instances_cpu_s"),
                     f(a["all_instances_cpu_s"] / b["all_instances_cpu_s"], 2) if b else "-",
                     f(a["all_instances_s"] / b["all_instances_s"], 2) if b else "-",
                     f(a["useful_gflops"] * a["median_s"] / a["median_cpu_s"], 1) if a.get("useful_gflops") else "-"])
    meth = rec["method"]
    return f"""## Where the CPU step's time goes, against the reference

`benchmarks/step_anatomy.py`: each component's forward + backward (and the whole step) of our
`small` step on one device and of the reference's modules (PyTorch {info.get('torch')},
transformers {info.get('transformers')}), both pinned to cores {meth['cores']} with
{meth['threads_per_side']} thread(s) each, the sides alternating round by round ({rec['rounds']} rounds,
medians of rounds 1..; load average {_loads(rec['load_average_per_round'])}). Milliseconds of process CPU
time for all of a component's instances in one step; the ratios are ours over the reference's
(CPU time, and wall time); the last column is our useful GFLOP per CPU second
(`hybridmoe/analysis/flops.py`: matmul work only). The bracketed rows are our controls: a CPU choice
undone.

{table(["component (instances per step)", "ours CPU ms", "reference CPU ms", "CPU-time ratio", "wall ratio",
        "ours GFLOP per CPU s"], rows)}

{source(rec, name, f"python benchmarks/step_anatomy.py --hf-python {REFERENCE_PYTHON} --cores 1 --rounds 5")}
"""


def moe_tiles() -> str:
    name = "moe_tiles.json"
    rec = load(name)
    rows = [[arm, _spread(a["cpu_s"], 1e3, 1), _spread(a["wall_s"], 1e3, 1)] for arm, a in rec["arms"].items()]
    return f"""## The MoE block on CPU: rows kept in the tile layout

The routed experts' forward + backward at the `small` shape ({rec['shape']['tokens']} tokens, top-{rec['shape']['top_k']}
of {rec['shape']['experts']} experts, {rec['shape']['tile_rows']}-row tiles): `sorted` sorts the rows and runs two
row-tiled grouped matmuls (the path before), `tiles` (`model/moe.tiled_experts`, the CPU default)
keeps the rows in the tile layout between them and has its own backward of gathers and matmuls.
One process pinned to cores {rec['cores']}, the arms alternating, {rec['rounds']} rounds (load average
{_loads(rec['load_average_per_round'])}); ms, median (quartiles):

{table(["arm", "CPU ms", "wall ms"], rows)}

`tiles` over `sorted` per round: CPU time {_spread(rec['ratio_cpu'])}, wall {_spread(rec['ratio_wall'])}; the
gradients differ by at most {rec['max_rel_l2_grad_difference']:.1e} relative L2 (float rounding; the
tests bound it).

{source(rec, name, "python benchmarks/moe_tiles.py --cores 1 --rounds 20")}
"""


def decode_moe() -> str:
    name = "decode_moe.json"
    rec = load(name)
    sh, meth = rec["shape"], rec["method"]
    paths = list(next(iter(rec["tokens"].values()))["per_call"])
    rows = [[T, *(f"{1e3 * t['per_call'][p]['cpu_s']['median']:.2f}" for p in paths),
             "every_expert" if t["every_expert_is_cheaper"] else "tiled128", t["fastest_by_cpu_time"]]
            for T, t in rec["tokens"].items()]
    return f"""## A decode step's MoE block on CPU

`benchmarks/decode_moe.py`: one MoE layer of `small` (top-{sh['top_k']} of {sh['experts']} experts, D =
{sh['d_model']}, F = {sh['moe_intermediate_size']}, {sh['dtype']}) on T tokens by each path: `ragged_dot`
(jax.lax.ragged_dot), `tiled128` (`model/moe.tiled_experts`, the CPU training program's row tiles),
`row_tiles8` (the grouped matmul with 8-row tiles) and `every_expert` (`model/moe.every_expert_rows`:
every expert on every token, then the routed rows taken). A decode step has one token per row, so T is
the rollout's rows. One process pinned to cores {meth['cores']}, the paths interleaved, {meth['rounds']}
rounds of {meth['calls_per_round']} calls (load average {rec['load_average'][0]:.1f} at the end); median process
CPU ms per call, the path the sampler's decode step takes (`every_expert_is_cheaper`) and the fastest:

{table(["T", *paths, "decode step takes", "fastest"], rows)}

{source(rec, name, "python benchmarks/decode_moe.py --cores 1 --steps 5")}
"""


def bf16_gaps() -> str:
    name = "bf16_gaps.json"
    if not (RECORDS / name).exists():
        return ""
    rec = load(name)
    cp = [[a["dtype"], a["cross_rank_chain"], f"{a['gap_mean']:.2e}", f"{a['gap_max']:.2e}",
           f"{a['gap_max_row0_one_document']:.2e}", f"{a['gap_max_row1_packed']:.2e}", f"{a['kl_k3_mean']:.2e}",
           f"{a['routing_flips']} / {a['routings']}"] for a in rec["context_parallel"]]
    layer = [[a["dtype"], a["cross_rank_chain"], f"{a['rel_l2']:.2e}", f"{a['rel_max']:.2e}"] for a in rec["gdn_layer"]]
    sampler = "(not measured in this record)"
    if rec.get("sampler"):
        sampler = table(["compute", "sampler_gap_mean", "sampler_gap_max", "reward_mean per GRPO step"],
                        [[a["dtype"], f"{a['sampler_gap_mean']:.2e}", f"{a['sampler_gap_max']:.2e}",
                          " ".join(f"{st['reward_mean']:.3f}" for st in a["steps"])] for a in rec["sampler"]])
    return f"""## bfloat16: context parallelism and the sampler against the one-device trainer

`benchmarks/bf16_gaps.py`. Part 1: the `tiny` model's per-token log-probs of 2 packed rows of
{rec['tokens']} tokens with the sequence split over mesh.context={rec['ranks']}, against one device (row 0 one
document across every shard edge; row 1 documents that start on and cross shard edges): mean and
max |difference|, the k3 KL estimate and the (token, layer) routings that picked other experts. The
third arm rounds the cross-rank GDN state chain to bfloat16, the bug a test catches as a broken
variant (the chain stays float32 in the code).

{table(["compute", "cross-rank chain", "mean", "max", "max row 0", "max row 1", "KL k3", "routing flips"], cp)}

Part 2: one GDN layer alone on 4 ranks against one device (output relative L2 and max |difference|
over max |output|):

{table(["compute", "cross-rank chain", "rel L2", "rel max"], layer)}

Part 3: the demo recipe's GRPO steps, the trainer's own |log pi_train - log pi_sampler| over the
completion tokens (T = 1):

{sampler}

{source(rec, name, rec.get("command", "python benchmarks/bf16_gaps.py"))}
"""


def compile_cache() -> str:
    name = "compile_cache.json"
    rec = load(name)
    rows = [[f"`{r['command']}`", f"{r['first_s']:.1f}", f"{r['second_s']:.1f}", f"{r['second_over_first']:.2f}",
             r["programs_stored"], r["facts_kept"], r["load_average_1min"]] for r in rec["runs"]]
    return f"""## The persistent compile cache

`run.compile_cache_dir`: each command run twice in fresh processes into one empty cache folder;
wall time of the whole command. JAX keeps the executables ("programs stored"); `inspect` reads the
compiler's dumps, which an executable read back does not bring (and a compile-only TPU client cannot
load one), so it keeps what the compile said instead ("facts kept": the optimised HLO, memory
figures, cost, the buffers at the peak, or a refusal for memory; hybridmoe/analysis/compiled_facts.py).
A second `inspect` of the same program compiles nothing: what it still spends is start-up, tracing
and lowering (the key is the lowered program).

{table(["command", "first s", "second s", "second / first", "programs stored", "facts kept", "load (1 min)"], rows)}

{source(rec, name, "python benchmarks/compile_cache.py")}
"""


def suite_time() -> str:
    name = "suite_time.json"
    if not (RECORDS / name).exists():
        return ""
    rec = load(name)
    rows = [[r["cache"], f"{r['wall_min']:.1f}", r.get("passed", "-"), r.get("failed", 0), r.get("skipped", "-"),
             r["load_average_1min"]] for r in rec["runs"]]
    goals = {"cold": 20, "warm": 8}
    verdicts = "; ".join(f"{r['cache']} {r['wall_min']:.1f} min against at most {goals[r['cache']]} "
                         f"({'met' if r['wall_min'] <= goals[r['cache']] else 'NOT met'})"
                         for r in rec["runs"] if r["cache"] in goals)
    return f"""## The test suite's time

`make test` (what CI runs: 2 xdist workers) on {rec['cores']} cores; cold: the suite's compile cache
(`{rec['cache_dir']}`, with the compiles' facts in its `program-facts/`) emptied first, as on a new
machine; warm: run again. The goals: {verdicts}.

{table(["cache", "minutes", "passed", "failed", "skipped", "load (1 min) at the end"], rows)}

{source(rec, name, "python benchmarks/suite_time.py")}
"""


def pending() -> str:
    rows = [[f"`benchmarks/records/{n}`", why] for n, why in PENDING.items()]
    return f"""## To be regenerated

These records are kept but their figures are not shown until they are remeasured:

{table(["record", "why, and the command"], rows)}
"""


SECTIONS = [demo_curves, cpu_step_vs_reference, rollout_vs_reference, step_anatomy, gmm_levers, row_tiles, moe_tiles, decode_moe, gmm_vmem, tuned, fp8, cp_attention, attention_cpu_backend, gdn_core, gdn_cp,
            gdn_pallas_tpu, bf16_gaps, seed_cell, step_estimate, inspect_depth, inspect_memory_only, hf_exports, post_train_eval,
            robustness, compile_cache, suite_time, pending]

HEADER = """# Performance and measurements

Generated by `python benchmarks/make_performance_doc.py` from the records under
`benchmarks/records/`; do not edit by hand (`tests/test_docs.py` checks that this page equals the
script's output). Each section names its record, the command that regenerates it, and the
record's date, commit, machine and versions. Times are ratios of arms measured interleaved in one
run; program facts (collectives, bytes, memory) are read from the compiled program. Which key each
figure belongs to: `docs/levers.md`. `REFERENCE_VENV` in a command is the PyTorch reference's
venv, made by `benchmarks/reference/setup.sh`.
"""


def render() -> str:
    return "\n".join([HEADER, *filter(None, (s() for s in SECTIONS))]).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/performance.md differs from the records")
    args = ap.parse_args()
    text = render()
    if args.check:
        if DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python benchmarks/make_performance_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
