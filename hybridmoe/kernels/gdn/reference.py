"""Gated DeltaNet: the token-by-token recurrence (docs/gdn.md section 1), the oracle for every faster form.

Also the one definition of the input semantics every backend shares: L2 normalisation of q and k,
the dk^-1/2 query scale, value-head grouping and where packed documents start.

Dimension letters:
  B batch, T tokens, G key heads (Hk), H value heads (Hv, a multiple of G),
  K key head dim (dk), V value head dim (dv).
"""

import jax
import jax.numpy as jnp
from jax import lax

# Matches the eps of the l2norm in fla and in transformers' qwen3_next (added to the sum of squares).
L2_NORM_EPS = 1e-6

_HIGHEST = lax.Precision.HIGHEST


def l2_scale(x_K, eps: float = L2_NORM_EPS):
    """rsqrt(sum(x^2) + eps) over the last axis (dropped): the L2 normalisation is x times it, as fla
    and transformers do it (not F.normalize's max)."""
    return lax.rsqrt(jnp.sum(x_K * x_K, axis=-1) + eps)


def compute_dtype(dtype):
    """float32 for float32 and narrower inputs; float64 inputs (the x64 oracle checks) stay float64."""
    return jnp.promote_types(dtype, jnp.float32)


def prepare_query_key(q_GK, k_GK, num_value_heads: int, normalize_qk: bool, dtype):
    """Normalise, scale and group q, k (head axis -2) so that they index value heads.

    Normalisation runs in `dtype` (float32 at least): in bf16 the sum of squares of 128 entries
    loses the digits that make |k| = 1, and the delta rule's (I - beta k k^T) is only a
    contraction when |k| <= 1. The dk^-1/2 scale is applied whether or not normalize_qk is set,
    as in fla (scale defaults to dk^-1/2) and transformers' torch_*_gated_delta_rule.
    """
    num_key_heads = q_GK.shape[-2]
    q_GK, k_GK, q_scale_G, k_scale_G = query_key_scales(q_GK, k_GK, normalize_qk, dtype)
    q_GK = q_GK * q_scale_G[..., None]
    k_GK = k_GK * k_scale_G[..., None]
    # Value head h reads key head h // (H // G): repeat (not tile) lays the copies out that way.
    group_size = num_value_heads // num_key_heads
    q_HK = jnp.repeat(q_GK, group_size, axis=-2)
    k_HK = jnp.repeat(k_GK, group_size, axis=-2)
    return q_HK, k_HK


def query_key_scales(q_GK, k_GK, normalize_qk: bool, dtype):
    """(q, k in `dtype`, the factor of each of their rows [..., G]): prepare_query_key's q and k before
    the grouping are q * q_scale and k * k_scale, the normalisation and the dk^-1/2 query scale as
    one factor per row. The Mosaic kernels take q and k in this form, so that bfloat16 rows reach
    the MXU unrounded (kernels/gdn/pallas_tpu.py, Keys)."""
    q_GK, k_GK = q_GK.astype(dtype), k_GK.astype(dtype)
    query_scale = q_GK.shape[-1] ** -0.5
    if normalize_qk:
        return q_GK, k_GK, l2_scale(q_GK) * query_scale, l2_scale(k_GK)
    return q_GK, k_GK, jnp.full(q_GK.shape[:-1], query_scale, dtype), jnp.ones(k_GK.shape[:-1], dtype)


def starts_or_none(segment_ids_BT, batch: int, tokens: int):
    """document_starts of the ids, or no start past token 0 where there are none (one document a row)."""
    return jnp.zeros((batch, tokens), bool) if segment_ids_BT is None else document_starts(segment_ids_BT)


def initial_or_zeros(initial_state, shape_BHKV, dtype):
    """The initial state in `dtype`, or zeros of [B, H, K, V] where none is given."""
    return jnp.zeros(shape_BHKV, dtype) if initial_state is None else initial_state.astype(dtype)


def document_starts(segment_ids_BT):
    """[B, T] bool: True where a token starts a new document after token 0 of the row.

    A document starts wherever the id differs from the previous token's (ids need not be unique
    or increasing). Token 0 is not flagged: the row's first document starts from initial_state.
    """
    differs_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    first_B1 = jnp.zeros((segment_ids_BT.shape[0], 1), bool)
    return jnp.concatenate([first_B1, differs_BT], axis=1)


def recurrence_step(state_BHKV, q_BHK, k_BHK, v_BHV, g_BH, beta_BH):
    """One token of the gated delta rule on prepared (normalised, grouped) inputs.

    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q.
    """
    state_BHKV = state_BHKV * jnp.exp(g_BH)[..., None, None]
    recalled_BHV = jnp.einsum("bhkv,bhk->bhv", state_BHKV, k_BHK, precision=_HIGHEST)
    delta_BHV = beta_BH[..., None] * (v_BHV - recalled_BHV)
    state_BHKV = state_BHKV + k_BHK[..., :, None] * delta_BHV[..., None, :]
    o_BHV = jnp.einsum("bhkv,bhk->bhv", state_BHKV, q_BHK, precision=_HIGHEST)
    return o_BHV, state_BHKV


def gated_delta_rule_reference(
    q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, *, segment_ids=None, initial_state=None, normalize_qk=True
):
    """The oracle: a `lax.scan` over tokens. Returns (o [B, T, H, V] in v's dtype, final state).

    Computes in float32 (float64 for float64 inputs); the state is wiped to zero at every document
    start, which is the recurrence with exp(g) = 0 at that token.
    """
    batch, num_tokens, num_value_heads, value_dim = v_BTHV.shape
    key_dim = q_BTGK.shape[-1]
    dtype = compute_dtype(v_BTHV.dtype)
    q_BTHK, k_BTHK = prepare_query_key(q_BTGK, k_BTGK, num_value_heads, normalize_qk, dtype)
    starts_BT = starts_or_none(segment_ids, batch, num_tokens)
    state_BHKV = initial_or_zeros(initial_state, (batch, num_value_heads, key_dim, value_dim), dtype)

    def step(state_BHKV, token):
        q_BHK, k_BHK, v_BHV, g_BH, beta_BH, start_B = token
        state_BHKV = jnp.where(start_B[:, None, None, None], 0.0, state_BHKV)
        o_BHV, state_BHKV = recurrence_step(state_BHKV, q_BHK, k_BHK, v_BHV, g_BH, beta_BH)
        return state_BHKV, o_BHV

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    tokens = (q_BTHK, k_BTHK, v_BTHV.astype(dtype), g_BTH.astype(dtype), beta_BTH.astype(dtype), starts_BT)
    state_BHKV, o_TBHV = lax.scan(step, state_BHKV, jax.tree.map(time_major, tokens))
    return jnp.moveaxis(o_TBHV, 0, 1).astype(v_BTHV.dtype), state_BHKV
