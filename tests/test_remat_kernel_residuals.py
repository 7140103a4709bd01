"""remat.save's kernel residual names: gdn_core_residuals (the Mosaic GDN core's chunk start states
and inverses, kept with the layer's gdn_core_out) and attn_core_residuals (the flash attention core's
output and log-sum-exp) spare a remat's backward its second run of the kernel's forward.

Under remat.policy=minimal the backward replays each layer's non-matmul work to rebuild what the
kernels' backwards read. A kernel's custom VJP saves its residuals; unless they and its output are
kept, the replay runs the forward kernel again. The proofs, on one-layer blocks (the GDN kernels
interpreted, the XLA flash core): the residuals the forward keeps, where the compiled program runs
the kernel's forward (in the forward only, not in the backward's replay; the control without the
name runs it in both), and the gradients, equal to those of the control."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config, tiny_params
from hybridmoe.analysis import program
from hybridmoe.kernels.attention import ops as attention_ops
from hybridmoe.kernels.gdn import pallas_tpu
from hybridmoe.model.forward import block_fn
from hybridmoe.model.remat import checkpointed

B, T, C = 1, 32, 8  # chunks of 8 tokens: the inverses [C, C] and the states [K, V] = [16, 16] differ in shape
MINIMAL = ("model.num_layers=1", "remat.policy=minimal")
# Per kind: the block's overrides, the control's save list and the lever's, the forward's op-name
# scope in the compiled program, the module whose checkpoint_name names the residuals.
KINDS = {
    "gdn": (("model.layer_pattern=[gdn]", "kernels.interpret=true", "kernels.gdn.backend=pallas_tpu",
             f"gdn.chunk_size={C}"), "remat.save=[gdn_core_out]",
            f"remat.save=[gdn_core_out,{pallas_tpu.RESIDUALS_NAME}]", pallas_tpu.KERNEL_NAMES["forward"], pallas_tpu),
    "attention": (("model.layer_pattern=[attention]",), "remat.save=[]",
                  f"remat.save=[{attention_ops.RESIDUALS_NAME}]", "attention_core/", attention_ops),
}
REPLAY = "rematted_computation"  # where jax puts a remat's replay in the op names of the compiled program


def _block(cfg):
    params = tiny_params(cfg)
    bp = jax.tree.map(lambda a: a[0], params["blocks"])
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.ones((B, T), jnp.int32)
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.model.d_model), jnp.float32)
    block = lambda x, bp: checkpointed(block_fn(cfg, pos, seg), cfg, B * T, unit="block")(x, bp)  # noqa: E731
    return block, x, bp


def _compiled(kind: str, save: str):
    """(where the compiled value-and-gradient runs the kernel's forward: Counter of 'forward' /
    'replay' over its ops, the gradients)."""
    overrides, _, _, scope, _ = KINDS[kind]
    block, x, bp = _block(tiny_config(*MINIMAL, *overrides, save))
    loss = lambda x, bp: jnp.sum(jnp.sin(block(x, bp)))  # noqa: E731
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, bp).compile()
    ops = re.findall(r'op_name="([^"]*)"', compiled.as_text())
    where = Counter("replay" if REPLAY in op else "forward" for op in ops if scope in op)
    return where, compiled(x, bp)[1]


@pytest.fixture(scope="module", params=list(KINDS))
def compiled_pair(request):
    """(kind, the control's compile, the lever's)."""
    _, control, lever, _, _ = KINDS[request.param]
    return request.param, _compiled(request.param, control), _compiled(request.param, lever)


def _named(kind: str) -> Counter:
    overrides, _, lever, _, _ = KINDS[kind]
    cfg = tiny_config(*MINIMAL, *overrides, lever)
    block, x, bp = _block(cfg)
    return Counter((r.shape, r.source.split("'")[1]) for r in program.saved_residuals(block, x, bp)
                   if "named '" in r.source)


def _want_named(kind: str) -> Counter:
    m = tiny_config(*KINDS[kind][0]).model
    if kind == "gdn":
        G, Hg, K, V = m.gdn_num_key_heads, m.gdn_num_value_heads // m.gdn_num_key_heads, m.gdn_key_dim, m.gdn_value_dim
        items, name = T // C * Hg, pallas_tpu.RESIDUALS_NAME
        return Counter({((B, G, items, K, V), name): 1, ((B, G, items, C, C), name): 1,
                        ((B, T, m.gdn_num_value_heads, V), "gdn_core_out"): 1})
    # the output [B, T, N, A] and the log-sum-exp per head and query
    return Counter({((B, T, m.num_heads, m.head_dim), attention_ops.RESIDUALS_NAME): 1,
                    ((B, m.num_heads, T), attention_ops.RESIDUALS_NAME): 1})


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_named_residuals_are_the_kernels_own(kind):
    assert _named(kind) == _want_named(kind), _named(kind)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_residuals_left_unnamed_are_caught(kind, monkeypatch):
    # The broken variant: the kernel's forward rule names nothing (its checkpoint_name an identity).
    monkeypatch.setattr(KINDS[kind][4], "checkpoint_name", lambda x, name: x)
    assert _named(kind) != _want_named(kind)


def test_with_its_residuals_kept_the_backward_runs_no_forward_kernel(compiled_pair):
    kind, (control, _), (lever, _) = compiled_pair
    assert lever["forward"] > 0 and lever["replay"] == 0, (kind, lever)
    assert control["forward"] > 0 and control["replay"] > 0, (kind, control)  # the replay runs it again


def test_keeping_the_residuals_changes_no_gradient(compiled_pair):
    kind, (_, want), (_, grads) = compiled_pair
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(grads)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=kind)
