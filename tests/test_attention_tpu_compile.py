"""The Mosaic TPU flash-attention kernels compile for a real TPU target from this CPU host, the
training step runs them per shard and inside the context-parallel ring, and the compiled step at
the seed cell's mesh geometry holds no score matrix (tests/tpu_target.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from tests.tpu_target import TOPOLOGY, compile_abstract, spec

pytestmark = pytest.mark.tpu_compile


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

    args = (spec((1, T, N, head_dim), jnp.bfloat16, device), spec((1, S, G, head_dim), jnp.bfloat16, device),
            spec((1, S, G, head_dim), jnp.bfloat16, device), spec((1, T), jnp.int32, device),
            spec((1, S), jnp.int32, device), spec((1, T), jnp.int32, device), spec((1, S), jnp.int32, device))

    def loss(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        o = ops.flash_attention(q, k, v, q_pos_BT=q_pos, kv_pos_BS=kv_pos, q_seg_BT=q_seg, kv_seg_BS=kv_seg,
                                scale=head_dim ** -0.5, backend="pallas_tpu", block_q=block_q, block_k=block_k)
        return jnp.sum(o.astype(jnp.float32))

    compiled = compile_abstract(jax.grad(loss, (0, 1, 2)), *args)
    text = compiled.hlo_text
    assert text.count("tpu_custom_call") == 3
    for name in KERNEL_NAMES:
        assert name in text, name
    # No [heads, T, S] buffer: the temporaries stay within twice the float32 dq, dk and dv.
    temp = compiled.memory["temp"]
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
# context x expert, 2 each) at 8 devices and 1,024 tokens, with one-attention-layer blocks (the facts
# are the attention layer's; a GDN layer in the block only added to the compile: the 4-long block
# compiled 75 s here, a GDN + attention block 40 s); the cell itself runs with the slow tests.

GEOMETRY = {
    "blocks": ("tpu7x:2x2x1", ["mesh.fsdp=2", "mesh.context=2", "mesh.expert=2", "train.batch_size=4",
                               "train.seq_len=1024", "model.max_seq_len=1024",
                               "model.layer_pattern=[attention]", "model.num_layers=2"]),
    "cell": ("tpu7x:4x4x8", ["mesh.fsdp=32", "mesh.context=4", "mesh.expert=2", "train.batch_size=64",
                             "train.seq_len=65536", "model.max_seq_len=65536"]),
}
WIDTHS = ["mesh.cpu_devices=0", "mesh.data=1", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
          "model.head_dim=64", "remat.policy=full",
          "model.num_layers=8"]  # two blocks of the pattern: a one-trip layer loop would be inlined


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
    from hybridmoe.analysis.program import _hlo_graph, _hlo_result

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
