"""The GDN layer's forward + backward: now against the path before the speed work, custom VJP against autodiff.

    .venv/bin/python -m benchmarks.gdn_core [recipe=small] [section.key=value ...] [--steps N]

One process, one CPU device. Arms, each for the whole layer and for the core alone at the layer's
shapes: `before` is the layer and core as they were at commit BEFORE_COMMIT (read from this
repository's git history and run side by side: the autodiff path that the GDN speed work's 2x
target is measured against); `now` is this checkout. Backends: xla (the core's own backward) and
xla_autodiff (the same forward differentiated by autodiff), chunk 64, and chunk 32 for the current
code. Every arm is compiled first, then timed interleaved (the arm order rotates each round); the
figures are the mean wall time and the mean process CPU time (all threads) over the rounds, as
ratios to the `before autodiff C64` arm of the same kind (on a shared machine the CPU time is the
steadier measure of the work). For each arm: XLA's flop count, the compiled program's temporaries,
and the residuals the core's forward saves for its backward (bytes, read from the linearised core
by hybridmoe.analysis.program.saved_residuals).
The Pallas cores (kernels.gdn.backend=pallas_tpu, pallas_gpu) are timed only on their platform
(TPU, GPU): elsewhere they run interpreted, which is no speed measurement, so their arms record
the residual bytes alone.
Writes benchmarks/records/gdn_core.json. GPU/TPU figures (the Pallas core) are not measured here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hybridmoe.kernels.gdn import gated_delta_rule  # noqa: E402
from hybridmoe.model.gdn import gdn_layer  # noqa: E402
from hybridmoe.analysis import program  # noqa: E402

# The last commit before the GDN speed work (its autodiff path).
BEFORE_COMMIT = "0f414be"

ARMS = {  # name: (what, code, backend, chunk size)
    "layer before autodiff C64": ("layer", "before", "xla_autodiff", 64),
    "layer before custom C64": ("layer", "before", "xla", 64),
    "layer now autodiff C64": ("layer", "now", "xla_autodiff", 64),
    "layer now custom C64": ("layer", "now", "xla", 64),
    "layer now custom C32": ("layer", "now", "xla", 32),
    "core before autodiff C64": ("core", "before", "xla_autodiff", 64),
    "core before custom C64": ("core", "before", "xla", 64),
    "core now autodiff C64": ("core", "now", "xla_autodiff", 64),
    "core now custom C64": ("core", "now", "xla", 64),
    "core now custom C32": ("core", "now", "xla", 32),
    "core now pallas_tpu C64": ("core", "now", "pallas_tpu", 64),
    "core now pallas_gpu C64": ("core", "now", "pallas_gpu", 64),
}
PALLAS_PLATFORM = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
BASELINE = {"layer": "layer before autodiff C64", "core": "core before autodiff C64"}


def _module_at_commit(path: str, name: str):
    """A module of this package as it was at BEFORE_COMMIT (its imports resolve to today's package)."""
    source = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:{path}"], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parent).stdout
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(source, f"{BEFORE_COMMIT}:{path}", "exec"), module.__dict__)
    return module


def before_code():
    """(gated_delta_rule, gdn_layer) as at BEFORE_COMMIT: the old layer calls the old core."""
    xla_before = _module_at_commit("hybridmoe/kernels/gdn/xla.py", "gdn_xla_before")
    layer_before = _module_at_commit("hybridmoe/model/gdn.py", "gdn_layer_before")

    def rule(*args, backend="xla", interpret=False, **kwargs):
        return xla_before.gated_delta_rule_chunked(*args, vjp={"xla": "custom", "xla_autodiff": "autodiff"}[backend],
                                                   **kwargs)

    layer_before.gated_delta_rule = rule
    return rule, layer_before.gdn_layer


def layer_step(layer, m, backend, chunk_size):
    def loss(p, x, seg):
        y = layer(p, x, seg, m, chunk_size=chunk_size, backend=backend)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def core_inputs(m, batch, tokens):
    """Random core inputs at the layer's shapes (q, k, v, g, beta) with gates as the model makes them."""
    keys = jax.random.split(jax.random.key(2), 5)
    qk_shape = (batch, tokens, m.gdn_num_key_heads, m.gdn_key_dim)
    v_shape = (batch, tokens, m.gdn_num_value_heads, m.gdn_value_dim)
    gate_shape = v_shape[:3]
    return (jax.random.normal(keys[0], qk_shape), jax.random.normal(keys[1], qk_shape),
            jax.random.normal(keys[2], v_shape), -0.1 * jax.nn.softplus(jax.random.normal(keys[3], gate_shape)),
            jax.nn.sigmoid(jax.random.normal(keys[4], gate_shape)))


def interpreted(backend):
    """A Pallas backend off its platform runs interpreted: traced and counted, never timed."""
    return backend in PALLAS_PLATFORM and jax.default_backend() != PALLAS_PLATFORM[backend]


def core_loss(rule, backend, chunk_size, seg):
    def loss(q, k, v, g, beta):
        o, _ = rule(q, k, v, g, beta, segment_ids=seg, chunk_size=chunk_size, backend=backend,
                                interpret=interpreted(backend))
        return jnp.sum(o.astype(jnp.float32) ** 2)

    return loss


def core_residual_bytes(core_args, rule, backend, chunk_size, seg):
    """Bytes the core's forward keeps for its backward (inputs it reads are counted too)."""
    residuals = program.saved_residuals(core_loss(rule, backend, chunk_size, seg), *core_args)
    return sum(int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize for r in residuals)


def table_rows(arms: dict, platform: str) -> list[dict]:
    """A record row per arm: its mean wall and CPU milliseconds over the rounds and their ratios to the
    baseline arm of its kind (BASELINE); an arm not timed (a Pallas core off its platform) its
    residual bytes alone."""
    base_ms = {what: 1e3 * float(np.mean(arms[name]["times"])) for what, name in BASELINE.items()}
    base_cpu_ms = {what: 1e3 * float(np.mean(arms[name]["cpu_times"])) for what, name in BASELINE.items()}
    rows = []
    for name, a in arms.items():
        if a["times"] is None:
            rows.append({"arm": name, "what": a["what"], "code": a["code"], "backend": a["backend"],
                         "chunk_size": a["chunk_size"], "timed": False, "why_not_timed": f"interpreted on {platform}",
                         "core_residual_bytes": a["core_residual_bytes"]})
            continue
        ms, cpu_ms = 1e3 * float(np.mean(a["times"])), 1e3 * float(np.mean(a["cpu_times"]))
        rows.append({"arm": name, "what": a["what"], "code": a["code"], "backend": a["backend"],
                     "chunk_size": a["chunk_size"], "mean_ms": ms, "min_ms": 1e3 * float(np.min(a["times"])),
                     "std_ms": 1e3 * float(np.std(a["times"])), "time_ratio_to_baseline": ms / base_ms[a["what"]],
                     "mean_cpu_ms": cpu_ms, "cpu_time_ratio_to_baseline": cpu_ms / base_cpu_ms[a["what"]],
                     "gflops": a["gflops"], "temp_bytes": a["temp_bytes"],
                     "core_residual_bytes": a["core_residual_bytes"]})
    return rows


def main(argv=None) -> int:
    args, recipe, overrides, cfg, steps = harness.one_device_config(__doc__, __file__, argv)
    m, t = cfg.model, cfg.train
    params, x, seg = harness.layer_case(cfg, "gdn", "mixer")

    core_args = core_inputs(m, t.batch_size, t.seq_len)
    code = {"before": before_code(), "now": (gated_delta_rule, gdn_layer)}
    arms = {}
    for name, (what, version, backend, chunk_size) in ARMS.items():
        rule, layer = code[version]
        residual_bytes = core_residual_bytes(core_args, rule, backend, chunk_size, seg)
        if interpreted(backend):
            arms[name] = {"what": what, "code": version, "backend": backend, "chunk_size": chunk_size,
                          "times": None, "core_residual_bytes": residual_bytes}
            continue
        if what == "layer":
            fn, fn_args = layer_step(layer, m, backend, chunk_size), (params, x, seg)
        else:
            fn, fn_args = jax.jit(jax.grad(core_loss(rule, backend, chunk_size, seg), argnums=range(5))), core_args
        prog = program.analyze(fn, *fn_args)
        jax.block_until_ready(fn(*fn_args))
        arms[name] = {"fn": fn, "args": fn_args, "what": what, "code": version, "backend": backend,
                      "chunk_size": chunk_size, "temp_bytes": prog.temp_bytes,
                      "gflops": prog.cost.get("flops", 0.0) / 1e9, "core_residual_bytes": residual_bytes}
    timed = {name: a for name, a in arms.items() if "fn" in a}
    times = harness.interleaved({name: (lambda a=a: a["fn"](*a["args"])) for name, a in timed.items()}, steps)
    for name, a in timed.items():
        a["times"], a["cpu_times"] = times[name]["wall_s"], times[name]["cpu_s"]

    rows = table_rows(arms, jax.default_backend())
    print(f"GDN layer forward+backward, {t.batch_size}x{t.seq_len} tokens, D={m.d_model} "
          f"Hk={m.gdn_num_key_heads} Hv={m.gdn_num_value_heads} dk={m.gdn_key_dim} dv={m.gdn_value_dim} "
          f"{m.compute_dtype}, {steps} interleaved rounds on {jax.devices()[0].device_kind}; before = {BEFORE_COMMIT}")
    print(f"{'arm':<26}{'ms':>9}{'ratio':>8}{'CPU ms':>9}{'ratio':>8}{'GFLOP':>8}{'temp MB':>10}{'residuals MB':>14}")
    for row in rows:
        if not row.get("timed", True):
            print(f"{row['arm']:<26}{'not timed (' + row['why_not_timed'] + ')':>52}"
                  f"{row['core_residual_bytes'] / 2**20:>14.2f}")
            continue
        print(f"{row['arm']:<26}{row['mean_ms']:>9.2f}{row['time_ratio_to_baseline']:>8.3f}{row['mean_cpu_ms']:>9.2f}"
              f"{row['cpu_time_ratio_to_baseline']:>8.3f}{row['gflops']:>8.2f}{row['temp_bytes'] / 2**20:>10.2f}"
              f"{row['core_residual_bytes'] / 2**20:>14.2f}")
    harness.write(
        args.out, "gdn_core",
        config={"recipe": recipe, "overrides": overrides, "resolved": json.loads(cfg.model_dump_json())},
        method=f"one device; every arm compiled first, then {steps} rounds with the arms interleaved "
               "(order rotated per round); mean wall time and mean process CPU time (all threads) of one "
               "jitted forward+backward of the GDN layer, or of the core alone at the layer's shapes, on "
               f"packed rows (two documents); 'before' arms run the layer and core of commit {BEFORE_COMMIT} "
               "(read from git history), 'now' arms this checkout; ratios to the before-autodiff chunk-64 "
               "arm of the same kind; XLA's flop count and compiled temporaries "
               "(hybridmoe.analysis.program); the core's saved residuals from jax's saved_residuals",
        baselines=BASELINE,
        before_commit=BEFORE_COMMIT,
        rows=rows,
        gpu="not measured here: the Pallas cores run interpreted off their platform, which is no speed "
            "measurement; this benchmark times them when run on a GPU (pallas_gpu) or TPU (pallas_tpu), e.g. at "
            "Qwen3.5-35B-A3B per-device shapes: recipe=small model.gdn_num_key_heads=16 model.gdn_num_value_heads=32 "
            "model.gdn_key_dim=128 model.gdn_value_dim=128 train.seq_len=8192 train.batch_size=1",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
