"""What the Gated DeltaNet kernels accept (pure Python, no JAX: the validation pass reads these)."""

# The chunk size gdn.cp_m_scan and gdn.cp_dh_scan are built and proven for (docs/levers.md, "Gated DeltaNet").
CP_SCAN_CHUNK_SIZE = 64
# The validator's floor for pallas_tpu. The chunk-parallel kernels compile down to chunk 1 for a
# tpu7x target (checked by hand; the earlier per-chunk kernel's [1, 1] dots did not lower); the
# floor stays at 2 all the same (tests/test_gdn_tpu_compile.py compiles chunk 2): a chunk of one
# token is the token recurrence, with no intra-chunk work to put on the MXU.
# The checkpoint name of the start states and inverses the Mosaic core saves for its backward
# (pallas_tpu._core_fwd; remat.save), here so the validator reads it without importing the kernel.
RESIDUALS_NAME = "gdn_core_residuals"
PALLAS_TPU_MIN_CHUNK = 2
# Triton: power-of-two value shapes, and tl.dot wants every matmul dim >= 16.
PALLAS_GPU_MIN_DIM = 16

# kernels.gdn.backend=auto on each platform: on a TPU the chunk-parallel Mosaic core, which a v5e chip
# timed at 4.4x the XLA path forward + backward at the seed cell's per-device layer (docs/tpu.md,
# benchmarks/records/tpu_kernels.json gdn_cell); elsewhere the XLA path (pallas_gpu joins once it
# has run and been timed on a GPU).
_AUTO = {"tpu": "pallas_tpu"}


def resolve(choice: str, platform: str, chunk_size: int) -> str:
    """The core `choice` names on `platform` (jax platform names) at gdn.chunk_size `chunk_size`:
    auto never picks a Pallas core the chunk size rules out."""
    if choice != "auto":
        return choice
    backend = _AUTO.get(platform, "xla")
    return "xla" if backend == "pallas_tpu" and chunk_size < PALLAS_TPU_MIN_CHUNK else backend

# ---------------------------------------------------------------------------------------------
# Grid steps of the Mosaic GDN kernels (pallas_tpu.py): each holds one key head, its `group` value
# heads and `chunks_per_step` chunks, all unrolled in one basic block.

# Value heads x chunks per grid step by default: enough independent chains for the scheduler to
# overlap one head's serial products with another's, few enough that the body compiles in seconds.
# The v5e measured 4 and 16 beside 8 (tpu_kernels.json, chip_cases' gdn arms): at the 397B cell's
# layer 1.045x slower and 1.015x faster, at the one-chip layer 1.023x slower and within noise.
HEAD_CHUNKS_PER_STEP = 8


def default_chunks_per_step(chunk_size: int, group: int, chunks: int | None = None) -> int:
    """Chunks per grid step: about HEAD_CHUNKS_PER_STEP chunk-heads (no more than the sequence's
    `chunks`), and a step's tokens a multiple of 16 (a bfloat16 block's sublane tile)."""
    n = max(1, HEAD_CHUNKS_PER_STEP // group)
    if chunks is not None:
        n = max(1, min(n, chunks))
    while (n * chunk_size) % 16:
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# On-chip memory of the Mosaic GDN kernels (kernels/vmem.py), as pallas_tpu.py builds their blocks,
# and the float32 values of their bodies (tpu_chunk.py) that the compiler keeps in the same scoped
# VMEM: a base set plus one per further chunk-head unrolled in the step, counted in [C, C],
# [C, max(K, V)] and [K, V] float32 arrays. The counts are the tightest upper bound of the
# compiler's smallest accepted limit (v5e) at (C, K, V, group, chunks per step, v's itemsize) =
# (64|128|256, 128|256, 128|256, 1, 1, 4), (64, 128, 128, 1, 2, 4), (64, 128, 128, 2, 1, 4),
# (64, 128, 128, 4, 2, 4|2), (64, 128, 128, 2, 4, 2): the forward within 1.8 MiB above it, the
# backward within 2.2 MiB (tests/test_vmem_tpu_compile.py checks the verdicts at a small limit,
# tests/test_gdn_tpu_compile.py that the cell compiles at the modelled need). Measured at the 397B
# cell's (64, 128, 128, 4, 2, bf16): forward 4.7 MiB, backward 9.1 MiB.

KERNELS = ("gdn_chunk_forward", "gdn_chunk_backward")
# The context-parallel shard's pass 1 and local state cotangent on the same layout (pallas_tpu_cp.py).
CP_KERNELS = ("gdn_cp_transition", "gdn_cp_local_cotangent")


def tpu_buffers(kernel: str, *, chunk_size: int, key_dim: int, value_dim: int, group: int = 1,
                chunks_per_step: int | None = None, itemsize: int = 4):
    """The VMEM buffers of one Mosaic GDN kernel (KERNELS), the forward as a gradient runs it (it
    writes the backward's residuals); itemsize: v's, the output's and q's and k's rows' (the inputs'
    dtype; their cotangents are float32)."""
    from hybridmoe.kernels.vmem import Buffer

    if kernel not in KERNELS + CP_KERNELS:
        raise ValueError(f"unknown GDN kernel {kernel!r}; choose one of {KERNELS + CP_KERNELS}")
    C, K, V, H = chunk_size, key_dim, value_dim, group
    n = chunks_per_step or default_chunks_per_step(C, H)
    tokens = n * C
    inputs = [Buffer("q", (tokens, K), itemsize), Buffer("q_scale", (n, 1, C), 4), Buffer("k", (tokens, K), itemsize),
              Buffer("k_scale", (n, 1, C), 4), Buffer("v", (H, tokens, V), itemsize),
              Buffer("log_gates", (n, H, C), 4), Buffer("beta", (n, H, C), 4)]
    residuals = [Buffer("chunk_starts", (n * H, K, V), 4), Buffer("inverses", (n * H, C, C), 4)]
    state = Buffer("state", (H, K, V), 4, 1, "scratch")
    base, per_chunk_head = _VALUE_COUNTS[kernel]
    counts = [b + (H * n - 1) * p for b, p in zip(base, per_chunk_head)]
    values = [Buffer("c_by_c", (C, C), 4, counts[0], "value"), Buffer("c_by_k", (C, max(K, V)), 4, counts[1], "value"),
              Buffer("k_by_v", (K, V), 4, counts[2], "value")]
    if kernel == "gdn_chunk_forward":
        return [*inputs, Buffer("initial", (H, K, V), 4), Buffer("o", (H, tokens, V), itemsize),
                Buffer("final", (H, K, V), 4), *residuals, state, *values]
    if kernel == "gdn_chunk_backward":
        grads = [Buffer("dq", (tokens, K), 4), Buffer("dk", (tokens, K), 4), Buffer("dv", (H, tokens, V), itemsize),
                 Buffer("dlog_gates", (n, H, C), 4), Buffer("dbeta", (n, H, C), 4)]
        return [*inputs, *residuals, Buffer("do", (H, tokens, V), itemsize), Buffer("d_final", (H, K, V), 4),
                *grads, Buffer("d_initial", (H, K, V), 4), state, *values]
    if kernel == "gdn_cp_transition":  # no q: k, v and the gates in; S_ext and M_r out, both carried
        product = Buffer("product", (H, K, K), 4, 1, "scratch")
        return [*inputs[2:], Buffer("end_state", (H, K, V), 4), Buffer("transition", (H, K, K), 4), state, product,
                *values]
    # gdn_cp_local_cotangent: q, k, the gates, the inverses and dO in; dS_loc out
    return [*inputs[:4], *inputs[5:], residuals[1], Buffer("do", (H, tokens, V), itemsize),
            Buffer("d_local", (H, K, V), 4), state, *values]


# ([C, C], [C, max(K, V)], [K, V]) float32 values live at once: the base, and per further chunk-head
# of the step (fitted; see above). The forward's base refitted to the tpu7x compiler after its doubling
# took half the rows at levels of 8 and more (compiled needs 1.13, 2.15, 3.87 and 8.26 MiB at the sweep's
# (C, K, V) = (64, 128, 128), (128, 128, 128), (128, 256, 256), (256, 256, 256); the model 1.31, 2.16,
# 3.97, 8.56): the [C, C] terms, not [C, K] ones, are what it keeps live.
_VALUE_COUNTS = {"gdn_chunk_forward": ((17, 0, 0), (0, 0, 5)), "gdn_chunk_backward": ((0, 20, 9), (5, 11, 5))}
# Not fitted on a compiler: each CP kernel's body is a part of the chunk kernel's it takes its count
# from (the transition: the forward's terms and chain, one more [K, K] chain in place of the outputs;
# the local cotangent: the backward's terms and chain without its input cotangents), so those counts
# bound them from above.
_VALUE_COUNTS.update({"gdn_cp_transition": _VALUE_COUNTS["gdn_chunk_forward"],
                      "gdn_cp_local_cotangent": _VALUE_COUNTS["gdn_chunk_backward"]})


def vmem_needs(limit_mib: float = 0.0, **dims) -> dict:
    """Per GDN kernel, its VMEM need against the scoped limit it compiles under (0: `auto`, the
    compiler's default where the need fits it; kernels/vmem.py)."""
    from hybridmoe.kernels.vmem import MIB, Need, tpu_bytes, tpu_limit_mib

    needs = {k: tpu_bytes(tpu_buffers(k, **dims)) for k in KERNELS}
    return {k: Need(k, need, int(tpu_limit_mib(limit_mib, need) * MIB)) for k, need in needs.items()}


def token_major_blocks_fit(key_heads: int, group: int, key_dim: int, value_dim: int, interpret: bool) -> str | None:
    """Why a token-major block of a key head's columns cannot be a Mosaic block (its width must be a
    multiple of 128 lanes or the array's whole width), else None; interpreted, every width fits."""
    if interpret or key_heads == 1:
        return None
    bad = [f"{name} {width}" for name, width in (("key dim", key_dim), ("value heads per key head x value dim",
                                                                         group * value_dim)) if width % 128]
    return f"{' and '.join(bad)} not a multiple of 128 lanes" if bad else None
