"""Flash attention (kernels/attention/ops.py) against the reference: values and every gradient for
each backend (xla; pallas_tpu and pallas_gpu interpreted on CPU; pallas_gpu also lowered to
Triton), float32 and bfloat16, GQA and MHA, packed rows (a document starting exactly on a block edge, one starting inside a block,
padding) and unpacked ones, natural and load-balanced token order, queries against another rank's
keys (T != S); the ring's primitives (lse exact, gradients summed over key sets); rows with no
visible key; the broken variants of the shared block math each caught with a 10x margin; bad block
sizes; and the program fact that the xla backend holds no [T, S]-sized buffer.

Shape letters: B batch, T query tokens, S key tokens, N query heads, G kv heads, A head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.kernels.attention import flash_block as fb
from hybridmoe.kernels.attention import ops
from hybridmoe.kernels.attention.reference import (
    attention_reference,
    attention_reference_grads,
    attention_reference_lse,
)

A = 8  # head dim
L = 64  # tokens per row
BLOCK = 16
# Row 0: documents of 10, 22 and 18 tokens (the third starts exactly on the block edge 32, the
# second inside block 0), then 14 padding tokens (segment 0, position 0). Row 1: 6 and 58 tokens
# (key block 0 holds the end of one and the start of the other, every key of it at or before the
# queries of block 1: what a too-lax no-mask test would take as fully visible).
DOCS = ([10, 22, 18], [6, 58])
# Load-balanced order for 4 ranks (parallel/context.py): 8 half-chunks, rank r holds r and 7 - r.
LOAD_BALANCED = np.concatenate([np.arange(c * 8, c * 8 + 8) for c in (0, 7, 1, 6, 2, 5, 3, 4)])
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max |error| / max |expected|, per output
NAMES = ("o", "dq", "dk", "dv")


def _ids(packed: bool):
    pos, seg = np.zeros((2, L), np.int32), np.zeros((2, L), np.int32)
    for b, lengths in enumerate(DOCS if packed else ([L], [L])):
        start = 0
        for d, n in enumerate(lengths):
            pos[b, start:start + n], seg[b, start:start + n] = np.arange(n), d + 1
            start += n
    return pos, seg


def make_case(name: str):
    """Inputs, ids and block sizes of a named case (all float32; queries scaled so the softmax is
    peaked and the running max moves between key blocks)."""
    heads = {"mha_load_balanced": (2, 2)}.get(name, (4, 2))
    N, G = heads
    rng = np.random.default_rng(sum(map(ord, name)))
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    q, k, v, do = 3.0 * normal(2, L, N, A), normal(2, L, G, A), normal(2, L, G, A), normal(2, L, N, A)
    pos, seg = _ids(packed=name != "unpacked")
    if name in ("load_balanced", "mha_load_balanced"):
        q, k, v, do, pos, seg = (x[:, LOAD_BALANCED] for x in (q, k, v, do, pos, seg))
    q_sl, kv_sl, block_k = slice(None), slice(None), BLOCK
    if name == "later_queries_other_rank_keys":  # a rank's queries against an earlier rank's keys
        q_sl, kv_sl, block_k = slice(32, 64), slice(0, 32), 8
    if name == "keys_all_in_the_future":  # no query sees any key: zeros, -inf, zero gradients
        q_sl, kv_sl = slice(0, 32), slice(32, 64)
    case = dict(q=q[:, q_sl], k=k[:, kv_sl], v=v[:, kv_sl], do=do[:, q_sl], q_pos=pos[:, q_sl], kv_pos=pos[:, kv_sl],
                q_seg=seg[:, q_sl], kv_seg=seg[:, kv_sl], block_q=BLOCK, block_k=block_k, scale=A ** -0.5,
                unpacked=name == "unpacked")
    return {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.items()}


def expected(case):
    """Reference o (numpy loop), lse, and autodiff gradients of the masked XLA core."""
    ids = (case["q_pos"], case["kv_pos"], case["q_seg"], case["kv_seg"])
    o = attention_reference(case["q"], case["k"], case["v"], *ids, case["scale"])
    grads = attention_reference_grads(case["q"], case["k"], case["v"], case["do"], *ids, case["scale"])
    return (o, *grads)


def _kw(case, backend):
    return dict(scale=case["scale"], backend=backend, block_q=case["block_q"], block_k=case["block_k"],
                interpret=True)


def run_flash(case, backend, dtype=jnp.float32):
    """(o, dq, dk, dv) of flash_attention with cotangent do."""
    ids = dict(q_pos_BT=case["q_pos"], kv_pos_BS=case["kv_pos"], q_seg_BT=case["q_seg"], kv_seg_BS=case["kv_seg"])
    if case.get("unpacked"):
        ids.update(q_seg_BT=None, kv_seg_BS=None)
    fn = functools.partial(ops.flash_attention, **ids, **_kw(case, backend))

    @jax.jit
    def go(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    return go(*(case[n].astype(dtype) for n in ("q", "k", "v", "do")))


def errors(actual, wanted):
    out = {}
    for name, a, e in zip(NAMES, actual, wanted):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert np.isfinite(a).all(), name
        out[name] = float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-30))
    return out


CASES = ("packed", "unpacked", "load_balanced", "mha_load_balanced", "later_queries_other_rank_keys",
         "keys_all_in_the_future")
PALLAS_BACKENDS = ("pallas_tpu",)
PALLAS_CASES = ("packed", "mha_load_balanced", "later_queries_other_rank_keys")
# The Triton driver (interpreted, slow): packed rows and another rank's keys.
GPU_CASES = ("packed", "later_queries_other_rank_keys")


@functools.cache
def _case_and_expected(name):
    case = make_case(name)
    return case, expected(case)


@functools.cache
def clean_errors(name, backend):
    case, want = _case_and_expected(name)
    return errors(run_flash(case, backend), want)


@pytest.mark.parametrize("backend, name", [("xla", n) for n in CASES]
                         + [(b, n) for b in PALLAS_BACKENDS for n in PALLAS_CASES]
                         + [("pallas_gpu", n) for n in GPU_CASES])
def test_values_and_gradients_match_the_reference_float32(backend, name):
    errs = clean_errors(name, backend)
    assert max(errs.values()) < TOLERANCE[jnp.float32], errs


@pytest.mark.parametrize("backend", ("xla",) + PALLAS_BACKENDS)
def test_bfloat16_inputs_meet_the_tolerance(backend):
    """bf16 q, k, v, do against the float32 oracle on the same (rounded) values."""
    case = make_case("packed")
    rounded = {**case, **{n: case[n].astype(jnp.bfloat16).astype(jnp.float32) for n in ("q", "k", "v", "do")}}
    out = run_flash(case, backend, jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in out)
    errs = errors(out, expected(rounded))
    assert max(errs.values()) < TOLERANCE[jnp.bfloat16], errs


def test_no_visible_key_gives_exact_zeros():
    """Queries whose keys all lie in the future: o and dq exactly 0 (no NaN), dk and dv exactly 0."""
    case = make_case("keys_all_in_the_future")
    for backend in ("xla", "pallas_tpu", "pallas_gpu"):
        for x in run_flash(case, backend):
            assert np.array_equal(np.asarray(x), np.zeros(x.shape)), backend


def test_padding_is_finite_and_gets_no_gradient():
    """Padding tokens (segment 0) with a zero cotangent, as the loss gives them: every output finite,
    the padding keys' dk and dv exactly 0, the real tokens' gradients as the oracle's."""
    case = make_case("packed")
    real = (case["q_seg"] > 0)[..., None, None]
    case = {**case, "do": jnp.where(real, case["do"], 0.0)}
    want = expected(case)
    for backend in ("xla", "pallas_tpu"):
        out = run_flash(case, backend)
        assert max(errors(out, want).values()) < TOLERANCE[jnp.float32]
        for dkv in out[2:]:
            assert np.array_equal(np.asarray(jnp.where(real, 0.0, dkv)), np.zeros(dkv.shape))


# ---------------------------------------------------------------------------------------------
# The ring's primitives


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
@pytest.mark.parametrize("name", ["load_balanced", "keys_all_in_the_future"])
def test_forward_primitive_lse_is_exact(backend, name):
    case, want = _case_and_expected(name)
    ids = dict(q_pos=case["q_pos"], kv_pos=case["kv_pos"], q_seg=case["q_seg"], kv_seg=case["kv_seg"])
    o, lse = jax.jit(functools.partial(ops.attention_fwd, **ids, **_kw(case, backend)))(case["q"], case["k"], case["v"])
    lse_ref = attention_reference_lse(case["q"], case["k"], *ids.values(), case["scale"])
    lse = np.asarray(lse)
    assert lse.shape == lse_ref.shape and lse.dtype == np.float32
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    if finite.any():
        assert np.abs(lse[finite] - lse_ref[finite]).max() < 1e-5 * np.abs(lse_ref[finite]).max()
    assert errors([o], want[:1])["o"] < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "pallas_gpu"])
def test_backward_primitive_summed_over_key_sets_is_exact(backend):
    """The ring's use: keys split into two sets (each set a rank's shard in load-balanced order),
    attention_bwd per set with the global o and lse; dq summed, dk and dv per set = the gradients."""
    case, want = _case_and_expected("load_balanced")
    ids = dict(q_pos=case["q_pos"], q_seg=case["q_seg"])
    kw = _kw(case, backend)
    o, lse = ops.attention_fwd(case["q"], case["k"], case["v"], **ids, kv_pos=case["kv_pos"],
                               kv_seg=case["kv_seg"], **kw)
    dq, dks, dvs = 0.0, [], []
    for sl in (slice(0, 32), slice(32, 64)):
        part = lambda x: x[:, sl]  # noqa: B023,E731
        dq_i, dk_i, dv_i = ops.attention_bwd(case["q"], part(case["k"]), part(case["v"]), o, lse, case["do"], **ids,
                                             kv_pos=part(case["kv_pos"]), kv_seg=part(case["kv_seg"]), **kw)
        assert dq_i.dtype == dk_i.dtype == jnp.float32
        dq, dks, dvs = dq + dq_i, dks + [dk_i], dvs + [dv_i]
    errs = errors((o, dq, jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1)), want)
    assert max(errs.values()) < TOLERANCE[jnp.float32], errs


# ---------------------------------------------------------------------------------------------
# Broken variants of the shared block math: each patched into flash_block.py and caught.

_ORIGINAL_SCORES = fb.scores


def _bleeding_fully_visible(q, kv):
    # Forgets that the key block may begin in an earlier document: only its last segment is compared.
    return (kv.pos_hi <= q.pos_lo) & (q.seg_lo == q.seg_hi) & (kv.seg_hi == q.seg_lo)


BROKEN = {
    "causal_mask_off_by_one": ("visible", lambda q_pos, q_seg, kv_pos, kv_seg: (kv_pos < q_pos) & (kv_seg == q_seg)),
    "segments_bleed_into_a_block_taken_as_fully_visible": ("block_fully_visible", _bleeding_fully_visible),
    "skip_predicate_too_eager": ("block_may_be_visible",
                                 lambda q, kv: (kv.pos_hi <= q.pos_lo) & (kv.seg_lo <= q.seg_hi) & (q.seg_lo <= kv.seg_hi)),
    "online_softmax_rescale_dropped": ("rescale_factor", lambda m_old, m_new: jnp.ones_like(m_old)),
    "scale_applied_twice": ("scores", lambda q, k, scale: _ORIGINAL_SCORES(q, k, scale) * scale),
    "query_group_under_the_wrong_kv_head": ("query_heads_of", lambda G, R: np.arange(G * R).reshape(R, G).T),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_broken_variant_is_caught(variant, monkeypatch):
    attribute, broken = BROKEN[variant]
    clean = max(clean_errors("packed", "pallas_tpu").values())
    case, want = _case_and_expected("packed")
    monkeypatch.setattr(fb, attribute, broken)
    broken_errors = errors(run_flash(case, "pallas_tpu"), want)
    worst = max(broken_errors.values())
    print(f"{variant}: clean max error {clean:.2e}, broken {worst:.2e} ({broken_errors})")
    assert worst >= 10 * clean and worst > 1e-3, (variant, clean, broken_errors)


# ---------------------------------------------------------------------------------------------
# Bad input, platform default, program fact


@pytest.mark.parametrize("block_q, block_k, names", [(12, 16, ("block_q=12", "64")), (16, 24, ("block_k=24", "64"))])
def test_block_that_does_not_divide_the_sequence_is_refused(block_q, block_k, names):
    case = make_case("packed")
    with pytest.raises(ValueError) as e:
        ops.flash_attention(case["q"], case["k"], case["v"], q_pos_BT=case["q_pos"], kv_pos_BS=case["kv_pos"],
                            scale=1.0, block_q=block_q, block_k=block_k)
    for name in names:
        assert name in str(e.value), str(e.value)


def _largest_buffers(jaxpr, found):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            if hasattr(var.aval, "shape"):
                found.append(tuple(var.aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _largest_buffers(sub, found)
    return found


def test_xla_backend_holds_no_score_matrix():
    """Forward and backward of the xla backend at T = S = 1024, blocks of 128: no value in the
    program (loop bodies included) has T * S / 4 or more elements; the masked core's scores have
    N * T * S."""
    T, N, G = 1024, 4, 2
    spec = jax.ShapeDtypeStruct
    ids = spec((1, T), jnp.int32)

    def loss(q, k, v, pos, seg, core):
        return jnp.sum(core(q, k, v, q_pos_BT=pos, kv_pos_BS=pos, q_seg_BT=seg, kv_seg_BS=seg, scale=0.1))

    args = (spec((1, T, N, A), jnp.float32), spec((1, T, G, A), jnp.float32), spec((1, T, G, A), jnp.float32), ids, ids)
    flash = functools.partial(ops.flash_attention, backend="xla", block_q=128, block_k=128)
    sizes = {}
    for name, core in (("flash", flash), ("masked", ops.xla.attention)):
        jaxpr = jax.make_jaxpr(jax.grad(functools.partial(loss, core=core), (0, 1, 2)))(*args)
        sizes[name] = max(_largest_buffers(jaxpr.jaxpr, []), key=np.prod)
    assert np.prod(sizes["flash"]) < T * T // 4, sizes
    assert np.prod(sizes["masked"]) >= N * T * T, sizes  # the check sees a score matrix where there is one


# ---------------------------------------------------------------------------------------------
# Triton: the GPU kernels lower from this CPU host (no GPU: Triton IR, not PTX).


def test_gpu_kernels_lower_to_triton():
    """Forward, dq and dk/dv of pallas_gpu lower through Pallas' Triton lowering for a cuda target at
    Qwen3.5-35B's heads (16 query heads over 2 kv heads, head dim 256; packed ids, bf16 inputs,
    blocks 64 x 64, queries against more keys). This proves the lowering accepts every primitive of
    the kernels; compiling the Triton IR to PTX (and whether its tiles fit shared memory) needs a GPU."""
    from hybridmoe.kernels.attention.pallas_gpu import KERNEL_NAMES

    T, S, N, G, head_dim = 256, 512, 16, 2, 256
    spec = jax.ShapeDtypeStruct
    args = (spec((1, T, N, head_dim), jnp.bfloat16), spec((1, S, G, head_dim), jnp.bfloat16),
            spec((1, S, G, head_dim), jnp.bfloat16), spec((1, T), jnp.int32), spec((1, S), jnp.int32),
            spec((1, T), jnp.int32), spec((1, S), jnp.int32))

    def loss(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        o = ops.flash_attention(q, k, v, q_pos_BT=q_pos, kv_pos_BS=kv_pos, q_seg_BT=q_seg, kv_seg_BS=kv_seg,
                                scale=head_dim ** -0.5, backend="pallas_gpu", block_q=64, block_k=64)
        return jnp.sum(o.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3, text.count("__gpu$xla.gpu.triton")
    for name in KERNEL_NAMES:
        assert name in text, name
