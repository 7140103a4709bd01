"""The broken variants of the fused SwiGLU epilogues (docs/levers.md, `moe.wo_fused_dswiglu`), shared
by the kernel and the MoE-layer tests: each is (name in kernels/gmm/epilogue.py, the broken function
to patch in)."""

import jax.numpy as jnp

from hybridmoe.kernels.gmm import epilogue as epi

_ORIGINAL_READ_TILE = epi.read_tile


def _swap_halves(block, j, t):
    g, u = _ORIGINAL_READ_TILE(block, j, t)
    return u, g


def _contiguous_reader(block, j, t):
    f = block.shape[-1] // 2
    return block[..., j * t:(j + 1) * t], block[..., f + j * t:f + (j + 1) * t]


BROKEN = {
    "halves_swapped": ("read_tile", _swap_halves),
    "silu_grad_without_second_term": ("silu_grad", lambda x, sig: sig),
    "row_scale_dropped": ("row_scale_f32", lambda s: jnp.ones_like(s, jnp.float32)),
    "row_scale_bf16": ("row_scale_f32", lambda s: s.astype(jnp.bfloat16).astype(jnp.float32)),
    "contiguous_reader_on_interleaved_layout": ("read_tile", _contiguous_reader),
    "reversed_tile_order": ("tile_order", lambda n: list(range(n))[::-1]),
}

# The variants that live in a Pallas kernel's own code (its tile readers); the others are
# epilogue maths the backends share.
READER_VARIANTS = ("contiguous_reader_on_interleaved_layout", "reversed_tile_order")


# ---------------------------------------------------------------------------------------------
# The broken variants of the MoE levers' plumbing: each is a list of
# (module, attribute, the broken function to patch in); tests/test_moe_proofs.py must catch each.

import jax  # noqa: E402

import hybridmoe.kernels.gmm as _gmm  # noqa: E402
from hybridmoe.kernels.gmm import pallas_tpu as _pallas_tpu  # noqa: E402
from hybridmoe.kernels.gmm import row_tiles as _row_tiles  # noqa: E402
from hybridmoe.model import moe as _moe  # noqa: E402

_ORIGINAL_SCALE_ROWS = epi.scale_rows
_ORIGINAL_PIPELINE = _pallas_tpu.weight_pipeline


def _sqrt_routing_weight(h_MF, s_M):
    return _ORIGINAL_SCALE_ROWS(h_MF, jnp.sqrt(s_M))


def _reversed_expert_ranks(exp_axes, num_local):
    n = jax.lax.axis_size(exp_axes)
    return (n - 1 - jax.lax.axis_index(exp_axes)) * num_local


BROKEN_MOE = {
    # moe.router_grad_from_wo_input: the down projection's input scaled by sqrt(w) instead of w.
    "router_sqrt_weight": [(epi, "scale_rows", _sqrt_routing_weight),
                           (_gmm, "scale_rows", _sqrt_routing_weight)],
    # moe.capacity_factor: one row too many kept per overflowing expert (`<` -> `<=`).
    "capacity_keeps_one_more": [(_moe, "within_capacity", lambda position, cap: position <= cap)],
    # The expert-parallel ring: each rank runs the experts of the mirrored rank.
    "ring_mirrored_expert_offset": [(_moe, "local_expert_offset", _reversed_expert_ranks)],
    # kernels.gmm.xla_impl=row_tiles: a tile boundary assigned to the group before it.
    "row_tiles_group_boundary": [(_row_tiles, "_group_of", lambda ends, pos: jnp.minimum(
        jnp.searchsorted(ends, pos, side="left"), ends.shape[0] - 1))],
    # kernels.gmm.wi_fwd_rhs_buffer_count: the depth never reaches the weight's BlockSpec.
    "buffer_depth_ignored": [(_pallas_tpu, "weight_pipeline", lambda depth, tiles_k: {})],
    # ... or reaches it one deeper than asked.
    "buffer_depth_off_by_one": [(_pallas_tpu, "weight_pipeline",
                                 lambda depth, tiles_k: _ORIGINAL_PIPELINE(depth + 1 if depth else 0, tiles_k))],
}


# ---------------------------------------------------------------------------------------------
# One-line bugs in production functions: the function recompiled from its own source
# with one fragment replaced, to patch in with monkeypatch. The fragment must occur exactly once,
# so a variant whose target line has changed fails loudly instead of testing nothing.

import inspect  # noqa: E402
import textwrap  # noqa: E402


def mutated(module, name: str, old: str, new: str):
    """`module.name` with the one occurrence of `old` in its source replaced by `new`."""
    source = textwrap.dedent(inspect.getsource(getattr(module, name)))
    count = source.count(old)
    if count != 1:
        raise AssertionError(f"{module.__name__}.{name}: the fragment {old!r} occurs {count} times (want 1); "
                             "update the broken variant to the current code")
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), f"<{module.__name__}.{name}, broken>", "exec"), namespace)  # noqa: S102
    return namespace[name]


# ---------------------------------------------------------------------------------------------
# The per-kernel tiles and the on-chip memory model. Each is a function returning
# [(module, attribute, broken value)] to monkeypatch (built when asked: mutated() reads the source).

from hybridmoe.kernels import vmem as _vmem  # noqa: E402
from hybridmoe.kernels.gmm import tiling as _tiling  # noqa: E402

BROKEN_TILE_PLUMBING = {
    # The wo input gradient silently runs at the forward's tiles (the shared tk at the cell).
    "wo_dlhs_takes_the_forward_tiles": lambda: [(_moe, "_expert_mlp", mutated(
        _moe, "_expert_mlp", "dlhs_tiling=t.wo_dlhs", "dlhs_tiling=t.wo_fwd"))],
    # The wi weight gradient's tiles never reach the kernel (the forward's serve).
    "wi_drhs_dropped": lambda: [(_moe, "_expert_mlp", mutated(
        _moe, "_expert_mlp", "drhs_tiling=t.wi_drhs", "drhs_tiling=None"))],
}

from hybridmoe.kernels.gmm import pallas_tpu as _gmm_tpu  # noqa: E402
from hybridmoe.kernels.gmm import pallas_tpu_own_copies as _gmm_own  # noqa: E402
from hybridmoe.kernels.gmm import metadata as _gmm_metadata  # noqa: E402
from hybridmoe.kernels.gmm import tpu_steps as _gmm_steps  # noqa: E402

# The Mosaic grouped matmuls' row mask and K loop (tests/test_gmm_kernels.py's k_tiles cases).
BROKEN_GMM_TPU = {
    # The row mask starts one row late: a group's first row is left to the block's earlier content.
    "mask_from_one_row_late": lambda: [(_gmm_steps, "rows_in_group", mutated(
        _gmm_steps, "rows_in_group", "(rows >= lo_ref[g])", "(rows > lo_ref[g])"))],
    # The row mask runs one row past the group's end: the next group's row taken in.
    "mask_to_one_row_past": lambda: [(_gmm_steps, "rows_in_group", mutated(
        _gmm_steps, "rows_in_group", "(rows < hi_ref[g])", "(rows <= hi_ref[g])"))],
    # The K scratch zeroed on the second K tile instead of the first (the first tile's product lost).
    "k_scratch_zeroed_late": lambda: [(_gmm_tpu, "gmm", mutated(_gmm_tpu, "gmm", "computes & (ki == 0)",
                                                                "computes & (ki == 1)"))],
    # No step for the row tiles no local group touches: their rows keep whatever the buffer held.
    "untouched_tiles_unwritten": lambda: [(_gmm_metadata, "output_walk", mutated(
        _gmm_metadata, "output_walk", "(visits + zero_steps)", "(visits + 0 * zero_steps)"))],
    # A tile's first step keeps the block's earlier content outside its group instead of zeroing it.
    "first_step_keeps_old_rows": lambda: [(_gmm_steps, "first_on_tile", lambda step, tile_ref: step < 0)],
    # The kernels that copy their own blocks (one K tile). gmm_prefetched fetches the current group's
    # weight again where it should fetch the next one's: every group after the first runs on its
    # predecessor's weight.
    "prefetch_fetches_the_current_group": lambda: [(_gmm_own, "_fetch_group_ahead", mutated(
        _gmm_own, "_fetch_group_ahead", "copies(nxt, 1 - slot)", "copies(g, 1 - slot)"))],
    # A row chunk holding a group's first row is skipped unless the group starts at the chunk's start
    # (gmm_prefetched's output rows, tgmm_written_behind's contraction).
    "chunk_skipped_at_a_group_start": lambda: [(_gmm_own, "_by_row_chunks", mutated(
        _gmm_own, "_by_row_chunks", "(r0 + chunk_rows > lo)", "(r0 >= lo)"))],
    # tgmm_written_behind restages a slot without waiting for the copy out of it two groups back.
    "staging_slot_reused_before_its_copy": lambda: [(_gmm_own, "tgmm_written_behind", mutated(
        _gmm_own, "tgmm_written_behind", "@pl.when(ordinal >= 2)", "@pl.when(ordinal < 0)"))],
    # A tile that straddles its group's first row is contracted whole, the previous group's rows in it.
    "whole_tile_across_a_group_start": lambda: [(_gmm_own, "tgmm_written_behind", mutated(
        _gmm_own, "tgmm_written_behind", "inside = (r0 >= lo_g) & (r0 + tm <= hi_g)", "inside = (r0 + tm <= hi_g)"))],
}

# The fused up projection copying its own weight (tests/test_gmm_kernels.py's own-copies cases).
BROKEN_FUSED_COPIES = {
    # The up slab copied from the gate's columns: h = silu(gate) * gate.
    "up_slab_from_the_gate_columns": lambda: [(_gmm_own, "wi_fused_swiglu_prefetched", mutated(
        _gmm_own, "wi_fused_swiglu_prefetched", "pl.ds(pl.multiple_of(f + j * tn, tn), tn)",
        "pl.ds(pl.multiple_of(j * tn, tn), tn)"))],
    # The fused input gradient reading the first local group's wo for every group.
    "wo_of_the_first_group_for_all": lambda: [(_gmm_own, "wo_fused_dswiglu_dlhs_prefetched", mutated(
        _gmm_own, "wo_fused_dswiglu_dlhs_prefetched", "wo_hbm.at[group]", "wo_hbm.at[0]"))],
    # Both slabs into one slot: the up copy lands in the gate's buffer.
    "up_copy_into_the_gate_slots": lambda: [(_gmm_own, "wi_fused_swiglu_prefetched", mutated(
        _gmm_own, "wi_fused_swiglu_prefetched", "w_hbm.at[group, :, up], wu_ref.at[to]", "w_hbm.at[group, :, up], wg_ref.at[to]"))],
}

BROKEN_VMEM_MODEL = {
    # A block's buffer count ignored (one copy of every block).
    "buffer_count_ignored": lambda: [(_vmem.Buffer, "tpu_bytes",
                                      property(lambda b: _vmem.tpu_tile_bytes(b.shape, b.itemsize)))],
    # The fused wo input gradient's float32 epilogue values dropped.
    "epilogue_values_dropped": lambda: [(_tiling, "epilogue_values", lambda tm, f: [])],
}


# ---------------------------------------------------------------------------------------------
# The broken variants of the micro-batch search (run/memory_fit.py, docs/rl.md "Memory"): each is a
# list of (module, attribute, the broken function to patch in); tests/test_memory_fit.py must catch each.

import dataclasses  # noqa: E402

from hybridmoe.run import memory_fit as _memory_fit  # noqa: E402

_ORIGINAL_FEWEST_THAT_FIT = _memory_fit.fewest_that_fit


def _count_off_by_one(counts, compile_at, budget, *fixed, **first):
    fit = _ORIGINAL_FEWEST_THAT_FIT(counts, compile_at, budget, *fixed, **first)
    return None if fit is None else dataclasses.replace(fit, count=fit.count + 1)


def _largest_that_fits(counts, compile_at, budget, *fixed, **first):
    return _ORIGINAL_FEWEST_THAT_FIT(list(counts)[::-1], compile_at, budget, *fixed, **first)


BROKEN_FIT = {
    "count_off_by_one": [(_memory_fit, "fewest_that_fit", _count_off_by_one)],
    "budget_ignored": [(_memory_fit, "fits", lambda need, budget: True)],
    "smallest_count_not_chosen": [(_memory_fit, "fewest_that_fit", _largest_that_fits)],
}


from hybridmoe.data import synthetic as _synthetic  # noqa: E402


def _split_interleaved(rows, micro_batches):
    """Micro-batch m takes every micro_batches-th row from m: the same rows, in another order."""
    out = {}
    for k, v in rows.items():
        flat = v.reshape((-1,) + v.shape[-1:])
        out[k] = flat.reshape((flat.shape[0] // micro_batches, micro_batches) + v.shape[-1:]).swapaxes(0, 1)
    return out


# The step's rows split into micro-batches (data/packing.split_micro_batches, data/synthetic.py).
BROKEN_SPLIT = {
    "rows_interleaved": [(_synthetic, "split_micro_batches", _split_interleaved)],
}
