"""Gated DeltaNet core: the public functions and the dispatch on backend.

Dimension letters:
  B batch, T tokens, G key heads (Hk), H value heads (Hv, a multiple of G),
  K key head dim (dk), V value head dim (dv).
"""

import functools

import jax.numpy as jnp

from hybridmoe.kernels.gdn import pallas, pallas_tpu, xla
from hybridmoe.kernels.gdn.reference import prepare_query_key, recurrence_step

# One entry per backend. xla_autodiff is the same forward differentiated by autodiff: the baseline
# the custom backward is measured and tested against (not a config choice).
_BACKENDS = {
    "xla": lambda interpret: xla.gated_delta_rule_chunked,
    "xla_autodiff": lambda interpret: functools.partial(xla.gated_delta_rule_chunked, vjp="autodiff"),
    "pallas_tpu": lambda interpret: functools.partial(pallas_tpu.gated_delta_rule, interpret=interpret),
    "pallas_gpu": lambda interpret: functools.partial(
        xla.gated_delta_rule_chunked,
        core=functools.partial(pallas.chunked_core, backend="pallas_gpu", interpret=interpret)),
}
BACKENDS = tuple(_BACKENDS)


def _check_shapes(q, k, v, g, beta, segment_ids, initial_state):
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"gdn: q and k must both be [B, T, Hk, dk]; got q {q.shape}, k {k.shape}")
    batch, num_tokens, num_key_heads, key_dim = q.shape
    if v.ndim != 4 or v.shape[:2] != (batch, num_tokens):
        raise ValueError(f"gdn: v must be [B, T, Hv, dv] with B, T of q {q.shape}; got {v.shape}")
    num_value_heads, value_dim = v.shape[2:]
    if num_value_heads % num_key_heads:
        raise ValueError(f"gdn: value heads {num_value_heads} must be a multiple of key heads {num_key_heads}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(f"gdn: {name} must be [B, T, Hv] = {v.shape[:3]}; got {x.shape}")
    if segment_ids is not None and segment_ids.shape != (batch, num_tokens):
        raise ValueError(f"gdn: segment_ids must be [B, T] = {(batch, num_tokens)}; got {segment_ids.shape}")
    state_shape = (batch, num_value_heads, key_dim, value_dim)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"gdn: initial_state must be [B, Hv, dk, dv] = {state_shape}; got {initial_state.shape}")


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    segment_ids=None,
    initial_state=None,
    chunk_size: int = 64,
    normalize_qk: bool = True,
    backend: str = "xla",
    interpret: bool = False,
    precision: str | None = None,
    token_major: bool = False,
):
    """Gated delta rule over a sequence (docs/gdn.md sections 1-2).

    q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g (log gate, <= 0) and beta [B, T, Hv]. Value head h
    reads key head h // (Hv // Hk). normalize_qk L2-normalises q and k over dk (float32, eps 1e-6);
    q is always scaled by dk^-1/2. segment_ids [B, T] (optional): a document starts wherever the
    id differs from the previous token's and no state crosses that boundary; initial_state
    [B, Hv, dk, dv] (optional, zeros) applies to each row's first document only.
    backend: xla (any platform), pallas_tpu (Mosaic TPU) or pallas_gpu (Triton); the Pallas backends
    run on CPU with interpret=True (tests). precision: the pallas_tpu core's products (a key of
    tpu_chunk.PRECISIONS; None: its default for the inputs' dtype); no other backend takes one;
    token_major: the pallas_tpu kernels' blocks read and write the token-major arrays (docs/gdn.md,
    Layouts), pallas_tpu only.
    Returns (o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] float32).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"gdn: unknown backend {backend!r}; choices: {', '.join(BACKENDS)}")
    _check_shapes(q, k, v, g, beta, segment_ids, initial_state)
    if chunk_size < 1:
        raise ValueError(f"gdn: chunk_size must be positive; got {chunk_size}")
    if precision is not None and backend != "pallas_tpu":
        raise ValueError(f"gdn: precision {precision!r} is the pallas_tpu core's; backend {backend!r} takes none")
    if token_major and backend != "pallas_tpu":
        raise ValueError(f"gdn: token_major blocks are the pallas_tpu core's; backend {backend!r} has none")
    extra = {} if precision is None else {"precision": precision}
    if token_major:
        extra["token_major"] = True
    return _BACKENDS[backend](interpret)(
        q,
        k,
        v,
        g,
        beta,
        segment_ids=segment_ids,
        initial_state=initial_state,
        chunk_size=chunk_size,
        normalize_qk=normalize_qk,
        **extra,
    )


def gated_delta_step(q, k, v, g, beta, state, *, normalize_qk=True):
    """One decode token: q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; state [B, Hv, dk, dv].

    Returns (o [B, Hv, dv] in v's dtype, new state float32); same semantics as gated_delta_rule.
    """
    f32 = jnp.float32
    q_BHK, k_BHK = prepare_query_key(q, k, v.shape[-2], normalize_qk, f32)
    o_BHV, state_BHKV = recurrence_step(
        state.astype(f32), q_BHK, k_BHK, v.astype(f32), g.astype(f32), beta.astype(f32)
    )
    return o_BHV.astype(v.dtype), state_BHKV
