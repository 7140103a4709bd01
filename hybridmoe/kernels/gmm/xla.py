"""XLA backend: jax.lax.ragged_dot / ragged_dot_general, or row tiles, plus jnp epilogues.

impl (static, every function): "ragged_dot", or "row_tiles" (row_tiles.py: one batched matmul
over group-aligned row tiles, tile_rows rows each; the CPU choice, see ops.xla_impl_for).

Legend: M rows, K contraction, N output columns, E groups in group_sizes, G local groups,
D model width, F hidden half width, T forward tile per half.

Expert-sharded groups (group_offset, G < E) are handled by prepending one zero "group" that
absorbs the rows before the local groups; rows after them fall past the ragged sum and come out
zero. Every output is masked to the local rows, so padding and foreign rows are exactly zero.

The TPU compiler of the pinned libtpu refuses ragged_dot over more than TPU_RAGGED_DOT_MAX_GROUPS
groups (an internal layout error; measured: 256 compile, 257 and up do not), and Qwen3.5-397B has
512 experts (256 local + the zero group at 2 expert ranks). Traced for TPU, a ragged_dot over more
groups runs as consecutive chunks of local groups, each one ragged_dot of at most that many
groups (its rows before the chunk in the zero group), whose outputs (zero outside their rows) add
up; elsewhere the one ragged_dot is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe.kernels.gmm import epilogue
from hybridmoe.kernels.gmm import row_tiles as rt
from hybridmoe.kernels.gmm.metadata import local_bounds, row_mask
from hybridmoe.kernels.platform import trace_platform

TPU_RAGGED_DOT_MAX_GROUPS = 256


def ragged_group_chunks(num_local: int, sharded: bool, platform: str | None = None) -> list[tuple[int, int]]:
    """(first local group, groups) of each ragged_dot the local groups run as: one unless the
    platform's compiler caps the groups of a ragged_dot (TPU), then chunks that with their zero
    group fit under the cap."""
    if (platform or trace_platform()) != "tpu" or num_local + sharded <= TPU_RAGGED_DOT_MAX_GROUPS:
        return [(0, num_local)]
    step = TPU_RAGGED_DOT_MAX_GROUPS - 1
    return [(a, min(step, num_local - a)) for a in range(0, num_local, step)]


def ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=None):
    """jax.lax.ragged_dot (differentiable by autodiff), in chunks of groups where the traced
    platform's compiler caps a ragged_dot's groups (`ragged_group_chunks`); unchanged elsewhere."""
    chunks = ragged_group_chunks(rhs_GKN.shape[0], False)
    if len(chunks) == 1:
        return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=preferred_element_type)
    out = sum(_ragged_gmm_f32(lhs_MK, rhs_GKN[a:a + n], group_sizes_G, a, True) for a, n in chunks)
    return out.astype(preferred_element_type or lhs_MK.dtype)


def _ragged_sizes(group_sizes_E, group_offset, num_local: int, sharded: bool):
    """Group sizes for ragged_dot; sharded: [rows before the local groups, local sizes...]."""
    if not sharded:
        return group_sizes_E.astype(jnp.int32)
    lo, _ = local_bounds(group_sizes_E, group_offset, num_local)
    local_G = jax.lax.dynamic_slice_in_dim(
        group_sizes_E.astype(jnp.int32), jnp.asarray(group_offset, jnp.int32), num_local
    )
    return jnp.concatenate([lo[None], local_G])


def _pad_group(rhs_GKN):
    return jnp.concatenate([jnp.zeros_like(rhs_GKN[:1]), rhs_GKN], axis=0)


def _tiles(group_sizes_E, m, group_offset, num_local, tile_rows):
    return rt.row_tiles(group_sizes_E, m, group_offset=group_offset, num_local=num_local,
                        rows_per_tile=tile_rows)


def gmm_f32(lhs_MK, rhs_GKN, group_sizes_E, *, transpose_rhs, group_offset, sharded,
            impl="ragged_dot", tile_rows=128):
    """float32 result of the grouped matmul; zero outside the local rows."""
    if impl == "row_tiles":
        lay = _tiles(group_sizes_E, lhs_MK.shape[0], group_offset, rhs_GKN.shape[0], tile_rows)
        return rt.gmm_f32(lhs_MK, rhs_GKN, lay, transpose_rhs=transpose_rhs)
    if transpose_rhs:
        rhs_GKN = jnp.swapaxes(rhs_GKN, 1, 2)
    chunks = ragged_group_chunks(rhs_GKN.shape[0], sharded)
    if len(chunks) > 1:
        return sum(_ragged_gmm_f32(lhs_MK, rhs_GKN[a:a + n], group_sizes_E, group_offset + a, True)
                   for a, n in chunks)
    return _ragged_gmm_f32(lhs_MK, rhs_GKN, group_sizes_E, group_offset, sharded)


def _ragged_gmm_f32(lhs_MK, rhs_GKN, group_sizes_E, group_offset, sharded):
    num_local = rhs_GKN.shape[0]
    sizes = _ragged_sizes(group_sizes_E, group_offset, num_local, sharded)
    if not sharded:
        return jax.lax.ragged_dot(lhs_MK, rhs_GKN, sizes, preferred_element_type=jnp.float32)
    keep_M = row_mask(lhs_MK.shape[0], group_sizes_E, group_offset, num_local)
    # Zero the foreign rows before the product: the zero group would turn inf/nan into nan.
    lhs_MK = jnp.where(keep_M[:, None], lhs_MK, jnp.zeros((), lhs_MK.dtype))
    out = jax.lax.ragged_dot(lhs_MK, _pad_group(rhs_GKN), sizes, preferred_element_type=jnp.float32)
    return jnp.where(keep_M[:, None], out, 0.0)


def gmm(lhs_MK, rhs_GKN, group_sizes_E, *, transpose_rhs, group_offset, sharded, out_dtype,
        impl="ragged_dot", tile_rows=128):
    out = gmm_f32(lhs_MK, rhs_GKN, group_sizes_E, transpose_rhs=transpose_rhs,
                  group_offset=group_offset, sharded=sharded, impl=impl, tile_rows=tile_rows)
    return out.astype(out_dtype)


def tgmm(lhs_MK, grad_MN, group_sizes_E, *, num_local, group_offset, sharded, out_dtype,
         impl="ragged_dot", tile_rows=128, acc_GKN=None):
    """[G, K, N]: per local group, lhs[rows]^T @ grad[rows] (float32 accumulation); with acc_GKN,
    that plus acc_GKN, added in float32 and rounded once (as the Pallas kernels accumulate)."""
    def finish(out_f32):
        if acc_GKN is not None:
            out_f32 = out_f32 + acc_GKN.astype(jnp.float32)
        return out_f32.astype(out_dtype)

    if impl == "row_tiles":
        lay = _tiles(group_sizes_E, lhs_MK.shape[0], group_offset, num_local, tile_rows)
        return finish(rt.tgmm_f32(lhs_MK, grad_MN, lay, num_local=num_local))
    chunks = ragged_group_chunks(num_local, sharded)
    if len(chunks) > 1:
        return jnp.concatenate([tgmm(lhs_MK, grad_MN, group_sizes_E, num_local=n, group_offset=group_offset + a,
                                     sharded=True, out_dtype=out_dtype,
                                     acc_GKN=None if acc_GKN is None else acc_GKN[a:a + n]) for a, n in chunks])
    sizes = _ragged_sizes(group_sizes_E, group_offset, num_local, sharded)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(
        lhs_MK, grad_MN, sizes, dims, preferred_element_type=jnp.float32
    )
    if sharded:
        out = out[1:]  # drop the group of rows before the local ones
    return finish(out)


def wi_fused_swiglu(x_MD, wi_GD2F, group_sizes_E, *, group_offset, sharded, tile_n_per_half, mode,
                    impl="ragged_dot", tile_rows=128):
    """(h [M, F], preact [M, 2F] in the per-tile layout for tile_n_per_half)."""
    acc = gmm_f32(x_MD, wi_GD2F, group_sizes_E, transpose_rhs=False,
                  group_offset=group_offset, sharded=sharded, impl=impl, tile_rows=tile_rows)
    f = wi_GD2F.shape[-1] // 2
    gate, up = acc[:, :f], acc[:, f:]
    h = epilogue.swiglu_fwd(gate, up, x_MD.dtype, mode)
    preact = epilogue.write_tiles(gate.astype(x_MD.dtype), up.astype(x_MD.dtype), tile_n_per_half)
    return h, preact


def wo_fused_dswiglu_dlhs(g_MD, wo_GFD, group_sizes_E, preact_M2F, *, preact_tile_n_per_half, row_scale_M,
                          out_tile_n_per_half, group_offset, sharded, mode, h_MF=None,
                          impl="ragged_dot", tile_rows=128):
    """(d[gate | up] in the layout for out_tile_n_per_half, row_dot [M] float32)."""
    u = gmm_f32(g_MD, wo_GFD, group_sizes_E, transpose_rhs=True,
                group_offset=group_offset, sharded=sharded, impl=impl, tile_rows=tile_rows)
    gate, up = epilogue.read_halves(preact_M2F, preact_tile_n_per_half)
    s_M1 = None if row_scale_M is None else row_scale_M[:, None]
    d_gate, d_up, dot_M1 = epilogue.dswiglu(u, gate, up, s_M1, mode, preact_M2F.dtype, h_MF)
    d = epilogue.write_tiles(d_gate, d_up, out_tile_n_per_half)
    if sharded:
        keep_M = row_mask(g_MD.shape[0], group_sizes_E, group_offset, wo_GFD.shape[0])
        d = jnp.where(keep_M[:, None], d, jnp.zeros((), d.dtype))
        dot_M1 = jnp.where(keep_M[:, None], dot_M1, 0.0)
    return d, dot_M1[:, 0]
