"""Public grouped matmuls with custom VJPs: gmm, tgmm, wi_fused_swiglu, wo_fused_dswiglu.

Legend: M rows (tokens x top-k, sorted by group), K contraction, N output columns, E groups in
group_sizes (global experts), G groups held locally (the weight's leading dim), D model width,
F expert hidden width (one half of the fused [gate | up]), T forward N tile per half.

Common contract:
- Rows are sorted by group: group e owns rows [sum(sizes[:e]), sum(sizes[:e + 1])). Rows past
  sum(group_sizes) are padding: zero output, zero gradient.
- group_sizes [E] int32 covers every global group; the weight holds the G groups
  [group_offset, group_offset + G) (G = E and offset 0 unless experts are sharded). Rows of other
  groups produce zeros and get zero gradient. group_offset is a Python int or a traced scalar.
- Empty groups contribute nothing; their weight gradient is zero.
- Accumulation is float32; outputs are in the activation dtype unless preferred_element_type.
- backend: "xla" (any platform), "pallas_tpu" (Mosaic TPU), "pallas_gpu" (Triton).
  The Pallas backends run on CPU with interpret=True (tests).
- tiling / dlhs_tiling / drhs_tiling (Pallas backends): the tiles of the forward kernel, of the input
  gradient's and of the weight gradient's (None = the forward's): each grouped matmul of the MoE
  layer has its own (tiling.KernelTiles).
- weight_out (gmm, wi_fused_swiglu, wo_fused_dswiglu): also return the weight itself, as the last
  output. The weight's gradient is then added into that output's cotangent (the weight-gradient
  kernel's accumulator starts from it, in place on the Pallas backends), so a loop that carries the
  cotangent (moe.token_chunks' backward) sums the weight's gradient over its trips with no
  per-trip [G, K, N] buffer besides the carried one.
- xla_impl (xla backend): "ragged_dot" (jax.lax.ragged_dot) or "row_tiles" (one batched matmul
  over group-aligned tiles of xla_tile_rows rows; row_tiles.py). `xla_impl_for` is the one place
  that picks it per platform.
"""

from __future__ import annotations

import importlib
from typing import Literal

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from hybridmoe.kernels.gmm import epilogue as epi
from hybridmoe.kernels.gmm.tiling import Tiling
from hybridmoe.kernels.platform import trace_platform

Backend = Literal["xla", "pallas_tpu", "pallas_gpu"]
BACKENDS: tuple[str, ...] = ("xla", "pallas_tpu", "pallas_gpu")
XLA_IMPLS: tuple[str, ...] = ("ragged_dot", "row_tiles")


def xla_impl_for(choice: str = "auto", platform: str | None = None) -> str:
    """The xla backend's grouped matmul: `choice`, or for "auto" the platform's own.

    CPU: row tiles (ragged_dot there computes every group for every row: at 16 groups 13x the
    useful FLOPs). GPU/TPU: ragged_dot, which XLA lowers to grouped kernels. The platform is the
    traced program's (`trace_platform`: a compile-only TPU target's mesh is TPU on a CPU host,
    where row tiles would gather a weight copy per tile: 44 GiB a layer at the 397B cell).
    """
    if choice != "auto":
        if choice not in XLA_IMPLS:
            raise ValueError(f"unknown xla grouped matmul {choice!r}; choose auto or one of {XLA_IMPLS}")
        return choice
    return "row_tiles" if (platform or trace_platform()) == "cpu" else "ragged_dot"


def backend_module(name: str):
    """The module of a grouped-matmul backend (xla, pallas_tpu, pallas_gpu), imported when first
    asked for (the Pallas ones import Pallas)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown gmm backend {name!r}; choose one of {BACKENDS}")
    return importlib.import_module(f"hybridmoe.kernels.gmm.{name}")


def _sharded(group_sizes_E, num_local: int, group_offset) -> bool:
    """Static: does the local weight hold fewer than all groups (or sit at a traced offset)?"""
    literal_zero = isinstance(group_offset, int) and group_offset == 0
    return group_sizes_E.shape[0] != num_local or not literal_zero


def _check(lhs, rhs, group_sizes, k_axis: int):
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"gmm wants lhs [M, K] and rhs [G, K, N]; got {lhs.shape}, {rhs.shape}")
    if lhs.shape[1] != rhs.shape[k_axis]:
        raise ValueError(f"contraction mismatch: lhs {lhs.shape}, rhs {rhs.shape}")
    if group_sizes.ndim != 1 or group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32 [E]; got {group_sizes.dtype}{group_sizes.shape}")
    if group_sizes.shape[0] < rhs.shape[0]:
        raise ValueError(f"rhs holds {rhs.shape[0]} groups but group_sizes has {group_sizes.shape[0]}")


def _kw(backend, tiling, interpret, xla_impl, xla_tile_rows):
    if backend == "xla":
        return dict(impl=xla_impl, tile_rows=xla_tile_rows)
    return dict(tiling=tiling, interpret=interpret)


def _role_kws(backend, tiling, dlhs_tiling, drhs_tiling, interpret, xla_impl, xla_tile_rows):
    """The backend keywords of the forward, input-gradient and weight-gradient kernels (each its
    own tiles; None = the forward's)."""
    return tuple(_kw(backend, t, interpret, xla_impl, xla_tile_rows)
                 for t in (tiling, dlhs_tiling or tiling, drhs_tiling or tiling))


# ---------------------------------------------------------------------------------------------
# gmm / tgmm


def tgmm(lhs_MK, grad_MN, group_sizes_E, *, num_local: int | None = None, group_offset=0,
         backend: Backend = "xla", tiling: Tiling | None = None, interpret: bool = False,
         preferred_element_type=None, xla_impl: str = "ragged_dot", xla_tile_rows: int = 128, acc=None):
    """[G, K, N]: out[g] = lhs[rows of group offset+g]^T @ grad[same rows] (no VJP: a gradient).
    acc [G, K, N]: return acc + that instead, summed in the float32 accumulator and rounded once
    (the Pallas kernels write it into acc's buffer)."""
    num_local = group_sizes_E.shape[0] if num_local is None else num_local
    sharded = _sharded(group_sizes_E, num_local, group_offset)
    return _weight_grad(backend_module(backend), lhs_MK, grad_MN, group_sizes_E, num_local=num_local,
                        off=group_offset, sharded=sharded, out_dtype=preferred_element_type or lhs_MK.dtype,
                        kw=_kw(backend, tiling, interpret, xla_impl, xla_tile_rows), acc=acc)


def _weight_grad(be, lhs, grad, sizes, *, num_local, off, sharded, out_dtype, kw, acc=None):
    """The backend's tgmm(lhs, grad), added into acc (None or a symbolic zero: nothing to add)."""
    if isinstance(acc, SymbolicZero):
        acc = None
    return be.tgmm(lhs, grad, sizes, num_local=num_local, group_offset=off, sharded=sharded,
                   out_dtype=out_dtype, acc_GKN=acc, **kw)


def gmm(lhs_MK, rhs_GKN, group_sizes_E, *, transpose_rhs: bool = False, group_offset=0,
        backend: Backend = "xla", tiling: Tiling | None = None, interpret: bool = False,
        preferred_element_type=None, xla_impl: str = "ragged_dot", xla_tile_rows: int = 128,
        dlhs_tiling: Tiling | None = None, drhs_tiling: Tiling | None = None, weight_out: bool = False):
    """[M, N]: out[r] = lhs[r] @ rhs[group(r) - offset]  (rhs [G, N, K] with transpose_rhs);
    with weight_out, (out, rhs) (module docstring).

    Differentiable in lhs and rhs: DLHS = gmm(g, rhs, transpose_rhs=not transpose_rhs),
    DRHS = tgmm(lhs, g) (or tgmm(g, lhs) with transpose_rhs).
    """
    _check(lhs_MK, rhs_GKN, group_sizes_E, 2 if transpose_rhs else 1)
    be = backend_module(backend)
    sharded = _sharded(group_sizes_E, rhs_GKN.shape[0], group_offset)
    out_dtype = preferred_element_type or lhs_MK.dtype
    kw, dlhs_kw, drhs_kw = _role_kws(backend, tiling, dlhs_tiling, drhs_tiling, interpret, xla_impl,
                                     xla_tile_rows)

    def run(lhs, rhs, sizes, off, transpose, dtype, kw):
        return be.gmm(lhs, rhs, sizes, transpose_rhs=transpose, group_offset=off,
                      sharded=sharded, out_dtype=dtype, **kw)

    @jax.custom_vjp
    def f(lhs, rhs, sizes, off):
        out = run(lhs, rhs, sizes, off, transpose_rhs, out_dtype, kw)
        return (out, rhs) if weight_out else out

    def fwd(lhs, rhs, sizes, off):
        return f(lhs, rhs, sizes, off), (lhs, rhs, sizes, off)

    def bwd(res, cts):
        lhs, rhs, sizes, off = res
        g_MN, acc = cts if weight_out else (cts, None)
        dlhs = run(g_MN, rhs, sizes, off, not transpose_rhs, lhs.dtype, dlhs_kw)
        a, b = (g_MN, lhs) if transpose_rhs else (lhs, g_MN)
        drhs = _weight_grad(be, a, b, sizes, num_local=rhs.shape[0], off=off, sharded=sharded,
                            out_dtype=rhs.dtype, kw=drhs_kw, acc=acc)
        return dlhs, drhs, None, None

    f.defvjp(fwd, bwd)
    return f(lhs_MK, rhs_GKN, group_sizes_E, jnp.asarray(group_offset, jnp.int32))


# ---------------------------------------------------------------------------------------------
# The fused SwiGLU pair


def _tile(f: int, tile_n_per_half: int | None) -> int:
    t = f if tile_n_per_half is None else int(tile_n_per_half)
    if t <= 0 or f % t:
        raise ValueError(f"tile_n_per_half={t} must divide F={f}")
    return t


def preact_to_contiguous(preact_M2F, f: int, tile_n_per_half: int | None):
    """The per-tile layout [M, 2F] -> contiguous [gate | up] (identity when the tile is F)."""
    t = _tile(f, tile_n_per_half)
    if t == f:
        return preact_M2F
    gate, up = epi.read_halves(preact_M2F, t)
    return jnp.concatenate([gate, up], axis=-1)


def split_preact(preact_M2F, f: int, tile_n_per_half: int | None):
    """(gate [M, F], up [M, F]) from the per-tile layout."""
    return epi.read_halves(preact_M2F, _tile(f, tile_n_per_half))


def contiguous_to_preact(gate_up_M2F, tile_n_per_half: int | None):
    """Contiguous [gate | up] -> the per-tile layout (the forward kernel's store order)."""
    gate, up = epi.split_halves(gate_up_M2F)
    return epi.write_tiles(gate, up, tile_n_per_half)


def wi_fused_swiglu(x_MD, wi_GD2F, group_sizes_E, *, return_preact: bool = False,
                    tile_n_per_half: int | None = None, group_offset=0, backend: Backend = "xla",
                    tiling: Tiling | None = None, interpret: bool = False,
                    epilogue: epi.Epilogue = "float32", rhs_buffer_count: int = 0,
                    xla_impl: str = "ragged_dot", xla_tile_rows: int = 128,
                    dlhs_tiling: Tiling | None = None, drhs_tiling: Tiling | None = None,
                    weight_out: bool = False):
    """The up projection with SwiGLU in its epilogue: h = silu(gate) * up, gate|up = x @ wi.
    Returns h, (h, preact) with return_preact, and wi last with weight_out (module docstring).

    wi [G, D, 2F] is the prefused [gate | up] weight (gate = columns [:F], up = [F:]). Math in
    float32 on the accumulator; h (and preact) in x's dtype.

    return_preact: also return the pre-activation [M, 2F] in the kernel's store layout: with
    T = tile_n_per_half (default F), block j of a row is [gate_j | up_j] ("per-tile concat";
    with T = F it is the contiguous [gate | up]). Read it back with split_preact /
    preact_to_contiguous. Its cotangent is in the same layout (autodiff semantics).

    Backward: d[gate | up] = (SwiGLU VJP of the h cotangent, skipped when that cotangent is a
    symbolic zero, as it is behind wo_fused_dswiglu) + (the preact cotangent, made contiguous);
    dx = gmm(d, wi^T), dwi = tgmm(x, d).

    rhs_buffer_count: the weight's pipeline depth in the fused forward kernel (Pallas only;
    0 = default; applied only when the kernel runs one K tile).
    epilogue: "float32" (real) or "match_unfused" (rounds where gmm + swiglu would).
    """
    _check(x_MD, wi_GD2F, group_sizes_E, 1)
    if wi_GD2F.shape[2] % 2:
        raise ValueError(f"wi's last dim must be 2F; got {wi_GD2F.shape}")
    f = wi_GD2F.shape[2] // 2
    t = _tile(f, tile_n_per_half)
    be = backend_module(backend)
    sharded = _sharded(group_sizes_E, wi_GD2F.shape[0], group_offset)
    kw, dlhs_kw, drhs_kw = _role_kws(backend, tiling, dlhs_tiling, drhs_tiling, interpret, xla_impl,
                                     xla_tile_rows)
    fwd_kw = dict(kw, rhs_buffer_count=rhs_buffer_count) if backend != "xla" else kw

    @jax.custom_vjp
    def f_(x, wi, sizes, off):
        h, preact = be.wi_fused_swiglu(x, wi, sizes, group_offset=off, sharded=sharded, tile_n_per_half=t,
                                       mode=epilogue, **fwd_kw)
        return (h, preact, wi) if weight_out else (h, preact)

    def fwd(x, wi, sizes, off):
        x, wi, sizes, off = (a.value for a in (x, wi, sizes, off))
        out = f_(x, wi, sizes, off)
        return out, (x, wi, out[1], sizes, off)

    def bwd(res, cts):
        x, wi, preact, sizes, off = res
        ct_h, ct_pre, acc = cts if weight_out else (*cts, None)
        parts = []
        if not isinstance(ct_h, SymbolicZero):
            # The activation's VJP, only when h itself is consumed by something differentiable.
            gate, up = epi.read_halves(preact, t)
            d_gate, d_up, _ = epi.dswiglu(ct_h.astype(jnp.float32), gate, up, None, epilogue,
                                          preact.dtype)
            parts.append(jnp.concatenate([d_gate, d_up], axis=-1))
        if not isinstance(ct_pre, SymbolicZero):
            parts.append(preact_to_contiguous(ct_pre, f, t).astype(preact.dtype))
        if not parts:
            return None, (None if isinstance(acc, SymbolicZero) else acc), None, None
        d = parts[0] if len(parts) == 1 else (parts[0].astype(jnp.float32) + parts[1]).astype(
            preact.dtype)
        dx = be.gmm(d, wi, sizes, transpose_rhs=True, group_offset=off, sharded=sharded,
                    out_dtype=x.dtype, **dlhs_kw)
        dwi = _weight_grad(be, x, d, sizes, num_local=wi.shape[0], off=off, sharded=sharded,
                           out_dtype=wi.dtype, kw=drhs_kw, acc=acc)
        return dx, dwi, None, None

    f_.defvjp(fwd, bwd, symbolic_zeros=True)
    h, preact, *wi_out = f_(x_MD, wi_GD2F, group_sizes_E, jnp.asarray(group_offset, jnp.int32))
    return (h, preact, *wi_out) if return_preact else (h, *wi_out) if weight_out else h


def wo_fused_dswiglu(h_MF, wo_GFD, group_sizes_E, *, preact, preact_tile_n_per_half: int | None,
                     row_scale=None, with_row_dot: bool | None = None, group_offset=0,
                     backend: Backend = "xla", tiling: Tiling | None = None, interpret: bool = False,
                     epilogue: epi.Epilogue = "float32", xla_impl: str = "ragged_dot",
                     xla_tile_rows: int = 128, dlhs_tiling: Tiling | None = None,
                     drhs_tiling: Tiling | None = None, weight_out: bool = False):
    """The down projection y = (s * h) @ wo per group, whose backward fuses the SwiGLU VJP;
    with weight_out, (y, wo) (module docstring).

    Forward: y = gmm(scale_rows(h, s), wo) with scale_rows(h, s) = round_to_h_dtype(h * s)
    (float32 multiply), exactly as the unfused path computes it; s = row_scale [M] (float32,
    the routing weight) or None.

    Contract (the fused pair): h must be swiglu(preact) from wi_fused_swiglu(..., return_preact=True)
    and preact must be passed in that call's layout, with preact_tile_n_per_half its
    tile_n_per_half. The backward's DLHS computes u = g @ wo^T per group with a float32
    accumulator and, in its epilogue, from the stored [gate | up]:
        d_gate = s * u * up * silu'(gate),  d_up = s * u * silu(gate),
        silu'(x) = sig(x) (1 + x (1 - sig(x))),   row_dot = <u, silu(gate) * up>.
    Cotangents returned:  h -> zero (symbolic: wi_fused_swiglu then never builds the activation VJP),
    preact -> d[gate | up] in preact's layout (contiguous when the tile is F), row_scale ->
    row_dot (with_row_dot; default: whenever row_scale is given; False treats s as a
    constant), wo -> tgmm(scale_rows(h, s), g). The gradient thus reaches x and wi through
    preact and the routing weight through row_dot. Differentiating h by any other route than
    preact is outside the contract (its gradient would be lost).

    epilogue: "float32" (real) or "match_unfused" (rounds u, s * u and the activation VJP in the
    activation dtype, exactly as gmm + swiglu + scale_rows under autodiff do).
    """
    _check(h_MF, wo_GFD, group_sizes_E, 1)
    f = wo_GFD.shape[1]
    if preact.shape != (h_MF.shape[0], 2 * f):
        raise ValueError(f"preact must be [M, 2F] = {(h_MF.shape[0], 2 * f)}; got {preact.shape}")
    t = _tile(f, preact_tile_n_per_half)
    if with_row_dot is None:
        with_row_dot = row_scale is not None
    if with_row_dot and row_scale is None:
        raise ValueError("with_row_dot needs row_scale: the dot is the row scale's gradient")
    be = backend_module(backend)
    sharded = _sharded(group_sizes_E, wo_GFD.shape[0], group_offset)
    kw, dlhs_kw, drhs_kw = _role_kws(backend, tiling, dlhs_tiling, drhs_tiling, interpret, xla_impl,
                                     xla_tile_rows)

    def forward(h, wo, s, sizes, off):
        lhs = h if s is None else epi.scale_rows(h, s)
        y = be.gmm(lhs, wo, sizes, transpose_rhs=False, group_offset=off, sharded=sharded,
                   out_dtype=h.dtype, **kw)
        return lhs, ((y, wo) if weight_out else y)

    @jax.custom_vjp
    def f_(h, wo, pre, s, sizes, off):
        del pre
        return forward(h, wo, s, sizes, off)[1]

    def fwd(h, wo, pre, s, sizes, off):
        lhs, out = forward(h, wo, s, sizes, off)
        # Only the match_unfused stand-in keeps h: its row dot uses the stored h, as unfused does.
        h_res = h if (epilogue == "match_unfused" and s is not None) else None
        return out, (lhs, wo, pre, s, h_res, sizes, off)

    def bwd(res, cts):
        lhs, wo, pre, s, h_res, sizes, off = res
        g_MD, acc = cts if weight_out else (cts, None)
        d, row_dot = be.wo_fused_dswiglu_dlhs(
            g_MD, wo, sizes, pre, preact_tile_n_per_half=t, row_scale_M=s,
            out_tile_n_per_half=t, group_offset=off, sharded=sharded, mode=epilogue,
            h_MF=h_res, **dlhs_kw)
        dwo = _weight_grad(be, lhs, g_MD, sizes, num_local=wo.shape[0], off=off, sharded=sharded,
                           out_dtype=wo.dtype, kw=drhs_kw, acc=acc)
        ds = None
        if s is not None:
            ds = row_dot.astype(s.dtype) if with_row_dot else jnp.zeros_like(s)
        return None, dwo, d, ds, None, None

    f_.defvjp(fwd, bwd)
    return f_(h_MF, wo_GFD, preact, row_scale, group_sizes_E, jnp.asarray(group_offset, jnp.int32))
