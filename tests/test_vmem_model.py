"""The on-chip memory model (kernels/vmem.py and each family's limits) and the per-kernel tiles.

No compile here (tests/test_vmem_tpu_compile.py checks the model's verdicts against the Mosaic
compiler): the model's blocks and scratch equal the BlockSpecs and scratch of the traced
pallas_calls, every per-kernel tile key reaches its kernel and only it, and the validator refuses a
tile set that does not fit at load.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.config.errors import ConfigError
from hybridmoe.kernels.attention import limits as attention_limits
from hybridmoe.kernels.gdn import limits as gdn_limits
from hybridmoe.kernels.gmm import tiling
from hybridmoe.kernels.vmem import MIB
from hybridmoe.model import moe
from hybridmoe.recipe import load_config
from hybridmoe.recipe.kernel_needs import gmm_vmem_needs

from tests.broken_variants import BROKEN_TILE_PLUMBING


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _name(params) -> str:
    info = params.get("name_and_src_info")
    return info.name if info is not None else params["name"]


def traced_kernels(fn, *args) -> list[tuple[str, tuple]]:
    """Every pallas_call of fn's jaxpr: (name, sorted (shape, itemsize, buffer count) of its blocks
    and scratch), read from the call's grid mapping (what Mosaic is handed)."""
    out = []
    for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr):
        if e.primitive.name != "pallas_call":
            continue
        gm = e.params["grid_mapping"]
        rows = []
        for bm in gm.block_mappings:
            if str(getattr(bm.block_aval, "memory_space", "")) == "any":
                continue  # left in HBM: the kernel copies what it needs into its scratch
            count = bm.pipeline_mode.buffer_count if bm.pipeline_mode is not None else 2
            rows.append((tuple(bm.block_aval.shape), bm.array_aval.dtype.itemsize, count))
        body = e.params["jaxpr"]
        for v in body.invars[len(body.invars) - gm.num_scratch_operands:]:
            # DMA semaphores: the model lists them as 4-byte scalars that take no VMEM
            itemsize = 4 if str(v.aval.memory_space) == "semaphore_mem" else v.aval.dtype.itemsize
            rows.append((tuple(v.aval.shape), itemsize, 1))
        out.append((_name(e.params), tuple(sorted(rows))))
    return out


def modelled(name: str, buffers) -> tuple[str, tuple]:
    return name, tuple(sorted((b.shape, b.itemsize, b.count) for b in buffers if b.kind != "value"))


# ---------------------------------------------------------------------------------------------
# The MoE layer's grouped matmuls: each kernel's blocks are the model's at that kernel's own tiles.

M, D, F, E = 256, 256, 256, 4
SHARED = tiling.Tiling(tm=32, tk=128, tn=128)
# A per-kernel value for each dimension, different from the shared one and dividing every dim.
OWN = {"tm": 64, "tk": 256, "tn": 256}
KEYS = [f"{k}_{d}" for k in tiling.KERNELS for d in tiling.DIMS]


def _layer_kernels(values: dict, fused: bool, chunks: int = 1):
    tiles = tiling.kernel_tiles({"tm": SHARED.tm, "tk": SHARED.tk, "tn": SHARED.tn, **values})
    plan = moe.GroupedPlan(num_experts=E, wi_fused_swiglu=fused, wo_fused_dswiglu=fused,
                           router_grad_from_wo_input=fused, backend="pallas_tpu", tiles=tiles,
                           tile_n_per_half=128 if fused else None, token_chunks=chunks)
    x, w = jnp.zeros((M, D), jnp.bfloat16), jnp.zeros((M,), jnp.float32)
    wi, wo = jnp.zeros((E, D, 2 * F), jnp.bfloat16), jnp.zeros((E, F, D), jnp.bfloat16)
    sizes = jnp.full((E,), M // E, jnp.int32)

    def loss(x, w, wi, wo):
        if chunks == 1:
            return jnp.sum(moe._expert_mlp(x, w, wi, wo, sizes, plan, 0).astype(jnp.float32))
        # M tokens, each routed to one expert (k = 1), in `chunks` chunks: M / chunks rows a chunk.
        idx = (jnp.arange(M, dtype=jnp.int32) % E)[:, None]
        return jnp.sum(moe.token_chunked_experts(x, w[:, None], idx, wi, wo, plan)[0].astype(jnp.float32))

    traced = traced_kernels(jax.grad(loss, (0, 1, 2, 3)), x, w, wi, wo)
    model = tiling.layer_kernels(d_model=D, hidden=F, tiles=tiles, wi_fused=fused, wo_fused=fused,
                                 tile_n_per_half=128 if fused else None, row_scale=fused, rows=M // chunks,
                                 accumulate_weight_grads=chunks > 1)
    return traced, {role: modelled(name, bufs) for role, (name, bufs) in model.items()}


def test_chunked_weight_gradients_read_their_accumulator_block():
    """Under moe.token_chunks the two weight-gradient kernels add into the carried gradient: one more
    [tk, tn] block each, which the model counts (gmm_vmem_needs passes token_chunks > 1)."""
    traced, model = _layer_kernels({}, True, chunks=2)
    # The forward runs twice (the chunk scan, then its replay in the backward): count kernels once.
    assert set(traced) == set(model.values()), (traced, model)
    # Against the same grid-pipelined kernel without the accumulator (the one pass runs
    # tgmm_written_behind instead, whose blocks differ more).
    plain = modelled("tgmm", tiling.tpu_buffers("tgmm", tm=SHARED.tm, tk=SHARED.tk, tn=SHARED.tn))
    for role in ("wi_drhs", "wo_drhs"):
        extra = collections.Counter(model[role][1]) - collections.Counter(plain[1])
        assert list(extra.elements()) == [((SHARED.tk, SHARED.tn), 2, 2)], (role, extra)
        assert not collections.Counter(plain[1]) - collections.Counter(model[role][1]), role


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_each_per_kernel_key_reaches_its_kernel_only(fused):
    """For the shared tiles and for each per-kernel key set alone: the traced layer's kernels (forward
    and backward) are exactly the model's six at their resolved tiles, and the key changes the blocks
    of its own kernel and of no other."""
    traced, base = _layer_kernels({}, fused)
    assert collections.Counter(traced) == collections.Counter(base.values()), (traced, base)
    for key in KEYS:
        kernel, dim = key.rsplit("_", 1)
        if fused and key in ("wi_fwd_tn", "wo_dlhs_tn"):
            continue  # the fused kernels' N tiles are tile_n_per_half and F (the validator refuses these keys)
        traced, model = _layer_kernels({key: OWN[dim]}, fused)
        assert collections.Counter(traced) == collections.Counter(model.values()), (key, traced, model)
        changed = {role for role in tiling.KERNELS if model[role] != base[role]}
        assert changed == {kernel}, (key, changed)


@pytest.mark.parametrize("variant", sorted(BROKEN_TILE_PLUMBING))
def test_broken_tile_plumbing_is_caught(monkeypatch, variant):
    for module, name, broken in BROKEN_TILE_PLUMBING[variant]():
        monkeypatch.setattr(module, name, broken)
    with pytest.raises(AssertionError):
        test_each_per_kernel_key_reaches_its_kernel_only(fused=True)


def test_wi_forward_depth_is_a_buffer_count():
    """The fused forward's weight depth is the weight blocks' buffer count, in the kernel and the model."""
    traced, model = _layer_kernels({"wi_fwd_tk": D}, True)  # one K tile: the depth applies
    depth1 = tiling.kernel_tiles({"tm": 32, "tk": 128, "tn": 128, "wi_fwd_tk": D, "wi_fwd_rhs_buffer_count": 1})
    need = {n: tiling.layer_kernels(d_model=D, hidden=F, tiles=t, wi_fused=True, wo_fused=True, tile_n_per_half=128,
                                    row_scale=True)["wi_fwd"][1] for n, t in (("2", tiling.kernel_tiles(
                                        {"tm": 32, "tk": 128, "tn": 128, "wi_fwd_tk": D})), ("1", depth1))}
    weights = [b for b in need["1"] if b.what in ("w_gate", "w_up")]
    assert {b.count for b in weights} == {1}
    saved = sum(b.tpu_bytes for b in need["2"]) - sum(b.tpu_bytes for b in need["1"])
    assert saved == 2 * D * 128 * 2  # one bf16 [D, 128] block per half


# ---------------------------------------------------------------------------------------------
# Flash attention and GDN kernels: the model's blocks are the traced ones.


def test_flash_kernels_blocks_are_the_models():
    from hybridmoe.kernels.attention import ops

    T, N, G, A, bq, bk = 512, 8, 2, 128, 128, 256
    q, kv = jnp.zeros((1, T, N, A), jnp.bfloat16), jnp.zeros((1, T, G, A), jnp.bfloat16)
    ids = jnp.zeros((1, T), jnp.int32)

    def loss(q, k, v):
        o = ops.flash_attention(q, k, v, q_pos_BT=ids, kv_pos_BS=ids, q_seg_BT=ids, kv_seg_BS=ids, scale=0.1,
                                backend="pallas_tpu", block_q=bq, block_k=bk)
        return jnp.sum(o.astype(jnp.float32))

    traced = traced_kernels(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    model = [modelled(k, attention_limits.tpu_buffers(k, block_q=bq, block_k=bk, group=N // G, head_dim=A))
             for k in attention_limits.KERNELS]
    assert collections.Counter(traced) == collections.Counter(model), (traced, model)


def test_gdn_kernels_blocks_are_the_models():
    from hybridmoe.kernels.gdn import gated_delta_rule

    C, K, V, T, H = 64, 128, 128, 256, 2
    args = (jnp.zeros((1, T, 1, K)), jnp.zeros((1, T, 1, K)), jnp.zeros((1, T, H, V)), jnp.zeros((1, T, H)),
            jnp.zeros((1, T, H)))

    def loss(*a):
        o, final = gated_delta_rule(*a, chunk_size=C, backend="pallas_tpu")
        return jnp.sum(o) + jnp.sum(final)

    traced = traced_kernels(jax.grad(loss, (0, 1, 2, 3, 4)), *args)
    model = [modelled(k, gdn_limits.tpu_buffers(k, chunk_size=C, key_dim=K, value_dim=V, group=H))
             for k in gdn_limits.KERNELS]
    assert collections.Counter(traced) == collections.Counter(model), (traced, model)


# ---------------------------------------------------------------------------------------------
# The seed's cell: its tiles fit by the model, at load; a 16 MiB limit is refused, naming the kernels.

CELL = "qwen3.5-397b-a17b-v7x-128"


def test_seed_cell_recipe_fits_at_load():
    cfg = load_config(CELL, [], platform="tpu")
    needs = gmm_vmem_needs(cfg)
    assert all(n.fits for n in needs.values()), {k: n.text() for k, n in needs.items()}
    assert needs["wi_fwd"].limit_bytes == int(57.6 * MIB)  # the kernel's vmem_limit_bytes


def test_seed_cell_recipe_refused_at_a_16_mib_limit_naming_the_kernel(monkeypatch):
    # Refused at load, never after a compile: nothing may lower or compile a program on the way.
    def no_compile(*args, **kwargs):
        raise AssertionError("the VMEM refusal compiled a program")

    monkeypatch.setattr(jax.stages.Lowered, "compile", no_compile)
    monkeypatch.setattr(jax.stages.Traced, "lower", no_compile)
    with pytest.raises(ConfigError) as err:
        load_config(CELL, ["kernels.gmm.vmem_limit_mib=16"], platform="tpu")
    msg = str(err.value)
    assert "kernels.gmm.vmem_limit_mib" in msg and "wi_fwd (wi_fused_swiglu_fwd) needs 42.50 MiB" in msg, msg
    assert "16.00 MiB limit" in msg and "wo_dlhs (wo_fused_dswiglu_dlhs)" in msg, msg


def test_every_seed_cell_arm_validates_at_load():
    """benchmarks/seed_cell.py's arms (each lever's keys off after it, the programs' arm): every one
    is a config the validator accepts for TPU, so no arm fails at load after the others compiled
    (the MoE lever's off once left the recipe's per-kernel tiles under heuristic tiling)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "seed_cell.py"
    spec = importlib.util.spec_from_file_location("seed_cell", script)
    seed_cell = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed_cell)
    assert seed_cell.RECIPE == CELL
    refused = {}
    for arm in [*seed_cell.ARMS, *seed_cell.PROGRAMS.values()]:
        try:
            load_config(CELL, seed_cell.arm_overrides(arm), platform="tpu")
        except ConfigError as e:
            refused[arm] = str(e)
    assert not refused, refused


def test_seed_wi_forward_tile_against_the_seeds_figure():
    """The seed's wi forward (tm 512, tk 4096, tn 1024 per half, weight depth 2) needs 50.95 MiB of its
    57.60 MiB limit. Blocks and scratch are the same in ours: 50.00 MiB (x 2 x 4 MiB, gate and up weights
    2 x 2 x 8 MiB, h 2 x 1 MiB, preact 2 x 2 MiB, two float32 accumulators 2 x 2 MiB); the rest is what the
    compiler spills in the epilogue: 0.95 MiB in the seed's kernel, 2.75 MiB in ours (the smallest limit
    tpu7x's compiler accepts for our kernel at that tile: 52.75 MiB, benchmarks/records/gmm_vmem.json),
    modelled as silu(gate) in float32 and h in bf16 at [tm, tn]: 3.00 MiB. Both fit the 57.60 MiB."""
    bufs = tiling.tpu_buffers("wi_fused", tm=512, tk=4096, tn=1024, depth=2)
    blocks = sum(b.tpu_bytes for b in bufs if b.kind != "value") / MIB
    need = sum(b.tpu_bytes for b in bufs) / MIB
    assert blocks == 50.0 and 0 < 50.95 - blocks < 1.0
    assert need == 53.0 and 52.75 <= need < 57.6
    # Depth 1 frees one copy of both weight blocks: 2 x 8 MiB.
    assert sum(b.tpu_bytes for b in tiling.tpu_buffers("wi_fused", tm=512, tk=4096, tn=1024, depth=1)) / MIB == 37.0


def test_per_kernel_keys_need_explicit_tiling_and_fused_rules():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["kernels.gmm.wo_dlhs_tk=64"])
    assert "kernels.gmm.wo_dlhs_tk: a per-kernel tile needs kernels.gmm.tiling=explicit" in str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["kernels.gmm.tiling=explicit", "moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true",
                             "kernels.gmm.wo_dlhs_tn=16", "kernels.gmm.wi_fwd_tn=16"])
    msg = str(err.value)
    assert "kernels.gmm.wo_dlhs_tn" in msg and "one N tile" in msg and "kernels.gmm.wi_fwd_tn" in msg, msg


def test_vmem_limit_above_the_core_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["kernels.attention.vmem_limit_mib=129"])
    assert "kernels.attention.vmem_limit_mib" in str(err.value) and "v5e 128" in str(err.value)
    load_config("tiny", ["kernels.attention.vmem_limit_mib=128"])  # a v5e or v6e core holds it


def test_describe_lists_each_kernels_resolved_tiles_and_vmem():
    from hybridmoe.cli import kernel_rows

    cfg = load_config(CELL, [], platform="tpu")
    rows = {r["kernel"]: r for r in kernel_rows(cfg)}
    assert list(rows) == list(tiling.KERNELS)
    assert (rows["wi_fwd"]["pallas"], rows["wi_fwd"]["tk"], rows["wi_fwd"]["tn"]) == ("wi_fused_swiglu_fwd", 4096, 1024)
    assert (rows["wo_dlhs"]["pallas"], rows["wo_dlhs"]["tk"], rows["wo_dlhs"]["tn"]) == ("wo_fused_dswiglu_dlhs", 4096, 1024)
    assert (rows["wi_fwd"]["tm"], rows["wo_dlhs"]["tm"], rows["wo_drhs"]["tm"], rows["wi_drhs"]["tm"]) == (256, 128, 256, 128)  # each its own tm
    assert (rows["wi_dlhs"]["tk"], rows["wo_fwd"]["tk"]) == (2048, 1024)  # the shared tk fitted to 2F and F
    # wi forward at 256 rows: 53.00 MiB at the seed's 512 less 2 x 2 MiB of x, 2 x (0.5 + 1) MiB of h and
    # the pre-activations, 2 x 1 MiB of float32 accumulators, 1.5 MiB of epilogue values.
    assert rows["wi_fwd"]["vmem_mib"] == 42.5 and rows["wi_fwd"]["limit_mib"] == 57.6


def test_triton_flash_blocks_checked_against_shared_memory():
    """At Qwen3.5's head dim 256 the Triton flash kernels at 64 x 64 blocks and 3 stages need more
    than a GPU block's 227 KiB by the model (jax's own GPU kernel defaults, 128 x 128 at 2 stages, more
    still: benchmarks/records/gmm_vmem.json); 32 x 32 fits."""
    base = ["model.head_dim=256", "kernels.attention.backend=pallas_gpu", "model.layer_pattern=[attention]",
            "model.num_layers=1", "model.compute_dtype=bfloat16"]
    with pytest.raises(ConfigError) as err:
        load_config("tiny", base + ["kernels.attention.block_q=64", "kernels.attention.block_k=64"], platform="gpu")
    assert "kernels.attention.block_k" in str(err.value) and "shared memory" in str(err.value), str(err.value)
    load_config("tiny", base + ["kernels.attention.block_q=32", "kernels.attention.block_k=32"], platform="gpu")
    assert attention_limits.gpu_shared_bytes("flash_attention_forward", block_q=128, block_k=128, head_dim=256,
                                             num_stages=2) > 227 * 1024


def test_a_kernel_the_compiler_refuses_is_named_with_its_own_tile_keys():
    # The compiler's refusal (its error text, as Mosaic words it) becomes an error naming the grouped
    # matmul that runs the kernel, its own tile keys as resolved and the model's figure.
    from hybridmoe.tools.train_program import _vmem_refusal

    cfg = load_config(CELL, platform="tpu")
    err = _vmem_refusal(RuntimeError("RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom: ... in\n"
                                     "  %wo_fused_dswiglu_dlhs.3 = bf16[...] custom-call(...)"), cfg)
    msg = str(err)
    assert "wo_fused_dswiglu_dlhs" in msg and "wo_dlhs (wo_fused_dswiglu_dlhs) needs" in msg, msg
    assert "kernels.gmm.wo_dlhs_tk=4096" in msg and "kernels.gmm.wo_dlhs_tn=512" in msg, msg  # tk its own, tn shared
    assert "wi_fwd" not in msg.split("(the compiler refused it)")[1].split("; lower")[0], msg
    # The wi forward runs its own K tile (wi_fwd_tk 4096 beside the shared tk 2048).
    msg = str(_vmem_refusal(RuntimeError("CompileTimeScopedVmemOom\n  %wi_fused_swiglu_fwd = ..."), cfg))
    assert "kernels.gmm.wi_fwd_tk=4096" in msg and "wo_dlhs" not in msg, msg
    assert _vmem_refusal(RuntimeError("some other error"), cfg) is None


def test_auto_limit_asks_for_a_need_past_the_smallest_default():
    from hybridmoe.kernels.vmem import auto_limit_mib, tpu_limit_bytes

    # need x 1.25 + 4 MiB, rounded up to a whole MiB, within v5e's 16 MiB default: the compiler's
    # default (0, no limit asked): 9.6 MiB -> 12 + 4 = 16.
    assert auto_limit_mib(int(9.6 * MIB)) == 0.0 and tpu_limit_bytes(0.0, 9 * MIB) is None
    # Past it: at least tpu7x's 32 (13.28 MiB, flash dk-dv at 2,048 rows, whose compiler wants 16.64:
    # 20.6 -> 21 -> 32); 23.53 MiB (the dk-dv at 4,096 rows, over 32.18 in the compiler) -> 33.4 -> 34.
    assert auto_limit_mib(int(13.28 * MIB)) == 32.0 and auto_limit_mib(int(23.53 * MIB)) == 34.0
    # At most 48 MiB (three quarters of a 64 MiB core): 40 MiB -> 54 -> 48.
    assert auto_limit_mib(40 * MIB) == 48.0
    assert tpu_limit_bytes(0.0, 30 * MIB) == 42 * MIB and tpu_limit_bytes(20.0, 30 * MIB) == 20 * MIB
    assert tpu_limit_bytes(0.0) is None  # a kernel that states no need keeps the compiler's default


def test_fused_forward_copying_its_weight_is_the_models():
    """wi_fused_swiglu_prefetched (not yet a default): its traced blocks and scratch are the model's
    (tiling.tpu_buffers("wi_fused", whole_k=True): x, h and pre-activation blocks, two slots each for
    the gate and up slabs, four DMA semaphores)."""
    from hybridmoe.kernels.gmm import pallas_tpu

    x, wi = jnp.zeros((M, D), jnp.bfloat16), jnp.zeros((E, D, 2 * F), jnp.bfloat16)
    sizes = jnp.full((E,), M // E, jnp.int32)
    (traced,) = traced_kernels(lambda x, wi: pallas_tpu.wi_fused_swiglu(
        x, wi, sizes, group_offset=0, sharded=False, tile_n_per_half=128, mode="float32",
        tiling=tiling.Tiling(tm=64, tk=D, tn=256), interpret=True, grid_pipelined=False), x, wi)
    assert traced == modelled("wi_fused_swiglu_fwd", tiling.tpu_buffers("wi_fused", tm=64, tk=D, tn=128, whole_k=True))


def test_fused_input_gradient_copying_its_weight_is_the_models():
    """wo_fused_dswiglu_dlhs_prefetched (not yet a default): its traced blocks and scratch are the
    model's (tiling.tpu_buffers("wo_fused_dlhs", whole_k=True): wo in two slots, no accumulator)."""
    from hybridmoe.kernels.gmm import pallas_tpu

    g, wo = jnp.zeros((M, D), jnp.bfloat16), jnp.zeros((E, F, D), jnp.bfloat16)
    pre, scale = jnp.zeros((M, 2 * F), jnp.bfloat16), jnp.ones((M,), jnp.float32)
    sizes = jnp.full((E,), M // E, jnp.int32)
    (traced,) = traced_kernels(lambda g, wo: pallas_tpu.wo_fused_dswiglu_dlhs(
        g, wo, sizes, pre, preact_tile_n_per_half=128, row_scale_M=scale, out_tile_n_per_half=128, group_offset=0,
        sharded=False, mode="float32", tiling=tiling.Tiling(tm=64, tk=D, tn=F), interpret=True,
        grid_pipelined=False), g, wo)
    assert traced == modelled("wo_fused_dswiglu_dlhs", tiling.tpu_buffers(
        "wo_fused_dlhs", tm=64, tk=D, tn=F, f=F, row_scale=True, whole_k=True))


def test_auto_cap_check_counts_the_margin():
    """margin_fits_auto_cap: the need with auto's margin (x 1.25 + 4 MiB) within the 48 MiB cap. The
    fused input gradient at 512 rows (D 4096, F 1024) is 43 MiB by the model and refused by the
    compiler under the cap; 256 rows (29.5 MiB) fits; 35.2 MiB is the edge."""
    from hybridmoe.kernels.vmem import AUTO_LIMIT_CAP_MIB, margin_fits_auto_cap, tpu_bytes

    assert AUTO_LIMIT_CAP_MIB == 48.0
    need = lambda tm: tpu_bytes(tiling.tpu_buffers("wo_fused_dlhs", tm=tm, tk=4096, tn=1024, f=1024,  # noqa: E731
                                                        row_scale=True))
    assert need(512) / MIB == 43.0 and not margin_fits_auto_cap(need(512))
    assert need(256) / MIB == 29.5 and margin_fits_auto_cap(need(256))
    assert margin_fits_auto_cap(int(35.2 * MIB)) and not margin_fits_auto_cap(int(35.3 * MIB))
