"""Where the `small` training step's time goes: ours and the Hugging Face reference's, per component.

Each component runs forward + backward (gradients of its inputs and weights) on the `small`
shape (4 x 512 tokens, float32) on one CPU device; the whole step (forward, backward, clip,
AdamW) is timed too. The Hugging Face reference (PyTorch, transformers' Qwen3.5-MoE modules)
runs in a worker process (benchmarks/reference/hf_anatomy_worker.py) started with --hf-python, a Python that
has torch and transformers (never dependencies of this package; benchmarks/reference/setup.sh).
The method is benchmarks/pinned.py's: both sides pinned to the same cores (`--cores`), XLA's
intra-op pool and torch's threads one per pinned core; the sides take turns, one round of every
component each (the order of the sides alternating, our components' order rotating), so drift in
the machine's speed (it is shared) lands on both; the figure is the median over rounds 1..
(round 0 warms up), with its spread (quartiles, min, max) in the record. Both wall time and
process CPU time (all threads) are recorded, and the load average at every round.

FLOPs are counted from the model shape with hybridmoe.analysis.flops for both sides (matmul work
only), so useful GFLOP/s compare directly; MFU is against the best float32 matmul rate measured
in the same run (JAX's and torch's, the larger). Prints a table and writes
benchmarks/records/step_anatomy.json.

  python benchmarks/step_anatomy.py [--hf-python REFVENV/bin/python] [--cores 0] [--rounds 8]
  python benchmarks/step_anatomy.py --markdown benchmarks/records/step_anatomy.json   (the README's table)

REFVENV: the reference venv benchmarks/reference/setup.sh makes (by default /work/refvenv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure(cpu_devices=1, cpu_only=True)  # also reads the commit: the record names the code the run started from
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hybridmoe.analysis.flops import component_flops, step_flops  # noqa: E402
from hybridmoe.tools.bench import measure_peak_flops  # noqa: E402
from benchmarks.pinned import parse_cores, pin, spread, thread_census  # noqa: E402
from hybridmoe.recipe import load_config  # noqa: E402
from hybridmoe.data.synthetic import synthetic_batch  # noqa: E402
from hybridmoe.kernels import attention as attn_kernels  # noqa: E402
from hybridmoe.model import attention as attn_model  # noqa: E402
from hybridmoe.model.attention import attention_layer  # noqa: E402
from hybridmoe.model.forward import embed_tokens  # noqa: E402
from hybridmoe.model.gdn import gdn_layer  # noqa: E402
from hybridmoe.model.moe import moe_layer  # noqa: E402
from hybridmoe.model.norms import rms_norm  # noqa: E402
from hybridmoe.run.setup import build, init_state, jit_train_step  # noqa: E402

RECIPE, OVERRIDES = "small", ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=-1"]

# Component -> (instances per step in `small`, its FLOP kind in hybridmoe.analysis.flops or None).
COMPONENTS = {
    "gdn": (3, "gdn"), "attention": (1, "attention"), "moe": (4, "moe"), "rmsnorm": (9, None),
    "embed_head_loss": (1, "embed_head"), "optimizer": (1, None), "step": (1, None),
}
# Ours only: the component with the CPU choice undone, to show what each choice buys.
CONTROLS = {"attention[full core]": "attention", "moe[ragged_dot]": "moe", "step[remat full]": "step"}


def _grad_fn(f, *args):
    """jit(forward + backward of f w.r.t. every argument), with a fixed random cotangent."""
    out = jax.eval_shape(f, *args)
    cot = jax.random.normal(jax.random.key(7), out.shape, out.dtype)

    def fb(*a):
        y, vjp = jax.vjp(f, *a)
        return vjp(cot)

    return jax.jit(fb)


def jax_components(cfg_overrides: list[str]) -> tuple[dict, dict]:
    """{name: zero-argument callable that runs it once and blocks}, and the config facts."""
    cfg = load_config(RECIPE, OVERRIDES + cfg_overrides)
    m, t = cfg.model, cfg.train
    B, T, D = t.batch_size, t.seq_len, m.d_model
    setup = build(cfg)
    state = init_state(setup, jax.random.key(0))
    params = jax.device_get(state["params"])
    x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
    seg = jnp.ones((B, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    blocks = params["blocks"]
    kinds = list(m.layer_pattern)
    first = lambda kind: jax.tree.map(lambda a: a[0], blocks[kinds.index(kind)])  # noqa: E731
    gdn_p, attn_p = first("gdn")["mixer"], first("attention")["mixer"]
    moe_p, norm_w = first("gdn")["moe"], first("gdn")["input_norm"]
    tokens = jnp.asarray(synthetic_batch(t.seed, 0, 1, B, T, m.vocab_size)["tokens"][0])

    def head_loss(embed, head, hidden):
        h = embed_tokens({"embed": embed}, tokens, jnp.float32) + hidden
        lg = jnp.einsum("btd,dv->btv", h, head)[:, :-1]
        lp = jax.nn.log_softmax(lg, axis=-1)
        return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1))

    fns = {
        "gdn": (_grad_fn(lambda p, x: gdn_layer(p, x, seg, m, chunk_size=cfg.gdn.chunk_size,
                                                backend=cfg.kernels.gdn.backend), gdn_p, x), (gdn_p, x)),
        "attention": (_grad_fn(lambda p, x: attention_layer(p, x, pos, seg, m, kernels=cfg.kernels), attn_p, x),
                      (attn_p, x)),
        "moe": (_grad_fn(lambda p, x: moe_layer(p, x, m, cfg.moe, cfg.kernels), moe_p, x), (moe_p, x)),
        "rmsnorm": (_grad_fn(lambda w, x: rms_norm(x, w, m.rms_norm_eps), norm_w, x), (norm_w, x)),
        "embed_head_loss": (jax.jit(jax.grad(head_loss, (0, 1, 2))), (params["embed"], params["lm_head"], x)),
    }
    grads = jax.tree.map(lambda a: a * 1e-3, params)
    opt = jax.jit(lambda g, s, p: setup.optimizer.update(g, s, p))
    fns["optimizer"] = (opt, (grads, state["opt_state"], params))

    # The controls: the full masked attention core; ragged_dot in the MoE; remat full in the step.
    core = attn_model.attention_core

    def attention_full_core(p, x):
        attn_model.attention_core = lambda *_, **__: attn_kernels.attention
        try:
            return attention_layer(p, x, pos, seg, m, kernels=cfg.kernels)
        finally:
            attn_model.attention_core = core

    fns["attention[full core]"] = (_grad_fn(attention_full_core, attn_p, x), (attn_p, x))
    ragged = load_config(RECIPE, OVERRIDES + cfg_overrides + ["kernels.gmm.xla_impl=ragged_dot"])
    fns["moe[ragged_dot]"] = (_grad_fn(lambda p, x: moe_layer(p, x, m, ragged.moe, ragged.kernels), moe_p, x),
                              (moe_p, x))

    runs = {}
    for name, (fn, args) in fns.items():
        runs[name] = (lambda fn=fn, args=args: jax.block_until_ready(fn(*args)))

    for name, extra in (("step", []), ("step[remat full]", ["remat.policy=full"])):
        c = load_config(RECIPE, OVERRIDES + cfg_overrides + extra)
        s = build(c)
        step_fn = jit_train_step(s)
        holder = [init_state(s, jax.random.key(0))]
        with s.context():
            batch = jax.device_put(synthetic_batch(t.seed, 0, 1, B, T, m.vocab_size), s.batch_sharding(1))
            compiled = step_fn.lower(s.abstract_state(), batch).compile()

        def run_step(compiled=compiled, holder=holder, batch=batch, s=s):
            with s.context():  # the state is donated: each step continues from the last
                holder[0], metrics = compiled(holder[0], batch)
                jax.block_until_ready(metrics)

        runs[name] = run_step
    facts = {"batch": B, "seq_len": T, "config": json.loads(cfg.model_dump_json())}
    return runs, facts


class HFWorker:
    """The reference's side: a subprocess that times its components one round per request."""

    def __init__(self, python: str, threads: int):
        self.proc = subprocess.Popen([python, str(ROOT / "benchmarks" / "reference" / "hf_anatomy_worker.py"), "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._ask("info")

    def _ask(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the reference worker stopped (asked {what!r})")
        return json.loads(line)

    def round(self) -> dict:
        return self._ask("round")

    def peak(self) -> float:
        return self._ask("peak")["flops"]

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--hf-python", help="a Python with torch and transformers for the reference side")
    ap.add_argument("--cores", default="0", help="cores both sides are pinned to, e.g. 0 or 0,1 (default 0)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--markdown", metavar="RECORD", help="print the README's table of a record and exit")
    args = ap.parse_args()
    if args.markdown:
        print(format_markdown(json.loads(Path(args.markdown).read_text())))
        return

    cores = parse_cores(args.cores)
    pin(cores)  # before JAX starts its CPU client; the reference worker inherits it
    load_before = os.getloadavg()
    runs, facts = jax_components([])
    hf = HFWorker(args.hf_python, len(cores)) if args.hf_python else None
    ours = {n: [] for n in runs}
    ref = {}
    loads = []
    names = list(runs)

    def our_round(r):
        for n in np.roll(names, -r):
            c0, t0 = time.process_time(), time.perf_counter()
            runs[n]()
            ours[n].append((time.perf_counter() - t0, time.process_time() - c0))

    def ref_round():
        for n, both in hf.round().items():
            ref.setdefault(n, []).append(tuple(both))

    for r in range(args.rounds):
        for side in ((our_round, ref_round) if r % 2 == 0 else (ref_round, our_round)):
            if side is our_round:
                our_round(r)
            elif hf:
                ref_round()
        loads.append(os.getloadavg())
        print(f"round {r}: step ours {ours['step'][-1][0]:.3f} s" + (f", reference {ref['step'][-1][0]:.3f} s" if hf else ""),
              file=sys.stderr)
    peaks = {"jax": measure_peak_flops(jax.sharding.Mesh(jax.devices()[:1], ("d",)), jnp.dtype(jnp.float32))}
    if hf:
        peaks["torch"] = hf.peak()
        hf.close()
    load_after = os.getloadavg()
    peak = max(peaks.values())

    cfg = load_config(RECIPE, OVERRIDES)
    flops = component_flops(cfg.model, facts["batch"], facts["seq_len"])
    total = step_flops(cfg, facts["batch"], facts["seq_len"])

    rec = {"recipe": RECIPE, "overrides": OVERRIDES,
           "rounds": args.rounds, "load_average_before": load_before, "load_average_after": load_after,
           "load_average_per_round": loads,
           "method": {"cores": cores, "threads_per_side": len(cores),
                      "xla_intra_op_threads": thread_census().get("tf_XLAEigen", 0),
                      "order": "sides alternate round by round; our components' order rotates",
                      "figure": "median over rounds 1.. (round 0 warms up)"},
           "matmul_peak_flops": peaks, "peak_used": peak, "step_flops": total, **facts,
           "ours": summary(ours, flops, total, peak)}
    if hf:
        rec["reference"] = summary(ref, flops, total, peak)
        rec["reference_info"] = hf.info
        rec.update(step_ratios(rec["ours"], rec["reference"], ours, ref))
    rec = harness.write(args.out, "step_anatomy", **rec)
    print(format_table(rec))


def summary(times: dict, flops: dict, total: float, peak: float) -> dict:
    """Per component: the median over rounds 1.. (round 0 warms up) of its wall and CPU seconds, times
    its instances per step; its FLOPs (`flops` by kind; the whole step's `total`), GFLOP/s and MFU
    against `peak`."""
    out = {}
    for n, both in times.items():
        base = n.split("[")[0]
        count, kind = COMPONENTS[base]
        kept = both[1:] if len(both) > 1 else both
        sec = float(np.median([w for w, _ in kept]))
        cpu = float(np.median([c for _, c in kept]))
        fl = total if base == "step" else (flops[kind] if kind else 0.0)
        per_step = 1 if base == "step" else count
        out[n] = {"instances": count, "median_s": sec, "all_instances_s": sec * per_step,
                  "median_cpu_s": cpu, "all_instances_cpu_s": cpu * per_step,
                  "spread_s": spread([w for w, _ in kept]), "spread_cpu_s": spread([c for _, c in kept]),
                  "times_s": [w for w, _ in both], "cpu_times_s": [c for _, c in both], "flops": fl,
                  "useful_gflops": fl / sec / 1e9 if fl else None, "mfu": fl / sec / peak if fl else None}
    return out


def step_ratios(ours_summary: dict, ref_summary: dict, ours: dict, ref: dict) -> dict:
    """The whole step's time ratios, ours over the reference's: of the medians (wall, CPU) and per
    round (rounds 1..)."""
    rec = {}
    rec["step_time_ratio"] = ours_summary["step"]["median_s"] / ref_summary["step"]["median_s"]
    rec["step_cpu_time_ratio"] = ours_summary["step"]["median_cpu_s"] / ref_summary["step"]["median_cpu_s"]
    rec["step_time_ratio_per_round"] = spread([a / b for (a, _), (b, _) in zip(ours["step"][1:], ref["step"][1:])])
    return rec


def format_table(rec: dict) -> str:
    ours, ref = rec["ours"], rec.get("reference", {})

    def cell(x, key, scale=1.0, fmt="9.1f"):
        return format(x[key] * scale, fmt) if x and x.get(key) else " " * 9

    def ratio(a, b, key):
        return format(a[key] / b[key], "8.2f") if b and b.get(key) else " " * 8

    lines = [f"{'component':<22} {'ours ms':>9} {'ref ms':>9} {'ratio':>8} {'ours cpu':>9} {'ref cpu':>9} "
             f"{'cpu rat':>8} {'ours GF/s':>9} {'ref GF/s':>9}"]
    for n, a in ours.items():
        b = ref.get(n)
        lines.append(f"{n:<22} {cell(a, 'all_instances_s', 1e3)} {cell(b, 'all_instances_s', 1e3)} "
                     f"{ratio(a, b, 'all_instances_s')} {cell(a, 'all_instances_cpu_s', 1e3)} "
                     f"{cell(b, 'all_instances_cpu_s', 1e3)} {ratio(a, b, 'all_instances_cpu_s')} "
                     f"{cell(a, 'useful_gflops')} {cell(b, 'useful_gflops')}")
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rec["matmul_peak_flops"].items())
    lines.append(f"(ms: all instances of a component in one step, wall and process CPU; matmul peak GFLOP/s: "
                 f"{peaks}; load average {rec['load_average_before'][0]:.1f} -> {rec['load_average_after'][0]:.1f})")
    return "\n".join(lines)


def format_markdown(rec: dict) -> str:
    """The README's table: per component, all its instances in one step, ours vs the reference."""
    ours, ref = rec["ours"], rec.get("reference", {})

    def ms(x, key):
        return f"{1e3 * x[key]:.1f}" if x else "-"

    def ratio(a, b, key):
        return f"{a[key] / b[key]:.2f}" if b else "-"

    def gf(x):
        return f"{x['useful_gflops']:.1f}" if x and x.get("useful_gflops") else "-"

    lines = ["| component (instances per step) | hybridmoe ms | reference ms | ratio | CPU-time ratio | "
             "hybridmoe GFLOP/s | reference GFLOP/s |", "|---|---|---|---|---|---|---|"]
    for n, a in ours.items():
        b = ref.get(n)
        lines.append(f"| {n} ({a['instances']}) | {ms(a, 'all_instances_s')} | {ms(b, 'all_instances_s')} | "
                     f"{ratio(a, b, 'all_instances_s')} | {ratio(a, b, 'all_instances_cpu_s')} | {gf(a)} | {gf(b)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
