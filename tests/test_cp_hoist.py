"""attention.cp_load_balance_hoist_ids: exact, its program fact, and its broken variants caught.

8 simulated CPU devices, context 2 x fsdp 4, load-balanced attention, custom remat, a scan over
two attention blocks. With the key the load-balanced positions and segment ids carry a
checkpoint name that the save list holds, so the backward reads the forward's copy:
- exactness: logits and every parameter gradient bit-identical on and off;
- program: the backward layer loop loses its int32 collective-permutes (4 with packed segment
  ids, 2 without), read from the lowered program; every float permute and every permute outside
  the loops stays. The compiled CPU program already moves those permutes out of the loop without
  the key (XLA's loop-invariant code motion), so there the collectives are the same both ways and
  the rest of the replayed reorder too: the compiled programs have the same collectives and the
  same loop bodies both ways (the lever's effect there is the compiler's, as on TPU in the seed).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collections import Counter
from jax.ad_checkpoint import checkpoint_name

from helpers import packed_batch, tiny_config, tiny_params
from hybridmoe.analysis import program
from hybridmoe.model import attention as attn
from hybridmoe.model import remat
from hybridmoe.model.forward import logits
from hybridmoe.parallel import context
from hybridmoe.run.setup import build

B, T = 8, 64
# Attention layers only: the hoist acts there, and each compile stays short.
MODEL = ("model.num_layers=2", "model.layer_pattern=[attention]")
CP = ("mesh.context=2", "mesh.data=1", "attention.cp_load_balance=true", "remat.policy=custom")
HOIST = ("attention.cp_load_balance_hoist_ids=true",)


class Arm:
    """One configuration's value-and-grad: lowered at once, compiled and run when first asked."""

    def __init__(self, *overrides, packed=True):
        self.cfg = cfg = tiny_config(*MODEL, *CP, *overrides)
        params = tiny_params(cfg)
        self.batch = packed_batch(0, B, T, cfg.model.vocab_size)

        def loss(p, b):
            lg = logits(p, cfg, b["tokens"], b["segment_ids"] if packed else None,
                        b["positions"] if packed else None)
            return jnp.sum(jnp.sin(lg)), lg

        self.setup = build(cfg)
        with self.setup.context():
            self.params = jax.device_put(params, self.setup.param_shardings)
            self.lowered = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(self.params, self.batch)
        self.lowered_text = self.lowered.as_text()
        self._compiled = None

    @property
    def compiled(self):
        if self._compiled is None:
            self._compiled = self.lowered.compile()
        return self._compiled

    @functools.cached_property
    def values(self):
        """(logits, every parameter gradient)."""
        with self.setup.context():
            (_, lg), grads = self.compiled(self.params, self.batch)
        return lg, grads


def permutes(text_collectives):
    """{(dtype, where): count} of collective-permutes; where = 'outside' or the loop's place in
    program order (0 = the forward scan, 1 = the backward scan)."""
    loops = sorted({c.loop for c in text_collectives if c.in_loop}, key=lambda n: int(n.split("#")[-1]))
    assert len(loops) == 2, loops
    return Counter((c.dtype, loops.index(c.loop) if c.in_loop else "outside")
                   for c in text_collectives if c.kind == "collective-permute")


def lowered_permutes(arm):
    return permutes(program.parse_stablehlo(arm.lowered_text))


@pytest.fixture(scope="module")
def arms():
    return {(packed, on): Arm(*(HOIST if on else ()), packed=packed)
            for packed in (True, False) for on in (False, True)}


def assert_bits(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def check_hoist(on, off, packed):
    """Every claim of the lever for one pair of arms; raises AssertionError on the first unmet.
    The program first (lowering only), then the values (compiled and run)."""
    p_on, p_off = lowered_permutes(on), lowered_permutes(off)
    ids_moved = 4 if packed else 2  # positions (2 halves), and segment ids when packed
    assert p_off[("s32", 1)] == ids_moved, p_off
    assert p_on[("s32", 1)] == 0, p_on
    assert {k: v for k, v in p_on.items() if k != ("s32", 1)} == \
        {k: v for k, v in p_off.items() if k != ("s32", 1)}, (p_on, p_off)
    # Saved on the device: nothing of the step moves to host memory, and the remat policy keeps
    # the name as a named residual (an offloaded one is a device_put's output instead).
    assert "pinned_host" not in on.lowered_text and "pinned_host" not in off.lowered_text
    assert policy_saves_the_ids(on.cfg) and not policy_saves_the_ids(off.cfg)
    assert_bits(on.values, off.values)


def policy_saves_the_ids(cfg):
    def f(x, ids):
        return jnp.sin(x) * checkpoint_name(ids * 2, attn.LB_IDS_NAME)

    checkpointed = jax.checkpoint(f, policy=remat.remat_policy(cfg))
    residuals = program.saved_residuals(checkpointed, jnp.ones(4), jnp.ones(4, jnp.int32))
    return any(r.name == attn.LB_IDS_NAME for r in residuals)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_cp_load_balance_hoist_ids_exact_and_program(arms, packed):
    check_hoist(arms[(packed, True)], arms[(packed, False)], packed)


def test_compiled_collectives_unchanged(arms):
    """On the CPU backend XLA already moves the replayed reorder out of the compiled backward loop
    (loop-invariant code motion), so the compiled collectives are the same with the key."""
    on, off = (program.parse_hlo(arms[(True, k)].compiled.as_text()) for k in (True, False))
    assert Counter((c.kind, c.dtype, c.in_loop) for c in on) == Counter((c.kind, c.dtype, c.in_loop) for c in off)


def test_cp_load_balance_hoist_ids_off_never_names_the_ids(arms):
    assert attn.LB_IDS_NAME not in arms[(True, False)].lowered_text
    cfg = tiny_config(*MODEL, *CP)
    assert attn.LB_IDS_NAME not in remat.save_names(cfg)
    assert remat.save_names(tiny_config(*MODEL, *CP, *HOIST)) == (attn.LB_IDS_NAME,)


# ---------------------------------------------------------------------------------------------
# Broken variants (docs/levers.md, `attention.cp_load_balance_hoist_ids`), each patched in and caught by check_hoist.

_reorder = context.reorder


def _reorder_twice(a: attn.AttentionConfig):
    def ids(positions_BT, segment_ids_BT, a):
        twice = lambda x: _reorder(_reorder(x, ("batch", "seq")), ("batch", "seq"))  # noqa: E731
        out = [twice(positions_BT)] + ([twice(segment_ids_BT)] if segment_ids_BT is not None else [])
        out = [checkpoint_name(i, attn.LB_IDS_NAME) for i in out]
        return out[0], (out[1] if len(out) > 1 else None)
    return ids


def _natural_positions_saved(positions_BT, segment_ids_BT, a):
    pos = checkpoint_name(positions_BT, attn.LB_IDS_NAME)
    seg = checkpoint_name(_reorder(segment_ids_BT, ("batch", "seq")), attn.LB_IDS_NAME)
    return pos, seg


def _segment_ids_not_named(positions_BT, segment_ids_BT, a):
    return (checkpoint_name(_reorder(positions_BT, ("batch", "seq")), attn.LB_IDS_NAME),
            _reorder(segment_ids_BT, ("batch", "seq")))


def _offloaded_policy(cfg, policy=None):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(cfg.remat.save), names_which_can_be_offloaded=[attn.LB_IDS_NAME],
        offload_src="device", offload_dst="pinned_host")


BROKEN = {
    "reorder_applied_twice": (attn, "load_balanced_ids", _reorder_twice(None)),
    "natural_order_positions_saved": (attn, "load_balanced_ids", _natural_positions_saved),
    "save_list_without_the_name": (remat, "save_names", lambda cfg: tuple(cfg.remat.save)),
    "name_offloaded_instead_of_saved": (remat, "remat_policy", _offloaded_policy),
    "segment_ids_not_named": (attn, "load_balanced_ids", _segment_ids_not_named),
}


@pytest.fixture(params=list(BROKEN))
def broken_hoist(request, monkeypatch):
    module, name, fn = BROKEN[request.param]
    monkeypatch.setattr(module, name, fn)
    if module is remat:  # forward imported the name
        from hybridmoe.model import forward
        if hasattr(forward, name):
            monkeypatch.setattr(forward, name, fn)
    return request.param


def test_broken_variant_is_caught(broken_hoist, arms):
    with pytest.raises(AssertionError):
        check_hoist(Arm(*HOIST, packed=True), arms[(True, False)], packed=True)
