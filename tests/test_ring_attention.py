"""Ring context parallelism (kernels/attention/ring.py) on 2, 4 and 8 context ranks of the 8-device
CPU mesh against the single-device reference (kernels/attention/reference.py: the unsharded masked
attention and its gradients in plain numpy-style JAX): values and every gradient (dq, dk, dv),
float32 and bfloat16, packed rows (documents crossing rank edges, padding) and unpacked ones,
natural and load-balanced token order; the merge of partials against the reference lse; the
broken variants (partials merged with swapped weights, the running partial not rescaled, dK/dV
sent home to the wrong rank, dK/dV moved the other way round the ring, a block's ids moved the
other way from its keys) each caught with a 10x margin; the model's ring layer in load-balanced
order (the order dropped is a broken variant it catches); the validator's rule; and the program:
K/V move by collective-permute only (no all-gather), P - 1 blocks of one shard forward, P - 1
again and P float32 dK/dV blocks backward.

Shape letters: B batch, T tokens, N query heads, G kv heads, A head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import packed_batch, tiny_config, tiny_params
from hybridmoe.config.errors import ConfigError
from hybridmoe.kernels.attention import ring
from hybridmoe.kernels.attention.reference import (
    attention_reference,
    attention_reference_grads,
    attention_reference_lse,
)
from hybridmoe.parallel.context import load_balanced_token_index
from hybridmoe.parallel.rules import logical_to_spec
from hybridmoe.run.setup import build
from hybridmoe.analysis import program

B, T, N, G, A = 8, 64, 4, 2, 8
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max |error| / max |expected|, per output


def mesh_cfg(P):
    return tiny_config(f"mesh.context={P}", "mesh.data=1", "gdn.chunk_size=8")


def specs():
    """The model's partition specs of q, k / v and the ids (read under the mesh's rules)."""
    return dict(q_spec=logical_to_spec(("batch", "seq", "heads", None)),
                kv_spec=logical_to_spec(("batch", "seq", "kv_heads", None)), ids_spec=logical_to_spec(("batch", "seq")))


@functools.cache
def make_case(packed: bool, lb: bool, P: int):
    rng = np.random.default_rng(int(packed) * 2 + int(lb))
    q = 3.0 * rng.normal(size=(B, T, N, A))
    k, v, do = rng.normal(size=(B, T, G, A)), rng.normal(size=(B, T, G, A)), rng.normal(size=(B, T, N, A))
    if packed:  # documents of 5, 40, 9, 30 and 3 tokens packed into rows of 64 (across rank edges), padding
        batch = packed_batch(0, B, T, 64, doc_lengths=(5, 40, 9, 30, 3))
        pos, seg = np.asarray(batch["positions"]), np.asarray(batch["segment_ids"])
        do = np.where((seg > 0)[..., None, None], do, 0.0)  # the loss gives padding no cotangent
    else:
        pos, seg = np.broadcast_to(np.arange(T), (B, T)).copy(), np.ones((B, T), np.int64)
    if lb:
        order = load_balanced_token_index(T, P)
        q, k, v, do, pos, seg = (x[:, order] for x in (q, k, v, do, pos, seg))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return dict(q=f32(q), k=f32(k), v=f32(v), do=f32(do), pos=i32(pos), seg=i32(seg), packed=packed)


@functools.cache
def expected(packed, lb, P, dtype=jnp.float32):
    c = make_case(packed, lb, P)
    rnd = lambda x: x.astype(dtype).astype(jnp.float32)  # noqa: E731
    q, k, v, do = (rnd(c[n]) for n in ("q", "k", "v", "do"))
    ids = (c["pos"], c["pos"], c["seg"], c["seg"])
    return (attention_reference(q, k, v, *ids, A ** -0.5),
            *attention_reference_grads(q, k, v, do, *ids, A ** -0.5))


def run_ring(packed, lb, P, dtype=jnp.float32, block_q=8, block_k=8):
    c = make_case(packed, lb, P)
    cfg = mesh_cfg(P)
    axes = ("context",)

    def loss(q, k, v, pos, seg):
        return ring.ring_attention(q, k, v, pos, seg if packed else None, axes=axes, scale=A ** -0.5, **specs(),
                                   backend="xla", block_q=block_q, block_k=block_k)

    @jax.jit
    def go(q, k, v, do, pos, seg):
        o, vjp = jax.vjp(lambda q, k, v: loss(q, k, v, pos, seg), q, k, v)
        return (o, *vjp(do))

    setup = build(cfg)
    with setup.context():
        return go(*(c[n].astype(dtype) for n in ("q", "k", "v", "do")), c["pos"], c["seg"])


def errors(actual, wanted):
    out = {}
    for name, a, e in zip(("o", "dq", "dk", "dv"), actual, wanted):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert np.isfinite(a).all(), name
        out[name] = float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-30))
    return out


_CLEAN = {}


def clean_errors(packed, lb, P):
    key = (packed, lb, P)
    if key not in _CLEAN:
        _CLEAN[key] = errors(run_ring(packed, lb, P), expected(packed, lb, P))
    return _CLEAN[key]


CASES = [(2, True, False), (4, True, True), (8, False, True), pytest.param(2, False, True, marks=pytest.mark.slow),
         pytest.param(4, False, False, marks=pytest.mark.slow), pytest.param(8, True, False, marks=pytest.mark.slow)]


@pytest.mark.parametrize("P, packed, lb", CASES)
def test_ring_equals_the_reference_float32(P, packed, lb):
    errs = clean_errors(packed, lb, P)
    assert max(errs.values()) < TOLERANCE[jnp.float32], errs


def test_ring_bfloat16_inputs_meet_the_tolerance():
    """bf16 q, k, v, do on 4 ranks, load-balanced packed rows, against the float32 oracle on the
    same rounded values; o and the gradients come back in bf16."""
    out = run_ring(True, True, 4, jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in out)
    errs = errors(out, expected(True, True, 4, jnp.bfloat16))
    assert max(errs.values()) < TOLERANCE[jnp.bfloat16], errs


def test_merge_of_partials_gives_the_reference_lse():
    """Keys split in 4 sets (as 4 ranks hold them), each set's (o, lse) merged in ring order: the
    merged lse equals the reference's over all keys (-inf where no key is visible)."""
    from hybridmoe.kernels.attention import ops

    c = make_case(True, True, 4)
    ids = dict(q_pos=c["pos"], q_seg=c["seg"], scale=A ** -0.5, backend="xla", block_q=8, block_k=8)
    o = jnp.zeros(c["q"].shape, jnp.float32)
    lse = jnp.full((B, N, T), -jnp.inf)
    for r in range(4):
        sl = slice(r * 16, (r + 1) * 16)
        o_s, lse_s = ops.attention_fwd(c["q"], c["k"][:, sl], c["v"][:, sl], kv_pos=c["pos"][:, sl],
                                       kv_seg=c["seg"][:, sl], **ids)
        o, lse = ring.merge_partials(o, lse, o_s, lse_s)
    want = attention_reference_lse(c["q"], c["k"], c["pos"], c["pos"], c["seg"], c["seg"], A ** -0.5)
    lse = np.asarray(lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want))
    finite = np.isfinite(want)
    assert np.abs(lse[finite] - want[finite]).max() < 1e-5 * np.abs(want[finite]).max()
    assert errors([o], expected(True, True, 4)[:1])["o"] < TOLERANCE[jnp.float32]


# ---------------------------------------------------------------------------------------------
# Broken variants, patched into ring.py


_MERGE = ring.merge_partials
_HOME = ring.send_home


def _merge_in_wrong_order(o_acc, lse_acc, o_s, lse_s):
    # Each partial weighted by the other's log-sum-exp (the merge's operands out of order).
    return _MERGE(o_s, lse_acc, o_acc, lse_s)


def _merge_without_rescale(o_acc, lse_acc, o_s, lse_s):
    # The partial summed so far kept at weight 1 when the new block moves the log-sum-exp.
    lse = jnp.logaddexp(lse_acc, lse_s)
    w_s = jnp.moveaxis(jnp.exp(lse_s - jnp.where(jnp.isneginf(lse), 0.0, lse)), 1, 2)[..., None]
    return o_acc + o_s.astype(jnp.float32) * w_s, lse


def _home_one_rank_off(dkv, axes, P):
    return _HOME(_HOME(dkv, axes, P), axes, P)


def _back(tree, axes, P):
    perm = [(r, (r - 1) % P) for r in range(P)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axes, perm), tree)


def _dkv_the_other_way(block, axes, P):
    # The float32 accumulators (dK/dV, at the inputs' float32) travel r -> r - 1, K/V and ids r -> r + 1.
    is_dkv = isinstance(block, tuple) and len(block) == 2
    return (_back if is_dkv else _NEXT)(block, axes, P)


def _ids_the_other_way(block, axes, P):
    # A block's positions and segment ids (int32) go r -> r - 1 while its keys and values go r -> r + 1.
    moved = _NEXT(block, axes, P)
    if isinstance(block, tuple) and len(block) > 2:
        back = _back(block[2:], axes, P)
        moved = (*moved[:2], *back)
    return moved


_NEXT = ring._next

RING_BROKEN = {
    "partials_merged_with_swapped_weights": ("merge_partials", _merge_in_wrong_order),
    "running_partial_not_rescaled": ("merge_partials", _merge_without_rescale),
    "dkv_sent_home_to_the_wrong_rank": ("send_home", _home_one_rank_off),
    "dkv_moved_the_other_way_round": ("_next", _dkv_the_other_way),
    "ids_moved_the_other_way_from_their_keys": ("_next", _ids_the_other_way),
}


@pytest.mark.parametrize("variant", sorted(RING_BROKEN))
def test_broken_ring_variant_is_caught(variant, monkeypatch):
    case = (True, True, 4)
    clean = max(clean_errors(*case).values())
    attribute, broken = RING_BROKEN[variant]
    monkeypatch.setattr(ring, attribute, broken)
    broken_errors = errors(run_ring(*case), expected(*case))
    worst = max(broken_errors.values())
    print(f"{variant}: clean max error {clean:.2e}, broken {worst:.2e} ({broken_errors})")
    assert worst >= 10 * clean and worst >= 10 * TOLERANCE[jnp.float32], (variant, clean, broken_errors)


# ---------------------------------------------------------------------------------------------
# Program and validator


def _executions(colls):
    """{(kind, dtype, shape): executions} (an op in a loop runs its trip count times)."""
    out: dict = {}
    for c in colls:
        key = (c.kind, c.dtype, c.shape)
        out[key] = out.get(key, 0) + (c.trip_count or 1 if c.in_loop else 1)
    return out


def test_ring_moves_kv_by_permutes_of_one_shard():
    """4 ranks, packed rows, forward and backward compiled: the only collectives are
    collective-permutes of one rank's shard: K and V [b, t, G, A] and their ids [b, t] 2 (P - 1)
    times (P - 1 forward, P - 1 again backward), the float32 dK and dV P times (the last one home);
    no all-gather or reduce-scatter."""
    P = 4
    c = make_case(True, False, P)

    def loss(q, k, v, pos, seg, do):
        o = ring.ring_attention(q, k, v, pos, seg, axes=("context",), scale=0.3, **specs(), backend="xla",
                                block_q=8, block_k=8)
        return jnp.sum(o * do)

    setup = build(mesh_cfg(P))
    with setup.context():
        prog = program.analyze(jax.jit(jax.grad(loss, (0, 1, 2))), c["q"], c["k"], c["v"], c["pos"], c["seg"],
                               c["do"])
    b, t = B // 2, T // P  # the batch split over the 2 fsdp devices
    want = {("collective-permute", "f32", (b, t, G, A)): 2 * 2 * (P - 1) + 2 * P,
            ("collective-permute", "s32", (b, t)): 2 * 2 * (P - 1)}
    assert _executions(prog.compiled_collectives) == want, prog.compiled_collectives


def test_ring_layer_runs_in_load_balanced_order(monkeypatch):
    """The model's attention layer with attention.cp_impl=ring and cp_load_balance on 4 ranks hands
    the ring each rank's half-chunks r and 2P-1-r (positions as the ring sees them), so every rank
    has the same causal work; with the reordering dropped (a broken variant: the values stay right,
    the balance is lost) the check fails."""
    from hybridmoe.model import attention as attn_model
    from hybridmoe.parallel import context

    P, Tm = 4, 64
    cfg = tiny_config(f"mesh.context={P}", "mesh.data=1", "attention.cp_impl=ring", "attention.cp_load_balance=true",
                      "model.layer_pattern=[attention]", "model.num_layers=1")
    params = tiny_params(cfg)
    kinds = cfg.model.layer_pattern
    p = jax.tree.map(lambda a: a[0], params["blocks"][kinds.index("attention")]["mixer"])
    x = jax.random.normal(jax.random.key(0), (2, Tm, cfg.model.d_model))
    natural = jnp.broadcast_to(jnp.arange(Tm, dtype=jnp.int32), (2, Tm))
    seen = []

    def recording(q, k, v, positions_BT, *args, **kw):  # what the ring is given (its own work is tested above)
        jax.debug.callback(lambda pos: seen.append(np.asarray(pos)), positions_BT)
        return jnp.zeros_like(q)

    monkeypatch.setattr(attn_model, "ring_attention", recording)

    def positions_seen():
        seen.clear()
        layer = jax.jit(lambda p, x, pos: attn_model.attention_layer(p, x, pos, jnp.ones_like(pos), cfg.model,
                                                                     cfg.attention, kernels=cfg.kernels))
        with build(cfg).context():
            jax.block_until_ready(layer(p, x, natural))
        jax.effects_barrier()
        assert len(seen) == 1 and seen[0].shape == (2, Tm), [a.shape for a in seen]
        return seen[0][0]

    def causal_work(pos):  # unmasked (query, key) pairs per rank: its queries against every key
        return [int((pos[r * Tm // P:(r + 1) * Tm // P, None] >= pos[None, :]).sum()) for r in range(P)]

    want = np.asarray(context.load_balanced_token_index(Tm, P))
    got = positions_seen()
    assert np.array_equal(got, want), got
    assert len(set(causal_work(got))) == 1, causal_work(got)
    # Broken variant: the layer's reordering dropped (natural order reaches the ring).
    monkeypatch.setattr(context, "reorder", lambda a, axes, *, inverse=False: a)
    broken = positions_seen()
    work = causal_work(broken)
    print(f"load-balanced order dropped: positions {broken[:8]}..., causal work per rank {work}")
    assert not np.array_equal(broken, want) and len(set(work)) > 1, work


def test_ring_needs_a_context_axis():
    with pytest.raises(ConfigError) as e:
        tiny_config("attention.cp_impl=ring", "mesh.context=1")
    problems = dict(e.value.problems)
    assert "mesh.context > 1" in problems["attention.cp_impl"], problems
    with pytest.raises(ConfigError) as e:
        tiny_config("attention.cp_impl=ring", "mesh.context=2", "mesh.data=1", "gdn.chunk_size=8",
                    "kernels.attention.backend=blocked", "kernels.attention.block_k=64")
    problems = dict(e.value.problems)
    assert "flash attention core" in problems["attention.cp_impl"], problems
    with pytest.raises(ConfigError) as e:
        tiny_config("attention.cp_impl=ring", "mesh.context=2", "mesh.data=1", "gdn.chunk_size=8",
                    "kernels.attention.block_k=64")
    msg = dict(e.value.problems)["kernels.attention.block_k"]
    assert "does not divide the 32 keys of a ring step" in msg and "kernels.attention.block_k=32" in msg, msg
