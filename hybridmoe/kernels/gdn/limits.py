"""What the Gated DeltaNet kernels accept (pure Python, no JAX: the validation pass reads these)."""

# The chunk size gdn.cp_m_scan and gdn.cp_dh_scan are built and proven for (docs/levers.md, "Gated DeltaNet").
CP_SCAN_CHUNK_SIZE = 64
# Mosaic refuses the kernel's degenerate [1, 1] dots at chunk 1; chunks 2, 3, 4, 12, 16, 64 compile
# for a tpu7x target (tests/test_gdn_pallas.py).
PALLAS_TPU_MIN_CHUNK = 2
# Triton: power-of-two value shapes, and tl.dot wants every matmul dim >= 16.
PALLAS_GPU_MIN_DIM = 16

# ---------------------------------------------------------------------------------------------
# On-chip memory of the Mosaic GDN kernels (kernels/vmem.py), as pallas_tpu.py builds their blocks:
# one chunk of one (batch, value head) per grid step, the [K, V] state resident in scratch, and the
# float32 values of the chunk's math (pallas_chunk.chunk_step): the forward's [C, C] decay, lower-
# triangular, inverse and q k^T matrices, [C, K] and [K, V] products; the backward (a jax.vjp of the
# chunk around the substitution loop) holds many more. The counts are an upper bound fitted to the
# compiler's smallest accepted limit on tpu7x at (C, K, V) = (64, 128, 128), (128, 128, 128),
# (64, 256, 256), (128, 256, 256): forward 0 to 480 KiB over it, backward 24 to 500 KiB.

KERNELS = ("gdn_chunk_forward", "gdn_chunk_backward")


def tpu_buffers(kernel: str, *, chunk_size: int, key_dim: int, value_dim: int, itemsize: int = 4):
    """The VMEM buffers of one Mosaic GDN kernel (KERNELS); itemsize: the chunk inputs' (float32)."""
    from hybridmoe.kernels.vmem import Buffer

    C, K, V = chunk_size, key_dim, value_dim
    chunk = [Buffer("q", (C, K), itemsize), Buffer("k", (C, K), itemsize), Buffer("v", (C, V), itemsize),
             Buffer("g_column", (C, 1), 4), Buffer("g_row", (1, C), 4), Buffer("beta", (C, 1), 4),
             Buffer("starts_column", (C, 1), 4), Buffer("starts_row", (1, C), 4)]
    counts = (4, 4, 2) if kernel == "gdn_chunk_forward" else (32, 12, 6)  # [C, C], [C, K], [K, V]
    values = [Buffer("c_by_c", (C, C), 4, counts[0], "value"), Buffer("c_by_k", (C, K), 4, counts[1], "value"),
              Buffer("k_by_v", (K, V), 4, counts[2], "value")]
    state = Buffer("state", (K, V), 4, 1, "scratch")
    if kernel == "gdn_chunk_forward":
        return [*chunk, Buffer("initial", (K, V), 4), Buffer("o", (C, V), 4), Buffer("chunk_start", (K, V), 4),
                Buffer("final", (K, V), 4), state, *values]
    if kernel == "gdn_chunk_backward":
        grads = [Buffer("d" + b.what, b.shape, 4) for b in chunk[:6]]
        return [*chunk, Buffer("chunk_start", (K, V), 4), Buffer("do", (C, V), 4), Buffer("d_final", (K, V), 4),
                *grads, Buffer("d_initial", (K, V), 4), state, *values]
    raise ValueError(f"unknown GDN kernel {kernel!r}; choose one of {KERNELS}")


def vmem_needs(limit_mib: float = 0.0, **dims) -> dict:
    """Per GDN kernel, its VMEM need against the scoped limit (0 = the compiler's default)."""
    from hybridmoe.kernels.vmem import MIB, Need, tpu_bytes, tpu_limit_mib

    needs = {k: tpu_bytes(tpu_buffers(k, **dims)) for k in KERNELS}
    return {k: Need(k, need, int(tpu_limit_mib(limit_mib, need) * MIB)) for k, need in needs.items()}
