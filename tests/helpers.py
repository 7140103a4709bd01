"""Small shared builders for tests: a tiny config, its params and a packed batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.recipe import load_config
from hybridmoe.model.params import declare_params, init_params
from hybridmoe.data.packing import pack_documents


# One layer of each mixer: tests of the run around the model (resume, guards, outputs) trace and
# compile it in about half of tiny's four layers' time.
TWO_LAYERS = ("model.layer_pattern=[gdn,attention]", "model.num_layers=2")
# Two attention layers (the layer scan of two one-layer blocks): tests of the attention core or the
# MoE layer (every layer's) through the model, at about half of TWO_LAYERS' compile (no GDN layer).
ATTENTION_LAYERS = ("model.layer_pattern=[attention]", "model.num_layers=2")
# Two GDN layers (the layer scan of two one-layer blocks): tests of the GDN core through the model.
GDN_LAYERS = ("model.layer_pattern=[gdn]", "model.num_layers=2")


def tiny_config(*overrides: str, platform: str | None = None):
    return load_config("tiny", list(overrides), platform=platform)


def tiny_params(cfg, seed: int = 0, perturb: bool = True):
    """Initialised params; with `perturb`, norm offsets and zero-init weights get noise too, so no
    parameter sits at a value (0 or 1) that could hide a wrong formula."""
    params = init_params(declare_params(cfg.model), jax.random.key(seed))
    if not perturb:
        return params
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, leaves)


def packed_batch(seed: int, rows: int, seq_len: int, vocab: int, doc_lengths=(5, 70, 9, 30)):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, vocab, size=n) for n in doc_lengths for _ in range(rows)]
    return {k: jnp.asarray(v) for k, v in pack_documents(docs, rows, seq_len).items()}


def assert_rel_l2(a, b, tol):
    """Per-leaf relative L2 error: float32 sums in another order differ by ~1e-5, a wrong
    collective or layout by O(1)."""
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        err = np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)
        assert err < tol, f"{jax.tree_util.keystr(path)}: relative L2 error {err:.2e} >= {tol}"


def benchmark_script(name: str):
    """benchmarks/<name>.py loaded as a module (its folder on the path for its `import harness`),
    registered under `name` as the scripts' own child processes would import it."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def benchmark_script_unconfigured(name: str):
    """benchmark_script(name) with the harness's JAX set-up (harness.configure) a no-op while it loads,
    so a script that configures JAX at import leaves this process's devices and cache as they are."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import benchmarks.harness as harness

    configure = harness.configure
    harness.configure = lambda *a, **k: None
    try:
        return benchmark_script(name)
    finally:
        harness.configure = configure


class SteppingClock:
    """A stand-in for a module's `time`: perf_counter moves `wall` seconds a call, process_time `cpu`."""

    def __init__(self, wall: float, cpu: float = 0.0):
        self.wall, self.cpu, self.t, self.c = wall, cpu, 0.0, 0.0

    def perf_counter(self) -> float:
        self.t += self.wall
        return self.t

    def process_time(self) -> float:
        self.c += self.cpu
        return self.c


def counted_loop_hlo(start: int, limit: int, operands: str, direction: str) -> str:
    """HLO text of a while loop `loop` from `start` whose condition is compare(operands) by `direction`
    (operands `%i, %limit` or `%limit, %i`: the counter and the constant `limit`), no known_trip_count,
    the body one f32 [8, 8] @ [8, 8] dot (1024 FLOPs a trip)."""
    return f"""HloModule loop

%cond (c: (s32[], f32[8,8])) -> pred[] {{
  %c = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant({limit})
  ROOT %cmp = pred[] compare({operands}), direction={direction}
}}

%body (b: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {{
  %b = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %x = f32[8,8]{{1,0}} get-tuple-element(%b), index=1
  %y = f32[8,8]{{1,0}} dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %t = (s32[], f32[8,8]{{1,0}}) tuple(%next, %y)
}}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {{
  %x = f32[8,8]{{1,0}} parameter(0)
  %start = s32[] constant({start})
  %init = (s32[], f32[8,8]{{1,0}}) tuple(%start, %x)
  %loop = (s32[], f32[8,8]{{1,0}}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,8]{{1,0}} get-tuple-element(%loop), index=1
}}
"""


class HandMadeEstimator:
    """An hlo_cost.Estimator over hand-made ops: a subclass's `ops()` gives (OpCost, times run); the
    instructions are named op.0, op.1, ... and the schedule is serial (every collective waited for
    whole, as a synchronous one is)."""

    unknown_trips: list = []

    def named_ops(self):
        return [(f"op.{i}", c, k) for i, (c, k) in enumerate(self.ops())]

    def op_names(self):
        return {}

    def timeline(self, seconds, exposures=None):
        busy = sum(seconds(c) * k for c, k in self.ops() if not c.collective)
        exposed = 0.0
        for name, c, k in self.named_ops():
            if c.collective:
                exposed += seconds(c) * k
                if exposures is not None:
                    exposures[name] = seconds(c) * k
        return busy, exposed
