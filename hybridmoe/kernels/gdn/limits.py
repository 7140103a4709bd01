"""What the Gated DeltaNet kernels accept (pure Python, no JAX: the validation pass reads these)."""

# The chunk size gdn.cp_m_scan and gdn.cp_dh_scan are built and proven for (docs/levers.md, "Gated DeltaNet").
CP_SCAN_CHUNK_SIZE = 64
# Mosaic refuses the kernel's degenerate [1, 1] dots at chunk 1; chunks 2, 3, 4, 12, 16, 64 compile
# for a tpu7x target (tests/test_gdn_pallas.py).
PALLAS_TPU_MIN_CHUNK = 2
# Triton: power-of-two value shapes, and tl.dot wants every matmul dim >= 16.
PALLAS_GPU_MIN_DIM = 16
