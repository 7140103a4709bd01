"""A decode step's routed rows on CPU: `every_expert_rows` against a float64 numpy
loop, where it is chosen, and that the sampler's decode runs it while its prefill runs row tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from broken_variants import mutated
from helpers import tiny_config, tiny_params
from hybridmoe.model import moe as moe_mod
from hybridmoe.rl import sampler
from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts
from hybridmoe.analysis.program import ops_by_shape

TOL = 1e-5  # relative L2 against float64; the clean error is float32 rounding (~1e-7)


def _case(num_tokens: int = 6, num_experts: int = 8, k: int = 3, d: int = 16, f: int = 8):
    """Tokens whose rows span many binades, routed so that expert 5 gets no token and expert 0 several."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((num_tokens, d)) * np.exp2(rng.integers(-6, 6, (num_tokens, 1)))).astype(np.float32)
    wi = rng.standard_normal((num_experts, d, 2 * f)).astype(np.float32) * 0.3
    wo = rng.standard_normal((num_experts, f, d)).astype(np.float32) * 0.3
    experts = [e for e in range(num_experts) if e != 5]
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    idx[:, 0] = 0
    w = rng.uniform(0.05, 1.0, (num_tokens, k)).astype(np.float32)
    return x, w, idx, wi, wo


def _numpy_reference(x, w, idx, wi, wo):
    """Per token, per routed slot: w * (silu(gate) * up) @ wo of that expert, in float64."""
    x, w, wi, wo = (a.astype(np.float64) for a in (x, w, wi, wo))
    f = wo.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(idx[t]):
            h = x[t] @ wi[e]
            gate, up = h[:f], h[f:]
            out[t] += w[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ wo[e])
    return out


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


BROKEN = {
    # the rows of another token (reversed token order in the take)
    "rows_of_another_token": ("jnp.arange(T, dtype=jnp.int32)[:, None]", "jnp.arange(T, dtype=jnp.int32)[::-1, None]"),
    # the routing weights never applied
    "weights_dropped": ("* w_Tk[..., None]", "* 1.0"),
    # the gate and up halves swapped
    "halves_swapped": ("swiglu(h_ET2F)", "swiglu(jnp.roll(h_ET2F, h_ET2F.shape[-1] // 2, axis=-1))"),
    # each routed slot takes the next expert's rows
    "next_expert": ("y_ETD[idx_Tk,", "y_ETD[(idx_Tk + 1) % y_ETD.shape[0],"),
}


@pytest.mark.parametrize("variant", [None, *BROKEN])
def test_every_expert_rows_equal_a_numpy_loop(variant):
    case = _case()
    fn = moe_mod.every_expert_rows if variant is None else mutated(moe_mod, "every_expert_rows", *BROKEN[variant])
    err = _rel(jax.jit(fn)(*map(jnp.asarray, case)), _numpy_reference(*case))
    print(f"{variant or 'clean'}: relative L2 {err:.2e} (tolerance {TOL:.0e})")
    if variant is None:
        assert err < TOL
        # ... and it is the sparse paths' result (the same rows, the same combine): ragged_dot and
        # the CPU training program's row tiles.
        args = tuple(map(jnp.asarray, case))
        assert _rel(fn(*args), moe_mod.sparse_experts(*args)) < TOL
        assert _rel(fn(*args), moe_mod.tiled_experts(*args, tile_rows=128)) < TOL
    else:
        assert err > 10 * TOL


def test_every_expert_is_chosen_while_it_computes_no_more_rows():
    # small: E = 16, k = 4, 128-row tiles: T * 16 rows against (ceil(4 T / 128) + 16) * 128.
    assert moe_mod.every_expert_is_cheaper(8, 4, 16, 128)
    assert moe_mod.every_expert_is_cheaper(176, 4, 16, 128)  # 2816 rows each (22 tiles): the tie goes to it
    assert not moe_mod.every_expert_is_cheaper(177, 4, 16, 128)  # 2832 against 2816
    assert not moe_mod.every_expert_is_cheaper(256, 4, 16, 128)


def test_sampler_decodes_with_every_expert_and_prefills_with_row_tiles():
    """Program fact (jaxpr, one device, tiny: E = 8, 2F = 128): the decode step's up projection is
    [E, rows, 2F] (every expert on the 4 rows); the prefill's is the row tiles' [tiles, 128, 2F]."""
    # One attention layer: the MoE block is what is read; the trace stays short.
    cfg = tiny_config("mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1", "model.layer_pattern=[attention]",
                      "model.num_layers=1")
    m = cfg.model
    rows = left_pad_prompts([[5, 6, 7], [8, 9]], 5, pad_id=0)
    opts = SamplingOptions(max_new_tokens=3, temperature=1.0, eos_id=-1)
    jaxpr = jax.make_jaxpr(lambda p, *a: sampler.generate(p, cfg, opts, *a, group_size=2))(
        tiny_params(cfg), *rows, jax.random.key(0))
    shapes = {shape for (prim, shape, _), _ in ops_by_shape(jaxpr).items() if prim == "dot_general"}
    two_f = 2 * m.moe_intermediate_size
    assert (m.num_experts, 4, two_f) in shapes  # decode: 2 prompts x 2 rows, every expert
    assert any(len(s) == 3 and s[1:] == (128, two_f) for s in shapes)  # prefill: row tiles
    assert (m.num_experts, 2 * 5, two_f) not in shapes  # the prefill is not every-expert


def _up_projections(jaxpr) -> set[tuple[int, ...]]:
    return {shape for (prim, shape, _), _ in ops_by_shape(jaxpr).items() if prim == "dot_general" and len(shape) == 3}


def test_a_decode_step_moe_block_equals_the_training_programs():
    """The MoE block on 8 tokens (a decode step of 8 rows) as the sampler runs it (decode_step:
    every expert) and as the training step runs it (row tiles), routed by the same router: equal
    to float rounding, and the two are different programs (read from their jaxprs)."""
    cfg = tiny_config("mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1")
    m = cfg.model
    p = jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][0]["moe"])
    rng = np.random.default_rng(1)
    x = jnp.asarray((rng.standard_normal((8, m.d_model)) * np.exp2(rng.integers(-6, 6, (8, 1)))).astype(np.float32))

    def block(decode_step):
        return lambda p, x: moe_mod.moe_local(p, x, m, cfg.moe, cfg.kernels, decode_step=decode_step)

    two_f = 2 * m.moe_intermediate_size
    decode_ops, train_ops = (_up_projections(jax.make_jaxpr(block(d))(p, x)) for d in (True, False))
    assert (m.num_experts, 8, two_f) in decode_ops and (m.num_experts, 8, two_f) not in train_ops
    assert any(s[1:] == (128, two_f) for s in train_ops)  # the training program's row tiles
    decoded, trained = jax.jit(block(True))(p, x), jax.jit(block(False))(p, x)
    err = _rel(decoded, trained)
    print(f"decode step vs training program: relative L2 {err:.2e} (tolerance {TOL:.0e})")
    assert err < TOL


@pytest.mark.parametrize("tokens", [6, 8])
def test_token_chunks_that_do_not_divide_a_decode_steps_rows_run_one_pass(tokens):
    """moe.token_chunks=4 over a decode step's 6 rows (4 does not divide them): one pass; over 8 rows,
    two rows a chunk. Either way the numpy loop's result and nothing dropped."""
    case = _case(tokens)
    plan = moe_mod.GroupedPlan(num_experts=8, token_chunks=4)
    y, dropped = moe_mod.grouped_experts(*map(jnp.asarray, case), plan)
    assert y.shape == (tokens, 16) and int(dropped) == 0
    assert _rel(y, _numpy_reference(*case)) < TOL
