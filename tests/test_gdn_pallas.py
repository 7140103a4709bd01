"""The Pallas GDN cores run interpreted on CPU: pallas_tpu (kernels/gdn/pallas_tpu.py, the chunk-parallel
Mosaic kernels, math in tpu_chunk.py) and pallas_gpu (pallas_gpu.py, Triton, math in pallas_chunk.py).

- Forward and every gradient against the token-by-token oracle, packed documents included, at a
  shape where chunk, grid-step, key-head-group and document boundaries fall on block edges and
  inside them; against the XLA custom-VJP core; bfloat16 inputs within the field's tolerances in
  each bfloat16 precision; gates from 0 down to -1e6 (and a document start's) finite and exact.
- The broken variants (a dropped document start, chunks walked out of order, a gate applied twice,
  the wrong key head, a level of the triangular inverse skipped, the state not carried from one
  grid step to the next; and the GPU kernels' own) each caught with a 10x margin.
- Program facts: each key head reaches the kernels once (no float32 copy per value head); the
  stated cost counts every bfloat16 pass the chunk math runs.
- The kernels on blocks of the token-major arrays (kernels.gdn.layout=token_major) against the
  oracle and the transposed layout, and the width they need on a chip.
- The whole tiny model on the 8-device mesh, the sequence-sharded layer and decode's prefill
  against the XLA path; the GPU kernels' Triton lowering; the config validator.
(The Mosaic TPU compile and its VMEM: tests/test_gdn_tpu_compile.py, tpu_compile tests.)

Dimension letters: B batch, T tokens, G key heads, H value heads, K key dim, V value dim.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from hybridmoe.config import ConfigError
from hybridmoe.recipe import load_config
from hybridmoe.kernels.gdn import gated_delta_rule, limits, pallas_chunk, pallas_gpu, pallas_tpu, tpu_chunk
from hybridmoe.kernels.gdn.reference import gated_delta_rule_reference
from helpers import GDN_LAYERS
from tests.test_gdn_context_parallel import _layer_loss, _on_context_mesh, _rel_max, layer_case, single_device  # noqa: F401
from tests.test_gdn_kernel import (
    BF16_TOLERANCE,
    GRAD_NAMES,
    _relative_rms,
    make_inputs,
    segments_from_lengths,
    value_and_grads,
)

NAMES = ("o", "final state") + GRAD_NAMES
# Interpret mode runs the kernel body once per grid step: B * G * steps stays small. 2 key heads of
# 2 value heads each (key dim 24, value dim 32, chunk 16: no two arrays' minor dims alike); 72 tokens in chunks of 16, two chunks per grid step: 5 chunks (the last one
# half padding) padded to 6, three grid steps per (batch, key head).
SHAPE = dict(batch=2, tokens=72, key_heads=2, value_heads=4, key_dim=24, value_dim=32)
CHUNK, PER_STEP = 16, 2
# Row 0: starts at 8 (inside chunk 0), 32 (a grid step's first token) and 48 (a chunk edge inside a
# step); row 1: at 40 (inside chunk 2) and 41 (the next token).
DOCUMENTS = ([8, 24, 16, 24], [40, 1, 31])
tpu_rule = functools.partial(gated_delta_rule, backend="pallas_tpu", interpret=True, chunk_size=CHUNK)
stepped_tpu_rule = functools.partial(pallas_tpu.gated_delta_rule, interpret=True, chunk_size=CHUNK,
                                     chunks_per_step=PER_STEP)
gpu_rule = functools.partial(gated_delta_rule, backend="pallas_gpu", interpret=True, chunk_size=CHUNK)
xla_rule = functools.partial(gated_delta_rule, backend="xla", chunk_size=CHUNK)
RULES = {"pallas_tpu": stepped_tpu_rule, "pallas_gpu": gpu_rule}
# The broken variants run the Mosaic kernels at one chunk per grid step (6 steps per row and key
# head: every carry crosses a step) and three passes per product: half the body of the float32
# path to compile, errors near 1e-5 clean, far below a broken variant's.
broken_tpu_rule = functools.partial(pallas_tpu.gated_delta_rule, interpret=True, chunk_size=CHUNK, chunks_per_step=1,
                                    precision="bfloat16x3")
BROKEN_RULES = {"pallas_tpu": broken_tpu_rule, "pallas_gpu": gpu_rule,
                "pallas_tpu_token_major": functools.partial(broken_tpu_rule, token_major=True)}


def _relative_max_errors(actual, expected):
    """Per output / gradient: max |actual - expected| / max |expected| (a zero expected must be met exactly)."""
    errors = {}
    for name, a, e in zip(NAMES, actual, expected):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        errors[name] = float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-30))
    return errors


def _flat(outputs, grads):
    return tuple(outputs) + tuple(grads)


@pytest.fixture(scope="module")
def packed_case():
    """Packed rows, a non-zero initial state, and the oracle's outputs and gradients."""
    inputs = make_inputs(seed=5, **SHAPE)
    segment_ids = segments_from_lengths(*DOCUMENTS)
    expected = _flat(*value_and_grads(gated_delta_rule_reference, inputs, segment_ids))
    return inputs, segment_ids, expected


def _errors_of(rules, packed_case):
    inputs, segment_ids, expected = packed_case
    return {name: _relative_max_errors(_flat(*value_and_grads(rule, inputs, segment_ids)), expected)
            for name, rule in rules.items()}


@pytest.fixture(scope="module")
def clean_errors(packed_case):
    return _errors_of(RULES, packed_case)


@pytest.fixture(scope="module")
def clean_broken_rule_errors(packed_case, clean_errors):
    return {**clean_errors, **_errors_of({name: BROKEN_RULES[name] for name in ("pallas_tpu", "pallas_tpu_token_major")},
                                         packed_case)}


@pytest.mark.parametrize("backend", sorted(RULES))
def test_forward_and_every_gradient_match_the_oracle_packed(backend, clean_errors):
    """float32 inputs: o, final state, dq, dk, dv, dg, dbeta, dh0 within 1e-5 relative to max."""
    assert max(clean_errors[backend].values()) < 1e-5, clean_errors[backend]


def test_default_steps_and_a_ragged_unpacked_length_match_the_oracle():
    """One document of 37 tokens (the last chunk padded with g = 0, beta = 0), one value head on one
    key head, the default chunks per grid step (all three chunks in one step)."""
    inputs = make_inputs(seed=6, batch=1, tokens=37, key_heads=1, value_heads=1, key_dim=8, value_dim=16)
    expected = _flat(*value_and_grads(gated_delta_rule_reference, inputs, None))
    errors = _relative_max_errors(_flat(*value_and_grads(tpu_rule, inputs, None)), expected)
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.slow  # repeats the oracle test's exactness, against the XLA core
def test_equals_the_xla_custom_vjp_core(packed_case):
    """The same terms in another order (and float32 products as six bfloat16 passes): within 1e-6."""
    inputs, segment_ids, _ = packed_case
    errors = _relative_max_errors(_flat(*value_and_grads(stepped_tpu_rule, inputs, segment_ids)),
                                  _flat(*value_and_grads(xla_rule, inputs, segment_ids)))
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("precision", ["bfloat16x3", "bfloat16x3_bf16_inverse", "bfloat16"])
def test_bf16_inputs_meet_the_field_tolerances(precision, packed_case):
    """bf16 q, k, v, g, beta, state against the float32 oracle on the same (rounded) values, relative
    RMS (docs/gdn.md section 5); "bfloat16x3_bf16_inverse" is the default for bfloat16 inputs."""
    inputs, segment_ids, _ = packed_case
    inputs_bf16 = tuple(x.astype(jnp.bfloat16) for x in inputs)
    rule = functools.partial(stepped_tpu_rule, precision=precision, chunks_per_step=1)
    (o, final), grads = value_and_grads(rule, inputs_bf16, segment_ids)
    rounded = tuple(x.astype(jnp.float32) for x in inputs_bf16)
    (o_ref, final_ref), grads_ref = value_and_grads(gated_delta_rule_reference, rounded, segment_ids)
    assert o.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    errors = {name: _relative_rms(a, e) for name, a, e in zip(NAMES, (o, final) + grads, (o_ref, final_ref) + grads_ref)}
    assert all(errors[k] <= BF16_TOLERANCE[k] for k in errors), errors


def test_extreme_gates_are_finite_and_exact(packed_case):
    """g = -1e4 on every 7th token and on a chunk's last token (value head 0), g ~ -1e6 everywhere
    (value head 1, the other head of key head 0's group), next to the document starts'
    START_LOG_GATE: decays underflow to exactly 0, never NaN / inf; forward and gradients as the oracle."""
    inputs, segment_ids, _ = packed_case
    q, k, v, g, beta, state = inputs
    hard_forget = np.zeros(g.shape, bool)
    hard_forget[:, ::7, 0] = True
    hard_forget[:, CHUNK - 1, 0] = True
    g = jnp.where(jnp.asarray(hard_forget), -1e4, g)
    a_BT = jnp.asarray(np.random.default_rng(3).normal(size=g.shape[:2]), jnp.float32)
    g = g.at[:, :, 1].set(-jnp.exp(15.0) * jax.nn.softplus(a_BT))
    inputs = (q, k, v, g, beta, state)
    actual = _flat(*value_and_grads(functools.partial(stepped_tpu_rule, chunks_per_step=1), inputs, segment_ids))
    expected = _flat(*value_and_grads(gated_delta_rule_reference, inputs, segment_ids))
    assert all(np.isfinite(np.asarray(x)).all() for x in actual)
    errors = _relative_max_errors(actual, expected)
    assert max(errors.values()) < 1e-5, errors


token_major_rule = functools.partial(stepped_tpu_rule, token_major=True)


def test_token_major_blocks_match_the_oracle_and_the_transposed_layout(packed_case):
    """The kernels reading q, k, v and writing o (and, backward, dO, dq, dk, dv) as blocks of the
    token-major arrays, a key head's columns, in place of XLA's transposes to [B, G, (Hg,) T, X]:
    forward and every gradient within 1e-5 of the oracle, and equal to the transposed layout's to
    float32 rounding (the same math on the same values)."""
    inputs, segment_ids, expected = packed_case
    got = _flat(*value_and_grads(token_major_rule, inputs, segment_ids))
    errors = _relative_max_errors(got, expected)
    assert max(errors.values()) < 1e-5, errors
    layouts = _relative_max_errors(got, _flat(*value_and_grads(stepped_tpu_rule, inputs, segment_ids)))
    assert max(layouts.values()) < 1e-6, layouts


def test_token_major_blocks_need_lane_aligned_columns():
    """On a chip a key head's columns are a block only at a multiple of 128 lanes: the wrapper says
    which width is not, before Mosaic would refuse the block."""
    q = jnp.zeros((1, 64, 2, 96))
    v = jnp.zeros((1, 64, 4, 128))
    gates = jnp.zeros((1, 64, 4))
    with pytest.raises(ValueError, match="key dim 96 not a multiple of 128"):
        pallas_tpu.gated_delta_rule(q, q, v, gates, gates, token_major=True)
    assert limits.token_major_blocks_fit(2, 2, 128, 64, interpret=False) is None  # 2 x 64 = 128 lanes
    assert "value heads per key head x value dim 96" in limits.token_major_blocks_fit(2, 3, 128, 32,
                                                                                         interpret=False)


# ---------------------------------------------------------------------------------------------
# Broken variants: each patched into the kernels' own code and caught against the oracle.

_ORIGINAL = {"specs": pallas_tpu.block_specs, "decays": tpu_chunk.decays, "inverses": tpu_chunk.unit_lower_inverses,
             "gpu_chunk_step": pallas_chunk.chunk_step, "head_rows": pallas_tpu.head_rows,
             "key_scales": pallas_tpu.query_key_scales}


def _backward_blocks_in_forward_order(d, reverse):
    return _ORIGINAL["specs"](d, False)


def _gate_applied_twice(g_1C):
    return _ORIGINAL["decays"](2.0 * g_1C)


def _value_heads_tiled(x, axis, key_heads):
    """Value head h = j G + g reads key head h % G (jnp.tile's order) instead of h // Hg."""
    shape = x.shape
    tiled = x.reshape(*shape[:axis], shape[axis] // key_heads, key_heads, *shape[axis + 1:])
    return jnp.swapaxes(tiled, axis, axis + 1)


def _value_heads_untiled(x, axis):
    return jnp.swapaxes(x, axis, axis + 1).reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _inverses_skip_last_level(lowers_CD, parts):
    """The doubling stops one level early: the two halves of a chunk are never joined (T without its
    block of rows in the second half and columns in the first)."""
    row, col = tpu_chunk.positions(lowers_CD[0].shape[-1])
    half = lowers_CD[0].shape[-1] // 2
    return _ORIGINAL["inverses"]([jnp.where((row < half) | (col >= half), lower, 0.0) for lower in lowers_CD], parts)


def _substitution_skips_last_row(strict_lower_CD):
    size = strict_lower_CD.shape[-1]
    row, col = pallas_chunk._positions(size)
    eye_CD = (row == col).astype(jnp.float32)

    def substitute_row(i, inverse_CD):
        lower_row_D1 = jnp.sum(jnp.where(col == i, strict_lower_CD.T, 0.0), axis=1, keepdims=True)
        new_row_1D = (col[0] == i).astype(jnp.float32) - jnp.sum(lower_row_D1 * inverse_CD, axis=0, keepdims=True)
        return jnp.where(row == i, new_row_1D, inverse_CD)

    return lax.fori_loop(1, size - 1, substitute_row, eye_CD)


def _token_major_heads_swapped(ref, h, rows, group):
    """A token-major block's value heads read and written in reverse column order (each head's
    rows taken from another head's columns)."""
    return _ORIGINAL["head_rows"](ref, h if len(ref.shape) == 3 else group - 1 - h, rows, group)


def _key_factors_swapped(q, k, normalize_qk, dtype):
    """Each row of q multiplied by k's factor and k's by q's (the Keys' factors wired crosswise)."""
    q, k, q_scale, k_scale = _ORIGINAL["key_scales"](q, k, normalize_qk, dtype)
    return q, k, k_scale, q_scale


def _factor_on_the_rows_of_t(t, scale_C1, x, parts):
    """T diag(s) x taken as diag(s) T x: the diagonal factor (beta a, a row's factor) on T's rows."""
    return tpu_chunk.mxu(scale_C1 * t, x, ((1,), (0,)), parts)


def _gpu_chunk_decay_dropped(q, k, v, g_c, g_r, beta, starts_c, starts_r, state, inverse=None):
    """The state carried into the next chunk without its decay exp(sum g) (the recurrence's S <- exp(g) S)."""
    o, end = _ORIGINAL["gpu_chunk_step"](q, k, v, g_c, g_r, beta, starts_c, starts_r, state, inverse)
    decay = jnp.exp(jnp.sum(g_r)) * (jnp.sum(starts_r) == 0)
    return o, end + (1.0 - decay) * state


BROKEN = {  # name: (backend run, [(module, attribute, the broken function)])
    "document_start_dropped": ("pallas_tpu", [(pallas_tpu, "starts_or_none", lambda ids, batch, tokens: jnp.zeros((batch, tokens), bool))]),
    "backward_walks_chunks_in_forward_order": ("pallas_tpu", [(pallas_tpu, "block_specs", _backward_blocks_in_forward_order)]),
    "gate_applied_twice": ("pallas_tpu", [(tpu_chunk, "decays", _gate_applied_twice)]),
    "value_heads_read_the_wrong_key_head": ("pallas_tpu", [(pallas_tpu, "split_value_heads", _value_heads_tiled),
                                                            (pallas_tpu, "merge_value_heads", _value_heads_untiled)]),
    "inverse_skips_its_last_level": ("pallas_tpu", [(tpu_chunk, "unit_lower_inverses", _inverses_skip_last_level)]),
    "state_not_carried_across_grid_steps": ("pallas_tpu", [(pallas_tpu, "_walk_starts", lambda step: step >= 0)]),
    "q_and_k_row_factors_swapped": ("pallas_tpu", [(pallas_tpu, "query_key_scales", _key_factors_swapped)]),
    "diagonal_factor_on_the_rows_of_t": ("pallas_tpu", [(tpu_chunk, "scaled_product", _factor_on_the_rows_of_t)]),
    "token_major_value_heads_swapped": ("pallas_tpu_token_major", [(pallas_tpu, "head_rows", _token_major_heads_swapped)]),
    "gpu_backward_chunks_in_forward_order": ("pallas_gpu", [(pallas_gpu, "_chunk_order", lambda n, num, reverse: n)]),
    "gpu_forward_substitution_skips_last_row": ("pallas_gpu", [(pallas_chunk, "_forward_substitution",
                                                                _substitution_skips_last_row)]),
    "gpu_chunk_decay_dropped": ("pallas_gpu", [(pallas_chunk, "chunk_step", _gpu_chunk_decay_dropped)]),
}


@pytest.fixture(params=sorted(BROKEN))
def broken_variant(request, monkeypatch):
    backend, patches = BROKEN[request.param]
    for module, attribute, broken in patches:
        monkeypatch.setattr(module, attribute, broken)
    return request.param, backend


def test_broken_variant_is_caught(broken_variant, packed_case, clean_broken_rule_errors):
    broken_variant, backend = broken_variant
    inputs, segment_ids, expected = packed_case
    broken_errors = _relative_max_errors(_flat(*value_and_grads(BROKEN_RULES[backend], inputs, segment_ids)), expected)
    clean, broken = max(clean_broken_rule_errors[backend].values()), max(broken_errors.values())
    print(f"{broken_variant}: clean max error {clean:.2e}, broken {broken:.2e} ({broken_errors})")
    assert broken >= 10 * clean and broken > 1e-3, (broken_variant, clean, broken_errors)


# ---------------------------------------------------------------------------------------------
# Program facts


def test_each_key_head_reaches_the_kernels_once(packed_case):
    """The kernels read q and k as [B, G, T, K] (each key head once, for all its value heads), and
    no float32 array of the traced forward and backward is a per-value-head copy of the keys (K
    minor and B x T x H x K elements or more)."""
    from hybridmoe.analysis.program import iter_eqns

    inputs, segment_ids, _ = packed_case
    batch, tokens, key_heads, key_dim = inputs[0].shape
    heads = inputs[2].shape[2]

    def loss(q, k, v, g, beta, state):
        o, final = stepped_tpu_rule(q, k, v, g, beta, segment_ids=segment_ids, initial_state=state)
        return jnp.sum(o) + jnp.sum(final)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(6))))(*inputs)
    calls = [e for e in iter_eqns(jaxpr) if e.primitive.name == "pallas_call"]
    assert sorted(e.params["name"] for e in calls) == ["gdn_chunk_backward", "gdn_chunk_forward"]
    padded = -(-tokens // (CHUNK * PER_STEP)) * CHUNK * PER_STEP
    for e in calls:
        q_operand, k_operand = (v.aval for v in e.invars[:4:2])  # each followed by its rows' factors
        assert q_operand.shape == k_operand.shape == (batch, key_heads, padded, key_dim), e.params["name"]
    per_value_head = [v.aval.shape for e in iter_eqns(jaxpr) for v in e.outvars
                      if getattr(v.aval, "dtype", None) == jnp.float32 and v.aval.shape[-1:] == (key_dim,)
                      and v.aval.size >= batch * tokens * heads * key_dim]
    assert not per_value_head, per_value_head


def test_stated_flops_count_every_bfloat16_pass():
    """The cost a kernel states is its chunk math's matmuls as traced, bfloat16 passes included:
    at dims (C, K, V) = (16, 16, 16), one chunk of a group of 2: the float32 path's forward runs
    6 passes of every product but the segment sums (3: their 0/1 operand is exact); against a hand
    count of the forward's products (q k^T, k k^T once; per value head: the segment sum, the
    doubling inverse's 2 (log2 C - 1) products, W, U, W S, q S, A V_new, k^T V_new). The doubling's
    levels of 8 rows and more take only their blocks' second halves' rows: at C 16 the levels of 2
    and 4 are 2 C^3 each, the level of 8 is 2 (C / 2) C^2: 5 C^3 in all."""
    C = K = V = 16
    inverse = 5 * C**3
    per_head = 3 * C * C * C + 6 * (inverse + 2 * C * C * K + 2 * C * K * V + C * K * V + C * C * V)
    assert tpu_chunk.chunk_macs("forward", C, K, V, 2, "float32") == 6 * 2 * C * C * K + 2 * per_head
    # bfloat16: one pass for k k^T, q k^T, W, U and the inverse; three for A V_new and the chain's
    # W S; two for q S and the chain's k^T V_new, whose q and k rows are bfloat16 (never split);
    # the segment sum's three.
    bf16_per_head = 3 * C**3 + inverse + 2 * C * C * K + 3 * (C * K * V + C * C * V) + 2 * (2 * C * K * V)
    assert tpu_chunk.chunk_macs("forward", C, K, V, 2, "bfloat16") == 2 * C * C * K + 2 * bf16_per_head
    # bfloat16x3_bf16_inverse: bfloat16x3 less two of the three passes of each doubling product (the
    # forward's; the backward's two products of T's adjoint per head, C^3 each).
    for kernel, inverse_macs in (("forward", inverse), ("backward", 2 * C**3)):
        saved = (tpu_chunk.chunk_macs(kernel, C, K, V, 2, "bfloat16x3")
                 - tpu_chunk.chunk_macs(kernel, C, K, V, 2, "bfloat16x3_bf16_inverse"))
        assert saved == 2 * inverse_macs * 2, (kernel, saved)


# ---------------------------------------------------------------------------------------------
# Triton: the GPU kernels lower from this CPU host (no GPU: Triton IR, not PTX).


def test_gpu_kernels_lower_to_triton():
    """Forward and backward of pallas_gpu lower through Pallas' Triton lowering for a cuda target at
    Qwen3.5's head dims (chunk 64, dk = dv = 128; packed rows, bf16 inputs). This proves the lowering
    accepts every primitive of the kernels; compiling the Triton IR to PTX needs a GPU."""
    tokens, heads, dims = 256, 2, 128
    spec = jax.ShapeDtypeStruct
    args = (spec((1, tokens, 1, dims), jnp.bfloat16), spec((1, tokens, 1, dims), jnp.bfloat16),
            spec((1, tokens, heads, dims), jnp.bfloat16), spec((1, tokens, heads), jnp.float32),
            spec((1, tokens, heads), jnp.float32), spec((1, tokens), jnp.int32))

    def loss(q, k, v, g, beta, segment_ids):
        o, final = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=64, backend="pallas_gpu")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    lowered = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4))).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 2  # the forward and the backward kernel


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("backend, requirements", [
    ("pallas_tpu", ("pallas_tpu cannot run on this platform (cpu)", "gdn.chunk_size >= 2 on TPU (got 1")),
    ("pallas_gpu", ("pallas_gpu cannot run on this platform (cpu)", "gdn.chunk_size a power of two >= 16 on GPU (got 1)",
                    "model.gdn_value_dim a power of two >= 16 on GPU (got 24)")),
])
def test_validator_names_the_key_and_every_unmet_requirement(backend, requirements):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"kernels.gdn.backend={backend}", "gdn.chunk_size=1", "model.gdn_value_dim=24"])
    messages = [m for k, m in e.value.problems if k == "kernels.gdn.backend"]
    assert len(messages) == 1, e.value.problems
    for requirement in requirements:
        assert requirement in messages[0], messages[0]
    assert "model.gdn_key_dim" not in messages[0]  # 16 meets the rule


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_interpreted_backend_is_accepted_with_any_chunk_and_context_parallelism(backend):
    cfg = load_config("tiny", [f"kernels.gdn.backend={backend}", "kernels.interpret=true", "gdn.chunk_size=12",
                               "mesh.context=2", "mesh.fsdp=1", "mesh.data=-1", "train.seq_len=48",
                               "rl.prefill_chunk=48"])
    assert cfg.kernels.gdn.backend == backend


def test_bad_precision_and_chunks_per_step_name_the_choice(packed_case):
    inputs, segment_ids, _ = packed_case
    with pytest.raises(ValueError, match="unknown precision 'bf16'; choices: float32, bfloat16x3, bfloat16"):
        pallas_tpu.gated_delta_rule(*inputs[:5], chunk_size=CHUNK, interpret=True, precision="bf16")
    with pytest.raises(ValueError, match="chunks_per_step must be positive; got 0"):
        pallas_tpu.gated_delta_rule(*inputs[:5], chunk_size=CHUNK, interpret=True, chunks_per_step=0)


# ---------------------------------------------------------------------------------------------
# The production path: the whole tiny model on the 8-device CPU mesh, Pallas core vs XLA core.

MODEL_OVERRIDES = ("gdn.chunk_size=16", "train.seq_len=64", *GDN_LAYERS)  # GDN layers: the GDN core is what it compares


def _model_loss_and_grads(cfg, params, batch):
    from hybridmoe.run.step import nll_sum

    fast_compile = {"xla_backend_optimization_level": 0}
    return jax.jit(jax.value_and_grad(lambda p: nll_sum(p, cfg, batch)[0]), compiler_options=fast_compile)(params)


def test_model_with_pallas_core_equals_xla_core_on_the_mesh():
    """Loss and every parameter gradient of the packed tiny model (documents starting inside chunks):
    kernels.gdn.backend=pallas_tpu (interpreted, per shard in a shard_map: rows over data x fsdp,
    head groups over tensor) against xla."""
    from helpers import packed_batch, tiny_config, tiny_params
    from hybridmoe.run.setup import build

    results = {}
    for backend in ("xla", "pallas_tpu"):
        cfg = tiny_config(*MODEL_OVERRIDES, "mesh.tensor=2", f"kernels.gdn.backend={backend}", "kernels.interpret=true")
        setup = build(cfg)
        params = tiny_params(cfg)
        batch = packed_batch(3, 8, 64, cfg.model.vocab_size, doc_lengths=(5, 30, 9, 20))
        with setup.context():
            batch = jax.device_put(batch, jax.tree.map(lambda _: setup.batch_sharding(0), batch))
            results[backend] = _model_loss_and_grads(cfg, jax.device_put(params, setup.param_shardings), batch)
    (loss, grads), (loss_xla, grads_xla) = results["pallas_tpu"], results["xla"]
    errors = {"loss": abs(float(loss) - float(loss_xla)) / abs(float(loss_xla))}
    for (path, g), g_xla in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_xla)):
        g, g_xla = np.asarray(g, np.float64), np.asarray(g_xla, np.float64)
        errors[jax.tree_util.keystr(path)] = float(np.abs(g - g_xla).max() / max(np.abs(g_xla).max(), 1e-30))
    assert max(errors.values()) < 1e-5, {k: f"{v:.1e}" for k, v in errors.items() if v >= 1e-5}


def _sharded_pallas_errors(layer_case, single_device, **keys):
    """Loss and every gradient of the layer over 4 context ranks on the interpreted Mosaic core,
    relative to the single-device XLA layer's."""
    cfg, params, x, seg = layer_case
    loss = _layer_loss(cfg, 16, backend="pallas_tpu", interpret=True, **keys)
    value, grads = _on_context_mesh(4, jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x, seg)
    value_1, grads_1 = single_device[16]
    errors = {"loss": _rel_max(value, value_1)}
    for (path, g), g_1 in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_1)):
        errors[jax.tree_util.keystr(path)] = _rel_max(g, g_1)
    return errors


SHARDED_PALLAS_KEYS = {"scans": dict(cp_m_scan=True, cp_dh_scan=True), "terms in kernel": dict(cp_terms_in_kernel=True)}


@pytest.mark.parametrize("keys", list(SHARDED_PALLAS_KEYS))
def test_sequence_sharded_layer_with_pallas_core_equals_one_device(keys, layer_case, single_device):
    """The GDN layer with the sequence over 4 context ranks on the Mosaic core per rank against the
    single-device XLA layer: packed rows with documents starting inside a shard, on a shard edge and
    on a chunk edge; loss and every gradient. `scans`: the kernels run pass 2 and the backward's
    final pass, both scans (gdn.cp_m_scan, gdn.cp_dh_scan) the cross-chunk products of XLA's chunk
    terms; `terms in kernel` (gdn.cp_terms_in_kernel): pass 1 and the local state cotangent are
    kernels too, on the core's own layout."""
    errors = _sharded_pallas_errors(layer_case, single_device, **SHARDED_PALLAS_KEYS[keys])
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_prefill_from_a_state_equals_the_xla_core(backend, layer_case):
    """Decode's prefill: the layer from a carried state (conv tails and a non-zero [Hv, dk, dv] state)
    through each Pallas core equals the XLA core, output and every new state."""
    from hybridmoe.model import gdn as gdn_model

    cfg, params, x, seg = layer_case
    m = cfg.model
    rng = np.random.default_rng(3)
    rows, tokens, width = 2, 40, m.gdn_conv_kernel - 1
    tail = lambda heads, dim: jnp.asarray(rng.normal(size=(rows, width, heads, dim)), jnp.float32)
    state = {"conv_q": tail(m.gdn_num_key_heads, m.gdn_key_dim), "conv_k": tail(m.gdn_num_key_heads, m.gdn_key_dim),
             "conv_v": tail(m.gdn_num_value_heads, m.gdn_value_dim),
             "ssm": jnp.asarray(rng.normal(size=(rows, m.gdn_num_value_heads, m.gdn_key_dim, m.gdn_value_dim)),
                                jnp.float32)}
    outputs = {b: jax.jit(functools.partial(gdn_model.gdn_layer, m=m, chunk_size=16, backend=b,
                                            interpret=True))(params, x[:rows, :tokens], seg[:rows, :tokens],
                                                             state=state)
               for b in ("xla", backend)}
    for a, e in zip(jax.tree.leaves(outputs[backend]), jax.tree.leaves(outputs["xla"])):
        assert _rel_max(a, e) < 1e-5
    assert _rel_max(outputs[backend][1]["ssm"], state["ssm"]) > 0.1  # the state really moved


def test_auto_backend_is_the_mosaic_core_on_a_tpu_and_xla_elsewhere():
    """kernels.gdn.backend=auto (the default): the core the chip timed fastest on a TPU, never one the
    chunk size rules out, and the XLA path on every other platform; a named backend is kept."""
    from hybridmoe.kernels.gdn import limits

    assert load_config("tiny", []).kernels.gdn.backend == "auto"
    assert limits.resolve("auto", "tpu", 64) == "pallas_tpu"
    assert limits.resolve("auto", "tpu", limits.PALLAS_TPU_MIN_CHUNK) == "pallas_tpu"
    assert limits.resolve("auto", "tpu", limits.PALLAS_TPU_MIN_CHUNK - 1) == "xla"
    assert [limits.resolve("auto", p, 64) for p in ("cpu", "gpu", "cuda")] == ["xla"] * 3
    assert limits.resolve("xla", "tpu", 64) == "xla" and limits.resolve("pallas_gpu", "cpu", 64) == "pallas_gpu"


@pytest.mark.parametrize("key, keyword, values", [
    ("precision", "precision", (("bfloat16", "bfloat16"), ("bfloat16x3", "bfloat16x3"), ("auto", None))),
    ("layout", "token_major", (("token_major", True), ("head_major", None)))])
def test_kernel_keys_reach_the_mosaic_core_in_training_and_prefill(key, keyword, values, monkeypatch):
    """kernels.gdn.precision and kernels.gdn.layout reach the Mosaic core's call from the training
    forward and from the rollout's prefill (decode.cached_hidden over a 16-token prompt); auto and
    head_major pass none (the kernel's defaults). Traced only (jax.eval_shape): the call is what is
    checked."""
    from helpers import packed_batch, tiny_config, tiny_params
    from hybridmoe.kernels.gdn import pallas_tpu
    from hybridmoe.model import decode
    from hybridmoe.run.step import nll_sum

    seen = []
    original = pallas_tpu.gated_delta_rule

    def recording(*args, **kw):
        seen.append(kw.get(keyword))
        return original(*args, **kw)

    monkeypatch.setattr(pallas_tpu, "gated_delta_rule", recording)
    for value, want in values:
        cfg = tiny_config(*MODEL_OVERRIDES, "kernels.gdn.backend=pallas_tpu", "kernels.interpret=true",
                          f"kernels.gdn.{key}={value}")
        params = tiny_params(cfg, perturb=False)
        batch = packed_batch(3, 2, 64, cfg.model.vocab_size, doc_lengths=(30, 34))
        for what, run in (("training", lambda: jax.eval_shape(lambda p: nll_sum(p, cfg, batch)[0], params)),
                          ("prefill", lambda: jax.eval_shape(
                              lambda p: decode.cached_hidden(p, cfg, decode.init_cache(cfg, 2, 20), batch["tokens"][:, :16],
                                                             jnp.ones((2, 16), jnp.int32),
                                                             jnp.broadcast_to(jnp.arange(16), (2, 16)))[0], params))):
            seen.clear()
            run()
            assert seen and set(seen) == {want}, (value, what, seen)


def test_sequence_sharded_core_takes_the_precision(layer_case):
    """kernels.gdn.precision under context parallelism: over 4 context ranks at precision bfloat16, with
    the ranks' terms in the kernels (the one-device core's layout and rows), the layer's loss and
    gradients lie near the one-device Mosaic core's at bfloat16 (the cross-rank passes round
    differently) and far from the float32 core's (2.7e-2), where a precision dropped on the ranks
    would put them (about 1e-5 from float32). With the terms by XLA (pass 2 on normalised q and k,
    rounded there rather than as rows) the ranks are as far from float32: the precision reached them too."""
    cfg, params, x, seg = layer_case
    grad = lambda loss: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))  # noqa: E731
    core = dict(backend="pallas_tpu", interpret=True, precision="bfloat16")
    sharded = {terms: _on_context_mesh(4, grad(_layer_loss(cfg, 16, cp_terms_in_kernel=terms, **core)), params, x, seg)
               for terms in (True, False)}
    one = {p: grad(_layer_loss(cfg, 16, **{**core, "precision": p}))(params, x, seg) for p in ("bfloat16", "float32")}

    def error(a, b):
        (va, ga), (vb, gb) = a, b
        return max([_rel_max(va, vb)] + [_rel_max(u, w) for u, w in zip(jax.tree.leaves(ga), jax.tree.leaves(gb))])

    same, apart = error(sharded[True], one["bfloat16"]), error(sharded[True], one["float32"])
    assert same < apart / 5, f"vs one device at bfloat16 {same:.2e}, vs float32 {apart:.2e}"
    assert error(sharded[False], one["float32"]) > apart / 5, error(sharded[False], one["float32"])
