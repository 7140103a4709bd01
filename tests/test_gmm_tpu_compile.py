"""The Mosaic TPU grouped-matmul kernels compile for a real TPU target from this CPU host.

`jax.experimental.topologies.get_topology_desc(..., platform="tpu")` gives compile-only devices
(libtpu comes with the test extra, `jax[tpu]` at the pinned JAX version); `.lower(...).compile()`
then runs the real Mosaic compiler, so layout, tiling and VMEM errors surface here. libtpu lets
one process per host hold it, so every test that compiles for a TPU target lives in this file
(xdist's loadfile keeps a file on one worker).
"""

from __future__ import annotations

import collections
import functools
import importlib.util

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.kernels import gmm as K
from hybridmoe.kernels.gmm.tiling import Tiling

pytestmark = pytest.mark.tpu_compile

TOPOLOGY = "tpu7x:2x2x1"
M, D, F, E, TN = 512, 256, 256, 4, 128
TILING = Tiling(tm=128, tk=128, tn=128)


@pytest.fixture(scope="module")
def device():
    if importlib.util.find_spec("libtpu") is None:
        pytest.fail(f"libtpu is not installed: pip install -e '.[test]' (jax[tpu]=={jax.__version__})")
    from hybridmoe.tools.train_program import tpu_target

    return tpu_target(TOPOLOGY).devices[0]


def _spec(shape, dtype, dev):
    from jax.sharding import SingleDeviceSharding

    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile()


@pytest.mark.parametrize("transpose", [False, True])
def test_gmm_compiles(device, transpose):
    x = _spec((M, D), jnp.bfloat16, device)
    w = _spec((E, F, D) if transpose else (E, D, F), jnp.bfloat16, device)
    gs = _spec((E,), jnp.int32, device)

    def loss(x, w, gs):
        y = K.gmm(x, w, gs, transpose_rhs=transpose, backend="pallas_tpu", tiling=TILING)
        return jnp.sum(y.astype(jnp.float32))

    _compile(jax.grad(loss, (0, 1)), x, w, gs)  # gmm, gmm_t and tgmm


@pytest.mark.parametrize("depth", [0, 2])
def test_fused_pair_compiles(device, depth):
    x = _spec((M, D), jnp.bfloat16, device)
    wi = _spec((E, D, 2 * F), jnp.bfloat16, device)
    wo = _spec((E, F, D), jnp.bfloat16, device)
    s = _spec((M,), jnp.float32, device)
    gs = _spec((E,), jnp.int32, device)
    # One K tile (tk = D) so the weight depth applies.
    tiling = Tiling(tm=128, tk=D, tn=128, rhs_buffer_count=depth)

    def loss(x, wi, wo, s, gs):
        h, pre = K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=TN,
                              backend="pallas_tpu", tiling=tiling,
                              rhs_buffer_count=depth)
        y = K.wo_fused_dswiglu(h, wo, gs, preact=pre, preact_tile_n_per_half=TN, row_scale=s,
                          backend="pallas_tpu", tiling=tiling)
        return jnp.sum(y.astype(jnp.float32))

    compiled = _compile(jax.grad(loss, (0, 1, 2, 3)), x, wi, wo, s, gs)
    text = compiled.as_text()
    assert "wi_fused_swiglu_fwd" in text and "wo_fused_dswiglu_dlhs" in text
    assert ("wi_fused_swiglu_fwd_rhsbuf2" in text) == (depth == 2)


def test_vmem_overflow_is_caught(device):
    """The upstream tile at the compiler's default scoped limit (32 MiB) overflows VMEM: the
    compile-only target does catch on-chip memory errors (figures: benchmarks/records/gmm_vmem.json)."""
    x = _spec((1024, 4096), jnp.bfloat16, device)
    wi = _spec((2, 4096, 4096), jnp.bfloat16, device)
    gs = _spec((2,), jnp.int32, device)
    tiling = Tiling(tm=512, tk=4096, tn=1024)

    def fwd(x, wi, gs):
        return K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=1024,
                            backend="pallas_tpu", tiling=tiling)

    with pytest.raises(Exception, match="(?i)vmem"):
        _compile(fwd, x, wi, gs)
    roomy = Tiling(tm=512, tk=4096, tn=1024, vmem_limit_mib=57.6)
    _compile(lambda x, wi, gs: K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=1024,
                                            backend="pallas_tpu", tiling=roomy), x, wi, gs)


# The weight depth decides the fit (benchmarks/records/gmm_vmem.json): at this tile Mosaic's default
# (2 buffers in JAX 0.10.2) needs more than the 57.6 MiB scoped limit, one buffer fits.
DECIDING = dict(tm=256, tk=4096, tn=2048)


def _fused_forward(device, depth, tm, tk, tn, limit_mib=57.6):
    x = _spec((1024, tk), jnp.bfloat16, device)
    wi = _spec((2, tk, 2 * tn), jnp.bfloat16, device)  # one N tile per half
    gs = _spec((2,), jnp.int32, device)
    tiling = Tiling(tm=tm, tk=tk, tn=tn, vmem_limit_mib=limit_mib)
    return _compile(lambda x, wi, gs: K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=tn,
                                                   backend="pallas_tpu", tiling=tiling,
                                                   rhs_buffer_count=depth), x, wi, gs)


def test_wi_fwd_rhs_buffer_count_decides_the_fit(device):
    with pytest.raises(Exception, match="(?i)vmem"):
        _fused_forward(device, 0, **DECIDING)
    with pytest.raises(Exception, match="(?i)vmem"):
        _fused_forward(device, 2, **DECIDING)
    assert "wi_fused_swiglu_fwd_rhsbuf1" in _fused_forward(device, 1, **DECIDING).as_text()


def test_inspect_compiles_the_training_step_for_a_tpu_target(device):
    """`hybridmoe inspect --target tpu7x:2x2x1`'s path: the validator accepts the Pallas TPU
    kernels for a TPU target, the whole training step (fused levers on Mosaic kernels) compiles
    for the topology's 8 devices, and the memory facts come against the v7x's 96 GiB per device."""
    from hybridmoe.tools import train_program as tp
    from hybridmoe.recipe import load_config

    cfg = load_config("tiny", ["mesh.cpu_devices=0", "model.d_model=128", "model.moe_intermediate_size=128",
                               "kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=explicit",
                               "moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true"], platform="tpu")
    facts = tp.step_facts(tp.compile_step(cfg, tp.tpu_target(TOPOLOGY), with_residuals=False))
    mem = facts["memory"]
    assert facts["devices"] == 8 and mem["hbm"] == 96 * 2**30 and mem["fits"] is True
    assert 0 < mem["argument"] < mem["total"] and facts["flops"] > 0
    assert any(r["kind"] == "all-gather" for r in facts["collectives"])


def _gdn_pallas_grad(device, chunk_size, key_dim, value_dim):
    from hybridmoe.kernels.gdn import gated_delta_rule

    tokens, heads = 4 * chunk_size, 2
    args = (_spec((1, tokens, 1, key_dim), jnp.bfloat16, device), _spec((1, tokens, 1, key_dim), jnp.bfloat16, device),
            _spec((1, tokens, heads, value_dim), jnp.bfloat16, device), _spec((1, tokens, heads), jnp.float32, device),
            _spec((1, tokens, heads), jnp.float32, device), _spec((1, tokens), jnp.int32, device))

    def loss(q, k, v, g, beta, segment_ids):
        o, final = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=chunk_size,
                                    backend="pallas_tpu")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    return _compile(jax.grad(loss, (0, 1, 2, 3, 4)), *args)


@pytest.mark.parametrize("chunk_size, key_dim, value_dim", [(64, 128, 128), (16, 16, 8), (2, 16, 8)])
def test_gdn_pallas_core_compiles(device, chunk_size, key_dim, value_dim):
    """The Pallas GDN core's forward and backward kernels lower through Mosaic (packed rows, bf16
    inputs): Qwen3.5's head dims at chunk 64, the small dims the CPU tests run, and the smallest
    chunk the validator lets through on TPU."""
    compiled = _gdn_pallas_grad(device, chunk_size, key_dim, value_dim)
    assert compiled.as_text().count("tpu_custom_call") == 2  # the forward and the backward kernel


def test_gdn_pallas_core_chunk_one_is_refused_by_mosaic(device):
    """Why the validator asks for gdn.chunk_size >= 2 with pallas_tpu."""
    with pytest.raises(Exception, match="dot_dimension_numbers"):
        _gdn_pallas_grad(device, 1, 16, 8)


def test_gdn_pallas_training_step_runs_the_kernels_per_shard(device):
    """The training step (one GDN layer, rows over data x fsdp, heads over tensor) compiled for the
    topology's 8 devices: with kernels.gdn.backend=pallas_tpu it holds the forward and backward GDN
    kernels and exactly the collectives of the xla backend (place, kind, dtype, count, bytes), so
    no operand of the kernels is gathered: they run per shard."""
    from hybridmoe.tools import train_program as tp
    from hybridmoe.recipe import load_config
    from hybridmoe.kernels.gdn.pallas_chunk import KERNEL_NAMES

    steps = {}
    for backend in ("xla", "pallas_tpu"):
        cfg = load_config("tiny", ["mesh.cpu_devices=0", "mesh.tensor=2", "model.layer_pattern=[gdn]",
                                   "model.num_layers=1", f"kernels.gdn.backend={backend}"], platform="tpu")
        steps[backend] = tp.compile_step(cfg, tp.tpu_target(TOPOLOGY), with_residuals=False)
    text = steps["pallas_tpu"].program.compiled_text
    assert all(name in text for name in KERNEL_NAMES.values())
    assert not any(name in steps["xla"].program.compiled_text for name in KERNEL_NAMES.values())
    collectives = {b: tp.collective_rows(s.program.compiled_collectives) for b, s in steps.items()}
    assert collectives["pallas_tpu"] == collectives["xla"], collectives


@pytest.mark.parametrize("T, S, N, G, head_dim, block_q, block_k", [
    (256, 256, 4, 2, 128, 128, 128),  # self-attention, two query heads per kv head
    # Qwen3.5-397B's heads (16 per kv head, dim 256) at pallas_tpu's default blocks (kernels/attention/limits.py),
    # a query block against more keys.
    (256, 1024, 32, 2, 256, 128, 512),
    # the seed cell's 16,384 local queries against all 65,536 keys of the row (all-gather CP): 35 s to compile
    # under load, its temporaries 0.77 GiB where the masked core's float32 scores alone would be 128 GiB.
    pytest.param(16384, 65536, 32, 2, 256, 128, 512, marks=pytest.mark.slow),
])
def test_flash_attention_pallas_kernels_compile(device, T, S, N, G, head_dim, block_q, block_k):
    """The flash attention forward, dq and dk/dv kernels (kernels/attention/pallas_tpu.py) lower through
    Mosaic for tpu7x: packed ids, bf16 inputs, the block schedule by scalar prefetch."""
    from hybridmoe.kernels.attention import ops
    from hybridmoe.kernels.attention.pallas_tpu import KERNEL_NAMES

    args = (_spec((1, T, N, head_dim), jnp.bfloat16, device), _spec((1, S, G, head_dim), jnp.bfloat16, device),
            _spec((1, S, G, head_dim), jnp.bfloat16, device), _spec((1, T), jnp.int32, device),
            _spec((1, S), jnp.int32, device), _spec((1, T), jnp.int32, device), _spec((1, S), jnp.int32, device))

    def loss(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        o = ops.flash_attention(q, k, v, q_pos_BT=q_pos, kv_pos_BS=kv_pos, q_seg_BT=q_seg, kv_seg_BS=kv_seg,
                                scale=head_dim ** -0.5, backend="pallas_tpu", block_q=block_q, block_k=block_k)
        return jnp.sum(o.astype(jnp.float32))

    compiled = _compile(jax.grad(loss, (0, 1, 2)), *args)
    text = compiled.as_text()
    assert text.count("tpu_custom_call") == 3
    for name in KERNEL_NAMES:
        assert name in text, name
    # No [heads, T, S] buffer: the temporaries stay within twice the float32 dq, dk and dv.
    temp = compiled.memory_analysis().temp_size_in_bytes
    grads = 4 * (T * N + 2 * S * G) * head_dim
    assert temp < 2 * grads, (temp, grads)


def test_flash_attention_training_step_runs_the_kernels_per_shard(device):
    """The training step of a one-attention-layer model (rows over data x fsdp, heads over tensor,
    no context parallelism) compiled for the topology's 8 devices with the default
    kernels.attention.backend (auto: pallas_tpu on a TPU target): a Mosaic call cannot be
    partitioned, so outside a shard_map it would not compile. It holds the three kernels and
    exactly the collectives of the blocked core's step (plain einsums GSPMD splits), so no operand
    of the kernels is gathered: they run per shard."""
    from hybridmoe.kernels.attention.pallas_tpu import KERNEL_NAMES
    from hybridmoe.recipe import load_config
    from hybridmoe.tools import train_program as tp

    steps = {}
    for backend in ("auto", "blocked"):
        cfg = load_config("tiny", ["mesh.cpu_devices=0", "mesh.tensor=2", "model.layer_pattern=[attention]",
                                   "model.num_layers=1", "model.head_dim=128", f"kernels.attention.backend={backend}"], platform="tpu")
        steps[backend] = tp.compile_step(cfg, tp.tpu_target(TOPOLOGY), with_residuals=False)
    text = steps["auto"].program.compiled_text
    assert all(name in text for name in KERNEL_NAMES), [n for n in KERNEL_NAMES if n not in text]
    assert not any(name in steps["blocked"].program.compiled_text for name in KERNEL_NAMES)
    collectives = {b: tp.collective_rows(s.program.compiled_collectives) for b, s in steps.items()}
    assert collectives["auto"] == collectives["blocked"], collectives


def test_flash_attention_ring_step_compiles_for_tpu(device):
    """attention.cp_impl=ring on the Mosaic kernels (context 2, load-balanced, heads over tensor 2):
    the training step compiles for the topology's 8 devices with the three kernels inside the ring's
    shard_map, and K/V reach the other rank by collective-permute, never by an all-gather of the
    [b, T, G, A] keys."""
    from hybridmoe.kernels.attention.pallas_tpu import KERNEL_NAMES
    from hybridmoe.recipe import load_config
    from hybridmoe.tools import train_program as tp

    cfg = load_config("tiny", ["mesh.cpu_devices=0", "mesh.tensor=2", "mesh.context=2", "mesh.data=1",
                               "model.layer_pattern=[attention]", "model.num_layers=1", "model.head_dim=128",
                               "attention.cp_load_balance=true", "attention.cp_impl=ring", "model.d_model=128"], platform="tpu")
    step = tp.compile_step(cfg, tp.tpu_target(TOPOLOGY), with_residuals=False)
    text = step.program.compiled_text
    assert all(name in text for name in KERNEL_NAMES), [n for n in KERNEL_NAMES if n not in text]
    m = cfg.model
    T = cfg.train.seq_len  # K/V (and dK/dV) blocks [b, t or T, G / tensor, A] (not the [1, D, G, A] weights)
    kv = [c for c in step.program.compiled_collectives if len(c.shape) == 4 and c.shape[1] in (T // 2, T)
          and c.shape[-2:] == (m.num_kv_heads // 2, m.head_dim)]
    assert kv and {c.kind for c in kv} == {"collective-permute"}, kv


# ---------------------------------------------------------------------------------------------
# The seed's cell: 256 devices of tpu7x:4x4x8 as fsdp 32 x context 4 x expert 2, one 65,536-token
# sequence per context group (16,384 local queries), at tiny widths (the program's structure, not
# its size: the recipe qwen3.5-397b-a17b-v7x-128 has the same mesh and lengths). Its compile takes
# ~15 CPU minutes here, so the default suite checks the same facts on the same mesh axes (fsdp x
# context x expert, 2 each) at 8 devices and 1,024 tokens; the cell itself runs with the slow tests.

GEOMETRY = {
    "blocks": ("tpu7x:2x2x1", ["mesh.fsdp=2", "mesh.context=2", "mesh.expert=2", "train.batch_size=4",
                               "train.seq_len=1024", "model.max_seq_len=1024"]),
    "cell": ("tpu7x:4x4x8", ["mesh.fsdp=32", "mesh.context=4", "mesh.expert=2", "train.batch_size=64",
                             "train.seq_len=65536", "model.max_seq_len=65536"]),
}
WIDTHS = ["mesh.cpu_devices=0", "mesh.data=1", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
          "model.head_dim=64", "remat.policy=full",
          "model.num_layers=8"]  # two blocks of the 4-long pattern: a one-trip layer loop would be inlined


@functools.cache
def _geometry_step(name: str):
    from hybridmoe.recipe import load_config
    from hybridmoe.tools import train_program as tp

    topology, mesh = GEOMETRY[name]
    cfg = load_config("tiny", WIDTHS + mesh, platform="tpu")
    return cfg, tp.compile_step(cfg, tp.tpu_target(topology), with_residuals=False)


@pytest.fixture(scope="module", params=["blocks", pytest.param("cell", marks=pytest.mark.slow)])
def geometry_step(request, device):
    return _geometry_step(request.param)


def test_step_holds_no_score_matrix(geometry_step):
    """No buffer of the compiled TPU step has two dimensions as long as the local queries (at the
    cell 16,384 against 65,536 keys): the attention core never materialises [heads, T, S] (nor T x T)."""
    from hybridmoe.tools.program import _hlo_graph, _hlo_result

    cfg, step = geometry_step
    local = cfg.train.seq_len // cfg.mesh.context
    assert local > max(cfg.model.d_model, cfg.model.vocab_size)  # no weight has two such dimensions
    comps, _, _ = _hlo_graph(step.program.compiled_text)
    long_dims = {(name, shape) for ops in comps.values() for _, type_text, name, _ in ops
                 for shape in [_hlo_result(type_text)[1]] if sum(d >= local for d in shape) >= 2}
    assert not long_dims, sorted(long_dims)[:5]


def test_query_kernel_is_gathered_once_per_layer_iteration(device):
    """The seed's query_proj_kernel_gather_once exists because its backward gathered the query
    kernel [D, heads, 2 x head_dim] twice (the replay of q = x wq and dx = dq wq^T). Here the weight
    is gathered where it is used, inside the rematerialised block, so the replay's gather serves dx:
    each layer loop (forward, backward) all-gathers that kernel once per iteration.

    At the blocks geometry only: at the cell (D = 256 over 128 shards) the compiler moves these
    small weights by all-reduces combined with their gradients' reductions, where a gather cannot
    be told from a gradient by its shape."""
    cfg, step = _geometry_step("blocks")
    m = cfg.model
    wq = (m.d_model, m.num_heads, 2 * m.head_dim)
    per_loop: dict = {}
    gathers = [c for c in step.program.compiled_collectives if c.kind == "all-gather"]
    for c in gathers:
        # The compiler combines collectives into tuple results: the kernel may be any element, and
        # carry the layer stack's unit dimension of the slice it was gathered from.
        n = sum(s in (wq, (1, *wq)) for s in c.shapes)
        if n:
            per_loop[c.loop] = per_loop.get(c.loop, 0) + n
    seen = sorted({(c.loop, c.shapes) for c in gathers}, key=str)
    assert None not in per_loop, ("the query kernel is gathered outside the layer loops", per_loop, seen)
    assert len(per_loop) == 2 and set(per_loop.values()) == {1}, (per_loop, seen)


def test_grouped_matmul_auto_is_the_traced_programs_platforms(device):
    """kernels.gmm.xla_impl=auto decides by the platform of the program being traced, not this host's:
    under a mesh of compile-only TPU devices it is ragged_dot (row tiles there gathered a weight copy
    per tile: 44 GiB a layer at the 397B cell), on the host's CPU devices row tiles."""
    import numpy as np
    from jax.sharding import Mesh

    from hybridmoe.kernels.gmm.ops import xla_impl_for
    from hybridmoe.tools.train_program import tpu_target

    with jax.set_mesh(Mesh(np.asarray(tpu_target(TOPOLOGY).devices), ("x",))):
        assert xla_impl_for("auto") == "ragged_dot"
    with jax.set_mesh(Mesh(np.asarray(jax.devices()), ("x",))):
        assert xla_impl_for("auto") == "row_tiles"


@pytest.mark.parametrize("num_local, offset", [(512, 0), (256, 256)])
def test_xla_grouped_matmul_over_more_groups_than_tpu_ragged_dot_takes(device, num_local, offset):
    """The pinned libtpu refuses jax.lax.ragged_dot over more than 256 groups; the xla backend
    runs Qwen3.5-397B's 512 experts (all local, and 256 local of 512 with the zero group) in
    chunks that compile, forward and both gradients (and the default path's ragged_dot)."""
    import numpy as np
    from jax.sharding import Mesh

    from hybridmoe.kernels.gmm import xla

    E = 512
    x, w, gs = _spec((1024, 256), jnp.bfloat16, device), _spec((num_local, 256, 128), jnp.bfloat16, device), \
        _spec((E,), jnp.int32, device)

    def loss(x, w, gs):
        y = K.gmm(x, w, gs, group_offset=offset) if offset or num_local < E else K.ragged_dot(x, w, gs)
        return jnp.sum(y.astype(jnp.float32))

    with jax.set_mesh(Mesh(np.asarray([device]), ("x",))):
        assert len(xla.ragged_group_chunks(num_local, num_local < E)) == 3 - (num_local < E)
        _compile(jax.grad(loss, (0, 1)), x, w, gs)


# ---------------------------------------------------------------------------------------------
# The on-chip memory model (kernels/vmem.py) against the compiler: every Mosaic kernel alone, at tiles
# on both sides of a small scoped limit (tests/vmem_sweep.py), compiles exactly where the model says it
# fits. About a minute of compile in all.

from tests import vmem_sweep  # noqa: E402
from tests.broken_variants import BROKEN_VMEM_MODEL  # noqa: E402


@functools.cache
def _compiler_verdict(kernel, tiles):
    from hybridmoe.tools.train_program import tpu_target

    return vmem_sweep.compile_verdict(kernel, tiles, vmem_sweep.LIMIT_MIB, tpu_target(TOPOLOGY).devices[0])


@pytest.mark.parametrize("kernel, tiles", vmem_sweep.POINTS, ids=[f"{k}-{t}" for k, t in vmem_sweep.POINTS])
def test_vmem_model_verdict_equals_the_compilers(device, kernel, tiles):
    ok, error = _compiler_verdict(kernel, tiles)
    need = vmem_sweep.model_bytes(kernel, tiles) / 2**20
    assert ok == vmem_sweep.model_verdict(kernel, tiles, vmem_sweep.LIMIT_MIB), (
        f"{kernel} at {tiles}: model {need:.3f} MiB against {vmem_sweep.LIMIT_MIB} MiB; compiler: {error or 'fits'}")


def test_vmem_sweep_covers_both_sides_for_every_kernel():
    verdicts = collections.defaultdict(set)
    for kernel, tiles in vmem_sweep.POINTS:
        verdicts[kernel].add(vmem_sweep.model_verdict(kernel, tiles, vmem_sweep.LIMIT_MIB))
    assert set(verdicts) == {*vmem_sweep.tiling.PALLAS_NAMES, *vmem_sweep.attention_limits.KERNELS,
                             *vmem_sweep.gdn_limits.KERNELS}
    assert all(v == {True, False} for v in verdicts.values()), dict(verdicts)


@pytest.mark.parametrize("variant", sorted(BROKEN_VMEM_MODEL))
def test_broken_vmem_model_disagrees_with_the_compiler(device, monkeypatch, variant):
    for target, name, broken in BROKEN_VMEM_MODEL[variant]():
        monkeypatch.setattr(target, name, broken)
    wrong = [(k, t) for k, t in vmem_sweep.POINTS
             if _compiler_verdict(k, t)[0] != vmem_sweep.model_verdict(k, t, vmem_sweep.LIMIT_MIB)]
    assert wrong, variant
