"""A peer on the chip: MaxText's own Qwen3.5-35B-A3B training step beside ours, at the one-chip shape.

The comparison a user choosing a trainer for Qwen3.5 on a TPU would make. MaxText (Google's JAX
trainer, which supports Qwen3.5-35B-A3B) is used as an installed library, never copied here: its
`qwen3.5-35b-a3b` model config, its `qwen3_5` decoder (Gated DeltaNet, gated attention, routed and
shared experts), its `setup_train_loop` (model, AdamW, shardings) and its jitted `train_step`
(forward, backward, optimizer update), fed its own synthetic batch. Both arms are built at the
one-chip share of recipe qwen3.5-35b-a3b-v5e-1: 4 layers (3 GDN + 1 attention), 16 experts, top-8,
a 32,768-token vocabulary, one 8,192-token row per step, bf16 weights and compute.

MaxText gets its documented TPU settings for MoE training: megablox grouped matmuls with
sparse_matmul (jax's ragged_dot where megablox cannot run: a CPU), flash (splash) attention on a TPU,
and each remat policy named in --maxtext-remat as its own arm ('full' is its default; 'minimal' the
fastest that fits on the one-chip shape in our measurements). Ours runs the recipe's defaults.

Method: every arm is compiled first; then the arms take turns in two visits each (A B C, then B C A).
A visit puts the arm's state on the device, runs one untimed step and `--steps / 2` timed ones, and
takes the state off the device (ours: made again by init_state at the next visit; MaxText's: copied
to the host and put back), so one arm's state is on the device at a time. Seconds per step: the mean
of the timed steps. Memory: XLA's analysis of the compiled step (arguments, temporaries, outputs) and,
where the runtime keeps figures (a TPU), the device's bytes in use and its process-wide peak after
each visit (the peak never falls: read it in visit order). Kernels: what each arm was configured to
run, and the custom calls in its compiled program (Mosaic kernels show as tpu_custom_call). A MaxText
arm that fails to build or compile (the chip's compiler refusing it for memory, or one of its kernels
under this JAX), or that the runtime refuses at a visit, is left out and recorded under `refused` with
the error and, for memory, the device's own figures (analysis/device_refusal.py).

The GDN layer alone, both ways: one Gated DeltaNet mixer (projections, conv, chunked delta rule,
gated norm, output projection), forward and backward of sum(y^2) with respect to its weights and
input, at the same shape, timed interleaved (harness.interleaved).

MaxText 0.2.x declares Python >= 3.12 and JAX >= 0.11.1; a TPU host here runs Python 3.11 and
JAX 0.10.2. What it takes (docs/tpu.md, "A peer on the chip: MaxText"): its wheel and those of its
imports installed with `pip install --no-deps --ignore-requires-python --target DIR`, DIR named by
--maxtext-site (put first on sys.path: a TPU host's own antlr4 and huggingface-hub, at versions
MaxText's imports refuse, would otherwise shadow the folder's; JAX is not among its wheels, so the
installed JAX stays the one imported), and two shims
this script applies before importing it: its two PEP 695 `type X = ...` aliases (maxtext.kernels.mhc,
imported by every decoder) read as plain assignments at import, and `must_fuse_call`, a fusion hint
JAX 0.10 lacks (used only by MaxText's jax_flash_attention), as the identity.

    python3 benchmarks/peer_maxtext.py --maxtext-site /path/to/mt-site            # on a v5e host
    python3 benchmarks/peer_maxtext.py --maxtext-site /tmp/mt-site --tiny         # CPU smoke run

Writes benchmarks/records/tpu_peer.json (--tiny: peer_maxtext_tiny.json): device, commit, versions
(maxtext's among them), per arm measured_s, tokens_per_s, memory, settings, kernels; the GDN layer's
time each way; the shims applied.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

RECIPE = "qwen3.5-35b-a3b-v5e-1"
MAXTEXT_MODEL = "qwen3.5-35b-a3b"

# The one-chip share, as MaxText's config keys (the recipe's shape; the rest from MaxText's model
# config, which matches ours: 2048 wide, 16/2 attention heads of 256, GDN 16/32 heads of 128, 512-wide
# routed and shared experts).
MAXTEXT_SHAPE = {"base_num_decoder_layers": 4, "num_experts": 16, "num_experts_per_tok": 8, "vocab_size": 32768,
                 "max_target_length": 8192, "per_device_batch_size": 1}
# --tiny: a few layers of small width, both arms (ours as overrides of the same recipe).
TINY_MAXTEXT = {"base_num_decoder_layers": 4, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 512,
                "max_target_length": 128, "per_device_batch_size": 1, "base_emb_dim": 64, "base_num_query_heads": 4,
                "base_num_kv_heads": 2, "head_dim": 16, "base_mlp_dim": 32, "base_moe_mlp_dim": 32,
                "gdn_key_head_dim": 16, "gdn_value_head_dim": 16, "gdn_num_key_heads": 2, "gdn_num_value_heads": 4}
TINY_OURS = ["model.num_layers=4", "model.num_experts=4", "model.num_experts_per_tok=2", "model.vocab_size=512",
             "train.seq_len=128", "train.batch_size=1", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2",
             "model.head_dim=16", "model.moe_intermediate_size=32", "model.shared_expert_intermediate_size=32",
             "model.gdn_key_dim=16", "model.gdn_value_dim=16", "model.gdn_num_key_heads=2",
             "model.gdn_num_value_heads=4",
             # On a CPU the grouped matmuls default to row tiles, under which the recipe's gather backwards
             # are refused (row tiles' backward is gathers already): the chip's program, ragged_dot, instead.
             "kernels.gmm.xla_impl=ragged_dot"]
OURS_PINNED = ["mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=1", "mesh.expert=1"]


# --- Python 3.11 / JAX 0.10 shims for MaxText ------------------------------------------------------------

class _TypeAliasFinder(importlib.abc.MetaPathFinder):
    """Loads the listed MaxText modules with their PEP 695 `type X = Y` statements (Python 3.12 syntax)
    read as `X = Y`: in these modules they are type aliases only, used in annotations."""

    PREFIXES = ("maxtext.kernels.mhc",)

    def find_spec(self, name, path, target=None):
        if not name.startswith(self.PREFIXES):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            spec.loader = _TypeAliasLoader(name, spec.origin)
        return spec


class _TypeAliasLoader(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data, path, *, _optimize=-1):
        return compile(re.sub(rb"(?m)^type (\w+) = ", rb"\1 = ", data), path, "exec", dont_inherit=True)


def apply_shims() -> list[str]:
    """What MaxText 0.2.x needs to import on Python 3.11 with JAX 0.10: the shims applied (recorded)."""
    applied = []
    if sys.version_info < (3, 12) and not any(isinstance(f, _TypeAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TypeAliasFinder())
        applied.append("maxtext.kernels.mhc: PEP 695 `type X = Y` aliases read as `X = Y` at import (Python < 3.12)")
    import jax.experimental.xla_metadata as xla_metadata

    if not hasattr(xla_metadata, "must_fuse_call"):
        xla_metadata.must_fuse_call = lambda *a, **k: (lambda f: f)
        applied.append("jax.experimental.xla_metadata.must_fuse_call: the identity (a fusion hint JAX < 0.11 "
                       "lacks; only MaxText's jax_flash_attention calls it)")
    return applied


def import_maxtext(site: str | None) -> tuple[object | None, str | None, list[str]]:
    """(the maxtext module or None, why not, shims applied). site: a `pip --target` folder, put first on
    sys.path: the host's own packages at other versions (antlr4 4.x against omegaconf's 4.9.3,
    huggingface-hub 1.x against transformers' >= 2.4 on the v5e host) must not shadow the folder's.
    JAX is not in the folder, so the installed JAX stays the one imported."""
    if site and site not in sys.path:
        sys.path.insert(0, site)
    try:
        shims = apply_shims()
        import maxtext
        from maxtext.models import qwen3_5  # noqa: F401  (the decoder: fails here when a dependency is missing)
        from maxtext.trainers.pre_train import train  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any import failure is the answer: recorded, not raised)
        import traceback

        frame = traceback.extract_tb(e.__traceback__)[-1]
        return None, f"{type(e).__name__}: {e} ({frame.filename}:{frame.lineno})", []
    return maxtext, None, shims


# --- the arms -------------------------------------------------------------------------------------------

def custom_calls(hlo_text: str) -> dict[str, int]:
    """The compiled program's custom-call targets and how often each appears (Mosaic/Pallas kernels on a
    TPU: tpu_custom_call)."""
    return dict(Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def memory_of(compiled) -> dict:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "temp", "output", "alias")}


def device_memory() -> dict | None:
    import jax

    stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def steps_per_visit(args) -> int:
    """Timed steps in each of the two visits: together at least --steps (an odd count rounds up)."""
    return -(-args.steps // 2)


def arm_rows(arms: dict) -> dict:
    """Each arm's record row from its timed steps: the mean step time, tokens per second, and the time
    over our arm's (timed in the same run)."""
    import numpy as np

    rows = {}
    for name, a in arms.items():
        sec = float(np.mean(a.times))
        rows[name] = {"measured_s": sec, "tokens_per_s": a.tokens / sec, "tokens_per_step": a.tokens,
                      "step_times_s": a.times, "losses": a.losses, "compile_s": a.compile_s,
                      "memory": {"compiled": a.memory, "device_after_visits": a.device_after_visits},
                      "kernels": a.kernels,
                      "settings": (a.overrides if isinstance(a, OursArm) else a.argv[2:])}
    ours_s = rows["ours"]["measured_s"]
    for row in rows.values():
        row["over_ours"] = row["measured_s"] / ours_s  # against our arm timed in the same run
    return rows


def maxtext_argv(maxtext, shape: dict, remat: str, platform: str, weight_dtype: str, out_dir: str) -> list[str]:
    """MaxText's command line for its Qwen3.5-35B-A3B model at `shape` (its own base.yml and model config)."""
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    tpu = platform == "tpu"
    settings = {
        "model_name": MAXTEXT_MODEL, "override_model_config": "true", "run_name": "peer", "base_output_directory": out_dir,
        "dataset_type": "synthetic", "enable_checkpointing": "false",
        # A schedule of 100 steps without warm-up: the timed steps update the weights at a real rate
        # (a long warm-up would make them near-zero updates; the work per step is the same).
        "steps": 100, "warmup_steps_fraction": 0,
        "enable_goodput_recording": "false", "monitor_goodput": "false", "skip_jax_distributed_system": "true",
        "use_mrope": "false",  # text only: the multimodal position ids are the vision tower's
        "dtype": "bfloat16", "weight_dtype": weight_dtype,
        # MoE: megablox grouped matmuls (Pallas, TPU only) with sparse_matmul; ragged_dot where megablox cannot run.
        "sparse_matmul": "true", "megablox": "true" if tpu else "false",
        "attention": "flash" if tpu else "dot_product", "remat_policy": remat,
        **shape,
    }
    return ["", base, *(f"{k}={v}" for k, v in settings.items())]


@contextlib.contextmanager
def maxtext_jax_flags(config):
    """The JAX options MaxText's own train.initialize sets from its config (the Shardy partitioner; size-one
    mesh axes dropped from types), set while MaxText's programs are traced and put back after, so our
    arm is traced under JAX's defaults."""
    import jax

    wanted = {"jax_use_shardy_partitioner": bool(config.shardy),
              "jax_remove_size_one_mesh_axis_from_type": bool(config.remove_size_one_mesh_axis_from_type)}
    before = {k: getattr(jax.config, k) for k in wanted}
    for k, v in wanted.items():
        jax.config.update(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)


class MaxTextArm:
    """MaxText's own model, optimizer and jitted train step (its train_loop's set-up, without data or
    checkpoints); the state leaves the device between visits as host arrays."""

    def __init__(self, maxtext, name: str, argv: list[str]):
        from maxtext.configs import pyconfig

        self.name, self.argv = name, argv
        self.config = config = pyconfig.initialize(argv)
        with maxtext_jax_flags(config):
            self._build(config)

    def _build(self, config):
        import jax
        from flax import nnx
        from flax.core.spmd import logical_axis_rules
        from maxtext.trainers.pre_train import train as mt_train
        from maxtext.utils import maxtext_utils, sharding, train_utils

        out = train_utils.setup_train_loop(config, None)
        state_shardings, self.mesh, train_state = out[2], out[4], out[-1]
        graphdef, state = nnx.split(train_state)
        params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
        step, _ = train_utils.jit_train_and_eval_step(config, graphdef, self.mesh, state, state_shardings,
                                                      mt_train.train_step, mt_train.eval_step, None, params_shardings)
        self.rules = lambda: logical_axis_rules(config.logical_axis_rules)
        with jax.set_mesh(self.mesh), self.rules():
            shaped = maxtext_utils.get_shaped_batch(config, batch_sharding=sharding.get_input_data_sharding(config, self.mesh))
            self.batch = mt_train.make_synthetic_batch(config, shaped)
            t0 = time.perf_counter()
            self.compiled = step.lower(state, self.batch).compile()
            self.compile_s = time.perf_counter() - t0
        self.shardings = jax.tree.map(lambda a: a.sharding, state)
        self.host_state = jax.device_get(state)
        del state, train_state, out
        self.tokens = int(config.global_batch_size_to_train_on) * int(config.max_target_length)
        text = self.compiled.as_text()
        self.kernels = {"configured": {k: getattr(config, k) for k in (
            "megablox", "sparse_matmul", "use_tokamax_gmm", "attention", "use_tokamax_splash", "remat_policy",
            "scan_layers", "gdn_chunk_size", "dtype", "weight_dtype")},
            "gdn_core": "maxtext.models.qwen3.jax_chunk_gated_delta_rule (pure JAX, no Pallas kernel)",
            "custom_calls": custom_calls(text)}
        self.kernels["configured"] = {k: str(v) for k, v in self.kernels["configured"].items()}
        self.memory = memory_of(self.compiled)
        self.times, self.losses, self.device_after_visits = [], [], []

    def visit(self, steps: int) -> None:
        import jax

        with jax.set_mesh(self.mesh), self.rules():
            state = jax.device_put(self.host_state, self.shardings)
            for i in range(steps + 1):
                t0 = time.perf_counter()
                state, metrics = self.compiled(state, self.batch)
                loss = float(metrics["scalar"]["learning/loss"])
                if i:
                    self.times.append(time.perf_counter() - t0)
                    self.losses.append(loss)
            self.device_after_visits.append(device_memory())
            self.host_state = jax.device_get(state)
        del state


class OursArm:
    """This project's jitted train step (run/setup.py, the recipe's defaults), its state made anew by
    init_state at each visit, as `hybridmoe bench` does."""

    def __init__(self, name: str, recipe: str, overrides: list[str]):
        import jax

        from hybridmoe.data.synthetic import synthetic_batch
        from hybridmoe.kernels.attention.limits import resolve as resolve_attention
        from hybridmoe.kernels.gdn.limits import resolve as resolve_gdn
        from hybridmoe.parallel.host import put_global
        from hybridmoe.recipe import load_config, split_args
        from hybridmoe.run.setup import build, jit_train_step

        self.name, self.overrides = name, overrides
        r, o = split_args([f"recipe={recipe}", *overrides])
        self.cfg = cfg = load_config(r, o)
        self.setup = setup = build(cfg)
        t = cfg.train
        self.batch_of = lambda i: put_global(synthetic_batch(t.seed, i, t.fewest_micro_batches, t.rows_per_micro_batch,
                                                             t.seq_len, cfg.model.vocab_size), setup.batch_sharding(1))
        with setup.context():
            t0 = time.perf_counter()
            self.compiled = jit_train_step(setup).lower(setup.abstract_state(), self.batch_of(0)).compile()
            self.compile_s = time.perf_counter() - t0
        self.tokens = t.batch_size * t.seq_len
        platform = jax.devices()[0].platform
        k = cfg.kernels
        self.kernels = {"configured": {"gdn": k.gdn.backend, "attention": getattr(k.attention, "backend", None),
                                       "gmm": k.gmm.backend, "remat": cfg.remat.policy, "gdn_chunk_size": cfg.gdn.chunk_size},
                        "resolved": {"gdn": resolve_gdn(k.gdn.backend, platform, cfg.gdn.chunk_size),
                                     "attention": resolve_attention(getattr(k.attention, "backend", "auto"), platform)},
                        "custom_calls": custom_calls(self.compiled.as_text())}
        self.memory = memory_of(self.compiled)
        self.times, self.losses, self.device_after_visits, self.visits = [], [], [], 0

    def visit(self, steps: int) -> None:
        import jax

        from hybridmoe.parallel.host import fetch_global
        from hybridmoe.run.setup import init_state

        with self.setup.context():
            state = init_state(self.setup, jax.random.key(self.cfg.train.seed + self.visits))
            for i in range(steps + 1):
                t0 = time.perf_counter()
                state, m = self.compiled(state, self.batch_of(self.visits * (steps + 1) + i))
                m = fetch_global(m)
                if i:
                    self.times.append(time.perf_counter() - t0)
                    self.losses.append(float(m["loss"]) if "loss" in m else None)
            self.device_after_visits.append(device_memory())
        self.visits += 1
        del state


# --- the GDN layer alone --------------------------------------------------------------------------------

def gdn_ours(cfg):
    """(fn, args) forward+backward of one of our GDN mixers at the config's shape."""
    import jax
    import jax.numpy as jnp

    from hybridmoe.model.gdn import gdn_layer

    m = cfg.model
    params, x, seg = harness.layer_case(cfg, "gdn", "mixer")

    def loss(p, x):
        y = gdn_layer(p, x, seg, m, chunk_size=cfg.gdn.chunk_size, backend=cfg.kernels.gdn.backend)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x)


def gdn_maxtext(arm: MaxTextArm):
    """(fn, args) forward+backward of MaxText's Qwen3.5 GDN mixer (Qwen3_5GatedDeltaNet) at its config's
    shape, its weights made by its own initializers."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from maxtext.models.qwen3_5 import Qwen3_5GatedDeltaNet

    c = arm.config
    shape = (int(c.per_device_batch_size), int(c.max_target_length), int(c.emb_dim))
    with maxtext_jax_flags(c), jax.set_mesh(arm.mesh), arm.rules():
        layer = Qwen3_5GatedDeltaNet(config=c, inputs_shape=shape, mesh=arm.mesh, dtype=c.dtype, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), shape).astype(c.dtype)
    seg = jnp.where(jnp.arange(shape[1]) < shape[1] // 3, 1, 2)[None].repeat(shape[0], 0).astype(jnp.int32)

    def loss(p, x):
        y, _ = nnx.merge(graphdef, p)(x, decoder_segment_ids=seg)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def run(p, x):
        with maxtext_jax_flags(c), jax.set_mesh(arm.mesh), arm.rules():
            return step(p, x)

    return run, (params, x)


def gdn_layer_times(ours_cfg, mt_arm: MaxTextArm, rounds: int) -> dict:
    import jax
    import numpy as np

    fns = {"ours": gdn_ours(ours_cfg), "maxtext": gdn_maxtext(mt_arm)}
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))  # compile and warm
    times = harness.interleaved({n: (lambda f=f, a=a: f(*a)) for n, (f, a) in fns.items()}, rounds)
    return {n: {"mean_s": float(np.mean(t["wall_s"])), "times_s": t["wall_s"]} for n, t in times.items()}


# --- the run --------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True, record="tpu_peer")
    local = harness.ROOT / ".maxtext-site"
    p.add_argument("--maxtext-site", default=str(local) if local.is_dir() else None,
                   help="folder MaxText and its dependencies were installed into (pip --target); default the "
                   "repository's .maxtext-site/ where scripts/maxtext_wheels.sh install puts them, if it is there")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (4 layers of width 64, 128 tokens): a CPU smoke run")
    p.add_argument("--steps", type=int, default=4, help="timed steps per arm, over two visits (default 4)")
    p.add_argument("--gdn-rounds", type=int, default=5, help="interleaved rounds of the GDN layer alone (default 5)")
    p.add_argument("--maxtext-remat", default="full,minimal",
                   help="MaxText arms: one per remat_policy, comma-separated (default full,minimal; --tiny: full)")
    p.add_argument("--maxtext-weight-dtype", default="bfloat16",
                   help="MaxText's weight_dtype (default bfloat16, as the recipe's params; its own default is float32)")
    p.add_argument("--compile-cache", help="JAX's persistent compile cache folder")
    p.add_argument("overrides", nargs="*", help="section.key=value for our arm")
    args = p.parse_args(argv)
    if args.tiny and args.out == p.get_default("out"):
        args.out = str(harness.RECORDS / "peer_maxtext_tiny.json")
    harness.configure(cpu_only=args.tiny, cache_dir=args.compile_cache)
    import jax

    maxtext, why_not, shims = import_maxtext(args.maxtext_site)
    if maxtext is None:
        print(f"MaxText does not import: {why_not}", flush=True)
        harness.write(args.out, "tpu_peer", recipe=RECIPE, tiny=args.tiny, maxtext_import_error=why_not, arms={})
        return 2
    platform = jax.devices()[0].platform
    remats = ["full"] if args.tiny and args.maxtext_remat == p.get_default("maxtext_remat") else args.maxtext_remat.split(",")
    shape = TINY_MAXTEXT if args.tiny else MAXTEXT_SHAPE
    ours_overrides = [*OURS_PINNED, *(TINY_OURS if args.tiny else []), *args.overrides]
    per_visit = steps_per_visit(args)
    out_dir = tempfile.mkdtemp(prefix="peer-maxtext-")

    arms = {"ours": OursArm("ours", RECIPE, ours_overrides)}
    print(f"ours: compiled in {arms['ours'].compile_s:.1f} s", flush=True)
    refused = {}  # an arm the device refuses (its compiler, or its runtime at a visit), with the device's words

    def refuse(name, e, when):
        from hybridmoe.analysis.device_refusal import device_refusal

        refused[name] = {"when": when, "error": type(e).__name__, "message": str(e)[:3000],
                         "device_refusal": device_refusal(e, when)}  # None: not a refusal for memory
        print(f"{name}: refused at {when}: {str(e)[:300]}", flush=True)

    for remat in remats:
        name = f"maxtext_remat_{remat}"
        argv_mt = maxtext_argv(maxtext, shape, remat, platform, args.maxtext_weight_dtype, out_dir)
        try:
            arms[name] = MaxTextArm(maxtext, name, argv_mt)
        except Exception as e:  # noqa: BLE001  (the chip's compiler, or MaxText's kernels under this JAX: recorded)
            refuse(name, e, "compile")
            continue
        print(f"{name}: compiled in {arms[name].compile_s:.1f} s", flush=True)
    order = list(arms)
    for visit in range(2):
        for name in order[visit % len(order):] + order[:visit % len(order)]:
            if name in refused:
                continue
            try:
                arms[name].visit(per_visit)
            except jax.errors.JaxRuntimeError as e:
                refuse(name, e, "run")
    for name in refused:
        arms.pop(name, None)
    if "ours" not in arms:
        raise SystemExit(f"our arm was refused: {refused['ours']['message'][:500]}")
    mt_arms = [a for a in arms.values() if isinstance(a, MaxTextArm)]
    gdn = gdn_layer_times(arms["ours"].cfg, mt_arms[0], args.gdn_rounds) if mt_arms else None

    rows = arm_rows(arms)
    from hybridmoe.tools.record import machine_record, source_commit

    # One chip call can time one MaxText arm beside ours and the next call another: each keeps its own
    # run's ratio to ours and its commit; this run's `ours` replaces the earlier one.
    rows = harness.merged_with_earlier(args.out, "arms", rows, machine_record()["device"], source_commit())
    import importlib.metadata

    print(f"{'arm':<24}{'s/step':>10}{'tokens/s':>12}{'over ours':>10}")
    for name, row in rows.items():
        print(f"{name:<24}{row['measured_s']:>10.4f}{row['tokens_per_s']:>12.0f}{row['over_ours']:>10.3f}")
    for name, r in refused.items():
        print(f"{name:<24}refused at {r['when']}")
    if gdn:
        print("GDN layer fwd+bwd: " + ", ".join(f"{n} {1e3 * g['mean_s']:.2f} ms" for n, g in gdn.items()))
    harness.write(args.out, "tpu_peer", recipe=RECIPE, tiny=args.tiny, platform=platform,
                  maxtext_version=importlib.metadata.version("maxtext"), maxtext_site=args.maxtext_site,
                  maxtext_model=MAXTEXT_MODEL, python=sys.version.split()[0], shims=shims,
                  versions=harness.package_versions("maxtext", "flax", "tokamax", "qwix", "aqtp", "optax"),
                  steps=args.steps, arms=rows, refused=refused, gdn_layer=gdn,
                  gdn_layer_over_ours=gdn["maxtext"]["mean_s"] / gdn["ours"]["mean_s"] if gdn else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
