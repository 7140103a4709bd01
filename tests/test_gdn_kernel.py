"""Gated DeltaNet core kernel: chunked form vs the token-by-token oracle, and the oracle vs numpy.

Dimension letters: B batch, T tokens, G key heads, H value heads, K key dim, V value dim.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.kernels.gdn import BACKENDS, gated_delta_rule, gated_delta_step
from hybridmoe.kernels.gdn.reference import gated_delta_rule_reference
from hybridmoe.kernels.gdn.xla import unit_lower_inverse

# docs/gdn.md section 5: chunked vs recurrent in float32.
RTOL, ATOL = 1e-4, 1e-5

# At these shapes compiling is nearly all of the time, and most of that is LLVM optimising code
# that then runs for microseconds: level 0 compiles about 3x faster (same HLO, same arithmetic).
FAST_COMPILE = {"xla_backend_optimization_level": 0}
jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)

chunked = jit(gated_delta_rule, static_argnames=("chunk_size", "normalize_qk", "backend"))
oracle = jit(gated_delta_rule_reference, static_argnames=("normalize_qk",))


def make_inputs(seed, batch=2, tokens=130, key_heads=2, value_heads=4, key_dim=16, value_dim=8, dtype=np.float32):
    """Random inputs with gates that keep a memory of tens of tokens (so chunks really interact)."""
    rng = np.random.default_rng(seed)
    q_BTGK = rng.normal(size=(batch, tokens, key_heads, key_dim))
    k_BTGK = rng.normal(size=(batch, tokens, key_heads, key_dim))
    v_BTHV = rng.normal(size=(batch, tokens, value_heads, value_dim))
    g_BTH = np.log(rng.uniform(0.7, 1.0, size=(batch, tokens, value_heads)))
    beta_BTH = rng.uniform(0.05, 1.0, size=(batch, tokens, value_heads))
    state_BHKV = rng.normal(size=(batch, value_heads, key_dim, value_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, state_BHKV))


def segments_from_lengths(*rows):
    """[B, T] ids from per-row document lengths; ids repeat across non-adjacent documents on purpose
    (a document starts where the id changes, not where a new id appears)."""
    ids = [np.concatenate([np.full(n, (7, 3)[i % 2]) for i, n in enumerate(row)]) for row in rows]
    return jnp.asarray(np.stack(ids), jnp.int32)


def assert_close(actual, expected, rtol=RTOL, atol=ATOL, what=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol, err_msg=what)


def value_and_grads(rule, inputs, segment_ids, **options):
    """Outputs and gradients w.r.t. q, k, v, g, beta and initial_state of a random projection.

    `rule` is an un-jitted function: the jit (and its compiler options) goes around the whole."""
    rng = np.random.default_rng(99)
    q, _, v, _, _, state = inputs
    o_weight = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    state_weight = jnp.asarray(rng.normal(size=state.shape), jnp.float32)

    def loss(q, k, v, g, beta, state):
        o, final = rule(q, k, v, g, beta, segment_ids=segment_ids, initial_state=state, **options)
        return jnp.sum(o * o_weight) + jnp.sum(final * state_weight), (o, final)

    # One jit around forward and backward: one compile instead of one per traced piece.
    (_, outputs), grads = jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*inputs)
    return outputs, grads


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


@pytest.mark.parametrize(
    "tokens, chunk_size, packed",
    [(1, 64, False), (63, 64, False), (65, 64, True), (130, 64, True), (130, 16, False), (130, 24, True)],
)
def test_chunked_matches_oracle_forward_and_gradients(tokens, chunk_size, packed):
    inputs = make_inputs(seed=tokens + chunk_size, tokens=tokens)
    segment_ids = None
    if packed:
        third, half = tokens // 3, tokens // 2
        segment_ids = segments_from_lengths([third, tokens - third], [half, 1, tokens - half - 1])
    rule = functools.partial(gated_delta_rule, chunk_size=chunk_size)
    (o, final), grads = value_and_grads(rule, inputs, segment_ids)
    (o_ref, final_ref), grads_ref = value_and_grads(gated_delta_rule_reference, inputs, segment_ids)
    assert o.shape == inputs[2].shape and final.dtype == jnp.float32
    # The initial state must matter (else a dropped initial_state would pass unnoticed).
    assert np.abs(np.asarray(grads_ref[5])).max() > 1e-3
    assert_close(o, o_ref, what="o")
    assert_close(final, final_ref, what="final state")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(grad, grad_ref, what=name)


def test_value_heads_read_their_key_group():
    """Hv = 2 Hk: value heads 2j and 2j+1 read key head j (repeat, not tile)."""
    q, k, v, g, beta, _ = make_inputs(seed=1, tokens=40, key_heads=2, value_heads=4)
    o, _ = chunked(q, k, v, g, beta)
    # Same computation with the key heads explicitly repeated to 4 and no grouping left to do.
    o_expanded, _ = chunked(jnp.repeat(q, 2, axis=2), jnp.repeat(k, 2, axis=2), v, g, beta)
    assert_close(o, o_expanded)
    o_tiled, _ = chunked(jnp.tile(q, (1, 1, 2, 1)), jnp.tile(k, (1, 1, 2, 1)), v, g, beta)
    assert not np.allclose(np.asarray(o), np.asarray(o_tiled), atol=1e-3)


def test_extreme_gates_are_finite_and_exact():
    """g ~ -1e4 on some tokens and a huge A_log: decays underflow to exactly 0, never NaN / inf."""
    q, k, v, g, beta, state = make_inputs(seed=2, tokens=130)
    rng = np.random.default_rng(3)
    # Head 0: a sharp forget (g = -1e4) on every 7th token, including chunk edges 63 and 126.
    hard_forget = np.zeros(g.shape, bool)
    hard_forget[:, ::7, 0] = True
    hard_forget[:, 63, 0] = True
    g = jnp.where(jnp.asarray(hard_forget), -1e4, g)
    # Head 1: the model's gate with A_log = 15: g = -exp(A_log) softplus(a) ~ -1e6.
    a_BT = jnp.asarray(rng.normal(size=g.shape[:2]), jnp.float32)
    g = g.at[:, :, 1].set(-jnp.exp(15.0) * jax.nn.softplus(a_BT))
    inputs = (q, k, v, g, beta, state)
    segment_ids = segments_from_lengths([50, 80], [64, 66])
    (o, final), grads = value_and_grads(gated_delta_rule, inputs, segment_ids)
    (o_ref, final_ref), grads_ref = value_and_grads(gated_delta_rule_reference, inputs, segment_ids)
    for name, x in zip(("o", "final state") + GRAD_NAMES, (o, final) + grads):
        assert np.isfinite(np.asarray(x)).all(), name
    assert_close(o, o_ref, what="o")
    assert_close(final, final_ref, what="final state")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert_close(grad, grad_ref, what=name)
    # After a -1e4 gate the old state is gone: the output at such a token ignores the past entirely.
    o_alone, _ = chunked(q[:, 63:64], k[:, 63:64], v[:, 63:64], g[:, 63:64], beta[:, 63:64])
    assert_close(o[:, 63, 0], o_alone[:, 0, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", [chunked, oracle], ids=["chunked", "oracle"])
def test_packed_documents_equal_separate_runs(rule):
    """Row 0: boundaries inside chunk 0 (40) and on the chunk edge (64); row 1: at 1 and at 65.

    The separate runs are one batch with a document per row, at the row's start, followed by
    no-op tokens (beta = 0, k = 0, g = 0 leave the state as it is) so that one compile serves all.
    """
    q, k, v, g, beta, state = make_inputs(seed=4, tokens=130)
    lengths = ([40, 24, 66], [1, 64, 65])
    o, final = rule(q, k, v, g, beta, segment_ids=segments_from_lengths(*lengths), initial_state=state)

    docs = [(row, sum(ls[:i]), n) for row, ls in enumerate(lengths) for i, n in enumerate(ls)]
    alone = [np.zeros((len(docs),) + x.shape[1:], np.float32) for x in (q, k, v, g, beta, state)]
    for i, (row, start, n) in enumerate(docs):
        for separate, packed in zip(alone[:5], (q, k, v, g, beta)):
            separate[i, :n] = packed[row, start : start + n]
        if start == 0:  # the initial state belongs to each row's first document only
            alone[5][i] = state[row]
    o_alone, final_alone = rule(*alone[:5], initial_state=alone[5])
    for i, (row, start, n) in enumerate(docs):
        assert_close(o[row, start : start + n], o_alone[i, :n], what=f"row {row} document at {start}")
    # Each row's final state is its last document's.
    assert_close(final[0], final_alone[2], what="row 0 final state")
    assert_close(final[1], final_alone[5], what="row 1 final state")
    # And the boundaries really cut something: as one document per row the outputs differ.
    one_document = jnp.zeros(q.shape[:2], jnp.int32)  # an array, like the packed call: no recompile
    o_unpacked, _ = rule(q, k, v, g, beta, segment_ids=one_document, initial_state=state)
    assert not np.allclose(np.asarray(o[:, 41:]), np.asarray(o_unpacked[:, 41:]), atol=1e-3)


def test_decode_steps_equal_oracle():
    q, k, v, g, beta, state = make_inputs(seed=5, tokens=20)
    step = jit(gated_delta_step)
    outputs, decode_state = [], state
    for t in range(q.shape[1]):
        o_t, decode_state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], decode_state)
        outputs.append(o_t)
    o_ref, final_ref = oracle(q, k, v, g, beta, initial_state=state)
    assert decode_state.dtype == jnp.float32
    assert_close(jnp.stack(outputs, axis=1), o_ref, rtol=1e-6, atol=1e-6)
    assert_close(decode_state, final_ref, rtol=1e-6, atol=1e-6)


def numpy_recurrence(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, state_BHKV):
    """The recurrence written out in float64 numpy loops, independent of the package's helpers."""
    batch, tokens, value_heads, _ = v_BTHV.shape
    group = value_heads // q_BTGK.shape[2]
    o_BTHV = np.zeros_like(v_BTHV)
    state_BHKV = state_BHKV.copy()
    for b in range(batch):
        for t in range(tokens):
            if t > 0 and segment_ids_BT[b, t] != segment_ids_BT[b, t - 1]:
                state_BHKV[b] = 0.0
            for h in range(value_heads):
                q_K, k_K = q_BTGK[b, t, h // group], k_BTGK[b, t, h // group]
                q_K = q_K / np.sqrt(q_K @ q_K + 1e-6) / np.sqrt(q_K.size)
                k_K = k_K / np.sqrt(k_K @ k_K + 1e-6)
                s_KV = np.exp(g_BTH[b, t, h]) * state_BHKV[b, h]
                s_KV = s_KV + beta_BTH[b, t, h] * np.outer(k_K, v_BTHV[b, t, h] - s_KV.T @ k_K)
                state_BHKV[b, h] = s_KV
                o_BTHV[b, t, h] = s_KV.T @ q_K
    return o_BTHV, state_BHKV


def test_oracle_matches_numpy_loop_in_float64():
    with jax.enable_x64(True):
        shapes = dict(batch=2, tokens=12, key_heads=1, value_heads=2, key_dim=4, value_dim=3)
        inputs = make_inputs(seed=6, dtype=np.float64, **shapes)
        segment_ids = segments_from_lengths([5, 7], [12])
        o, final = gated_delta_rule_reference(*inputs[:5], segment_ids=segment_ids, initial_state=inputs[5])
        assert o.dtype == jnp.float64
        q, k, v, g, beta, state = (np.asarray(x) for x in inputs)
        o_np, final_np = numpy_recurrence(q, k, v, g, beta, np.asarray(segment_ids), state)
        np.testing.assert_allclose(np.asarray(o), o_np, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(final), final_np, rtol=1e-12, atol=1e-12)


def test_normalize_qk():
    """With normalisation the output ignores the length of q and k; without it, it does not."""
    q, k, v, g, beta, _ = make_inputs(seed=7, tokens=30)
    # |k| ~ 0.5 keeps the un-normalised delta rule a contraction (with |k| ~ 4 it amplifies and
    # chunked and recurrent drift apart by float32 rounding alone).
    q, k = q / 8, k / 8
    o, _ = chunked(q, k, v, g, beta)
    o_scaled, _ = chunked(3.0 * q, 0.5 * k, v, g, beta)
    assert_close(o_scaled, o)
    o_raw, _ = chunked(q, k, v, g, beta, normalize_qk=False)
    o_raw_ref, _ = oracle(q, k, v, g, beta, normalize_qk=False)
    assert_close(o_raw, o_raw_ref)
    assert not np.allclose(np.asarray(o_raw), np.asarray(o), atol=1e-3)


@pytest.mark.parametrize("size", [64, 24])
def test_unit_lower_inverse(size):
    """Blocked forward substitution (64 = 4 blocks of 16; 24 falls back to one block) vs numpy."""
    rng = np.random.default_rng(size)
    lower = np.tril(rng.normal(size=(3, size, size)) * 0.3, -1)
    inverse = unit_lower_inverse(jnp.asarray(lower, jnp.float32))
    expected = np.linalg.inv(np.eye(size) + lower)
    np.testing.assert_allclose(np.asarray(inverse), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [64, 128])
def test_mosaic_doubling_inverse(size):
    """The Mosaic kernels' T by doubling (tpu_chunk.unit_lower_inverses at float32: six passes), its
    levels of 8 rows and more on their blocks' second halves' rows alone, vs numpy; a product that
    dropped or misplaced a block of rows would be off by the block's entries (about 0.3)."""
    from hybridmoe.kernels.gdn import tpu_chunk

    rng = np.random.default_rng(size)
    lower = np.tril(rng.normal(size=(2, size, size)) * 0.3, -1)
    inverses = tpu_chunk.unit_lower_inverses([jnp.asarray(x, jnp.float32) for x in lower], 3)
    for inverse, x in zip(inverses, lower):
        np.testing.assert_allclose(np.asarray(inverse), np.linalg.inv(np.eye(size) + x), rtol=1e-4, atol=1e-5)


def test_rejects_unknown_backend_and_bad_shapes():
    q, k, v, g, beta, _ = make_inputs(seed=8, tokens=4, key_heads=3, value_heads=4)
    assert BACKENDS == ("xla", "xla_autodiff", "pallas_tpu", "pallas_gpu")
    with pytest.raises(ValueError, match="choices: xla, xla_autodiff, pallas_tpu, pallas_gpu"):
        gated_delta_rule(q[:, :, :2], k[:, :, :2], v, g, beta, backend="pallas")
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule(q, k, v, g, beta)


def _relative_rms(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sqrt(np.mean((actual - expected) ** 2) / np.mean(expected**2)))


# docs/gdn.md section 5: reduced-precision kernels against the float32 recurrence, relative RMS.
BF16_TOLERANCE = {"o": 5e-3, "final state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2,
                  "dinitial_state": 8e-3}


def test_custom_backward_with_bf16_inputs_meets_the_field_tolerances():
    """bf16 q, k, v, g, beta, state (packed rows) against the float32 oracle on the same values; and
    the float32 call within 1e-5 relative to max of the oracle."""
    inputs_f32 = make_inputs(seed=12, tokens=130)
    inputs_bf16 = tuple(x.astype(jnp.bfloat16) for x in inputs_f32)
    segment_ids = segments_from_lengths([40, 90], [64, 66])
    (o, final), grads = value_and_grads(gated_delta_rule, inputs_bf16, segment_ids)
    rounded = tuple(x.astype(jnp.float32) for x in inputs_bf16)
    (o_ref, final_ref), grads_ref = value_and_grads(gated_delta_rule_reference, rounded, segment_ids)
    assert o.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    errors = {"o": _relative_rms(o, o_ref), "final state": _relative_rms(final, final_ref)}
    errors |= {name: _relative_rms(g, g_ref) for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref)}
    assert all(errors[k] <= BF16_TOLERANCE[k] for k in errors), errors

    (o, final), grads = value_and_grads(gated_delta_rule, rounded, segment_ids)
    for name, x, x_ref in zip(("o", "final state") + GRAD_NAMES, (o, final) + grads, (o_ref, final_ref) + grads_ref):
        err = float(np.abs(np.asarray(x) - np.asarray(x_ref)).max() / np.abs(np.asarray(x_ref)).max())
        assert err < 1e-5, (name, err)
