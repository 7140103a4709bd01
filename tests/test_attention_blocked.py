"""Blocked causal self-attention (the CPU core) equals the full masked core on packed rows,
values and gradients, for every token of a document; broken block ranges are caught."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import packed_batch
from hybridmoe.kernels import attention as A
from hybridmoe.kernels.attention import blocked

B, T, N, G, H = 2, 256, 4, 2, 8


def _inputs():
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, n, H)), jnp.float32) for n in (N, G, G))
    batch = packed_batch(0, B, T, 64, doc_lengths=(40, 70, 9, 30))  # padding at each row's end
    cot = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32)
    real = batch["segment_ids"] > 0
    return q, k, v, batch["positions"], batch["segment_ids"], jnp.where(real[..., None, None], cot, 0.0), real


def _errors():
    q, k, v, pos, seg, cot, real = _inputs()
    kw = dict(q_pos_BT=pos, kv_pos_BS=pos, q_seg_BT=seg, kv_seg_BS=seg, scale=H ** -0.5)
    outs = []
    for core in (A.attention, A.causal_attention_blocked):
        loss = lambda q, k, v: jnp.sum(core(q, k, v, **kw) * cot)  # noqa: B023,E731
        outs.append(jax.jit(lambda q, k, v: (core(q, k, v, **kw), jax.grad(loss, (0, 1, 2))(q, k, v)))(q, k, v))  # noqa: B023
    (y0, g0), (y1, g1) = outs
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(a))  # noqa: E731
    m = np.asarray(real)
    return {"out": rel(np.asarray(y0)[m], np.asarray(y1)[m]),
            **{f"d{n}": rel(np.asarray(a), np.asarray(b)) for n, a, b in zip("qkv", g0, g1)}}


def test_blocked_equals_full_core_on_document_tokens():
    assert blocked.num_query_blocks(T) == 4 and blocked.num_query_blocks(100) == 1
    errs = _errors()
    assert max(errs.values()) < 1e-6, errs


BROKEN = {
    "diagonal_block_dropped": lambda i, b: slice(0, max(i, 1) * b),
    "keys_of_the_next_block_only": lambda i, b: slice(i * b, (i + 1) * b),
}


@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_key_range_caught(variant, monkeypatch):
    key_range = BROKEN[variant]
    original = blocked.attention

    def sabotaged(q, k, v, *, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, scale):
        b = q.shape[1]
        i = k.shape[1] // b - 1
        sl = key_range(i, b)
        return original(q, k[:, sl], v[:, sl], q_pos_BT=q_pos_BT, kv_pos_BS=kv_pos_BS[:, sl], q_seg_BT=q_seg_BT,
                        kv_seg_BS=kv_seg_BS[:, sl], scale=scale)

    monkeypatch.setattr(blocked, "attention", sabotaged)
    errs = _errors()
    assert max(errs.values()) > 1e-3, errs


def test_auto_core_per_platform():
    """kernels.attention.backend=auto: the Mosaic kernels on TPU, flash attention in XLA ops elsewhere
    (on CPU faster than blocked: benchmarks/records/attention_cpu_backend.json)."""
    from hybridmoe.kernels.attention import limits
    assert [limits.resolve("auto", p) for p in ("cpu", "tpu", "gpu")] == ["xla", "pallas_tpu", "xla"]
    assert limits.resolve("blocked", "tpu") == "blocked"
