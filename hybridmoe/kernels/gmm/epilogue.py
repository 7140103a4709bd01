"""SwiGLU epilogues and the pre-activation's per-tile layout, shared by every backend.

Each piece is a small module-level function that the backends look up by name at trace time, so a
test can monkeypatch one of them to build a deliberately broken variant (halves swapped, silu'
without its second term, row scale dropped, contiguous reader on the per-tile layout, reversed
tile order) and check that a test catches it.

Legend: M rows, F expert hidden width (one half), T tile width per half (tn), J = F // T tiles.

Epilogue modes:
- "float32": the fused kernels' real epilogue. Math in float32 on the float32 accumulator;
  only the stored results are rounded to the activation dtype.
- "match_unfused": a stand-in for exactness proofs. It rounds to the activation dtype exactly
  where the unfused path (a separate gmm, then `swiglu` in jnp and its autodiff VJP, with the
  routing weight applied by `scale_rows` on the down projection's input) rounds, and it runs the
  same jnp expressions, so the fused path can be bit-identical to the unfused one.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Epilogue = Literal["float32", "match_unfused"]
EPILOGUES: tuple[str, ...] = ("float32", "match_unfused")


# ---------------------------------------------------------------------------------------------
# Activation pieces (float32 math).


def sigmoid(x):
    return jax.nn.sigmoid(x)


def silu_grad(x, sig):
    """d silu(x) / dx = sig(x) (1 + x (1 - sig(x)))."""
    return sig * (1.0 + x * (1.0 - sig))


def row_scale_f32(s_M1):
    """The per-row scale as the epilogue multiplies it (float32: it is the routing weight)."""
    return s_M1.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# The unfused expressions (what the model runs when the fused levers are off). "match_unfused"
# epilogues call exactly these so their rounding points coincide.


def swiglu(gate_up_M2F):
    """silu(gate) * up on a contiguous [gate | up] row, in the input dtype (the unfused path)."""
    gate_MF, up_MF = split_halves(gate_up_M2F)
    return jax.nn.silu(gate_MF) * up_MF


def scale_rows(h_MF, s_M):
    """Rows of h times the float32 row scale, rounded back to h's dtype (the unfused path)."""
    return (h_MF.astype(jnp.float32) * s_M.astype(jnp.float32)[:, None]).astype(h_MF.dtype)


def split_halves(gate_up_M2F):
    """Contiguous [gate | up] -> (gate, up)."""
    f = gate_up_M2F.shape[-1] // 2
    return gate_up_M2F[..., :f], gate_up_M2F[..., f:]


# ---------------------------------------------------------------------------------------------
# Forward epilogue: accumulator of [gate | up] -> h.


def swiglu_fwd(gate_acc, up_acc, out_dtype, mode: Epilogue):
    """h from the float32 accumulators of the gate and up halves (any matching shapes)."""
    if mode == "float32":
        gate = gate_acc.astype(jnp.float32)
        up = up_acc.astype(jnp.float32)
        return (gate * sigmoid(gate) * up).astype(out_dtype)
    if mode == "match_unfused":
        # The unfused gmm rounds its output, then swiglu runs in that dtype.
        gate = gate_acc.astype(out_dtype)
        up = up_acc.astype(out_dtype)
        return jax.nn.silu(gate) * up
    raise ValueError(f"unknown epilogue {mode!r}; choose one of {EPILOGUES}")


# ---------------------------------------------------------------------------------------------
# Backward epilogue of the down projection's DLHS: u = g @ wo^T (float32) -> d[gate | up].


def dswiglu(u_MF, gate_MF, up_MF, s_M1, mode: Epilogue, out_dtype, h_MF=None):
    """SwiGLU backward from u (float32 accumulator) and the stored pre-activation halves.

    Returns (d_gate, d_up, row_dot) with d_* in out_dtype and row_dot [rows, 1] float32:
        d_gate = s * u * up * silu'(gate),  d_up = s * u * silu(gate),
        row_dot = <u, silu(gate) * up>     (the gradient of the row scale s).
    s_M1 is None for no row scale. h_MF: the forward's stored h, which "match_unfused" uses for
    the row dot (the unfused path dots with the stored h, whose rounding depends on how the
    forward's elementwise ops were fused; recomputing it need not give the same bits).
    """
    if mode == "float32":
        u = u_MF.astype(jnp.float32)
        gate = gate_MF.astype(jnp.float32)
        up = up_MF.astype(jnp.float32)
        sig = sigmoid(gate)
        silu = gate * sig
        row_dot = jnp.sum(u * silu * up, axis=-1, keepdims=True)
        us = u if s_M1 is None else u * row_scale_f32(s_M1)
        d_gate = us * up * silu_grad(gate, sig)
        d_up = us * silu
        return d_gate.astype(out_dtype), d_up.astype(out_dtype), row_dot
    if mode == "match_unfused":
        # Unfused: the wo gmm's DLHS output is rounded (u_r); scale_rows' VJP gives
        # dh = round(u_r * s) and ds = sum(u_r * h) in float32; swiglu's autodiff VJP in the
        # activation dtype gives d[gate | up].
        u_r = u_MF.astype(out_dtype)
        h = jax.nn.silu(gate_MF) * up_MF if h_MF is None else h_MF
        row_dot = jnp.sum(u_r.astype(jnp.float32) * h.astype(jnp.float32), axis=-1, keepdims=True)
        if s_M1 is None:
            dh = u_r
        else:
            dh = (u_r.astype(jnp.float32) * row_scale_f32(s_M1)).astype(out_dtype)
        _, vjp = jax.vjp(lambda g_, u_: jax.nn.silu(g_) * u_, gate_MF, up_MF)
        d_gate, d_up = vjp(dh)
        return d_gate, d_up, row_dot
    raise ValueError(f"unknown epilogue {mode!r}; choose one of {EPILOGUES}")


# ---------------------------------------------------------------------------------------------
# The pre-activation's per-tile layout: with a forward N tile of T per half, block j of a row
# (columns [2 T j, 2 T (j + 1))) is [gate_j | up_j]. With T = F it is the contiguous [gate | up].


def tile_order(num_tiles: int) -> list[int]:
    """Which forward tile each stored block holds, in storage order, as readers assume it."""
    return list(range(num_tiles))


def read_tile(preact_block, j: int, tile_n_per_half: int):
    """(gate_j, up_j) from a row block of the per-tile layout; the block holds all J tiles.

    preact_block [..., 2F]; returns two [..., T] slices. Static slices: the kernels call this
    inside their epilogue on a VMEM block.
    """
    t = tile_n_per_half
    b = tile_order(preact_block.shape[-1] // (2 * t)).index(j)
    return preact_block[..., 2 * t * b : 2 * t * b + t], preact_block[..., 2 * t * b + t : 2 * t * (b + 1)]


def read_halves(preact_M2F, tile_n_per_half: int):
    """(gate [M, F], up [M, F]) from the per-tile layout (the reader every consumer uses)."""
    f = preact_M2F.shape[-1] // 2
    t = f if tile_n_per_half is None else tile_n_per_half
    pieces = [read_tile(preact_M2F, j, t) for j in range(f // t)]
    gate = jnp.concatenate([p[0] for p in pieces], axis=-1) if len(pieces) > 1 else pieces[0][0]
    up = jnp.concatenate([p[1] for p in pieces], axis=-1) if len(pieces) > 1 else pieces[0][1]
    return gate, up


def tile_columns(f: int, tile_n_per_half: int):
    """Where a writer puts tile j of each half: (the half's columns, the gate tile's first stored
    column, the up tile's first stored column) per tile, in the layout's definition (block j holds
    tile j; kernels that store tile by tile use this, write_tiles is its array form)."""
    t = tile_n_per_half
    return [(slice(j * t, (j + 1) * t), 2 * t * j, 2 * t * j + t) for j in range(f // t)]


def dswiglu_store(u_MF, pre_block, scale, h, *, mode: Epilogue, pre_dtype, f: int, tile_in: int, tile_out: int,
                  store_d, store_dot):
    """The fused down-projection DLHS epilogue of one row tile, as both Pallas backends run it: the
    SwiGLU VJP of u = g @ wo^T against the stored pre-activation (layout of tile_in), written in
    the layout of tile_out through store_d(values [rows, tile_out], first column) and
    store_dot(row_dot [rows, 1])."""
    gate, up = read_halves(pre_block, tile_in)
    d_gate, d_up, dot = dswiglu(u_MF, gate, up, scale, mode, pre_dtype, h)
    for cols, gate_at, up_at in tile_columns(f, tile_out):
        store_d(d_gate[:, cols], gate_at)
        store_d(d_up[:, cols], up_at)
    store_dot(dot)


def write_tiles(gate_MF, up_MF, tile_n_per_half: int | None):
    """Contiguous halves -> the per-tile layout [M, 2F] (inverse of read_halves)."""
    f = gate_MF.shape[-1]
    t = f if tile_n_per_half is None else tile_n_per_half
    nt = f // t
    blocks = []
    # The writer is the layout's definition (block j holds tile j); only readers consult
    # tile_order, so a reader with the wrong order disagrees with every writer.
    for j in range(nt):
        blocks += [gate_MF[..., j * t : (j + 1) * t], up_MF[..., j * t : (j + 1) * t]]
    return jnp.concatenate(blocks, axis=-1)
