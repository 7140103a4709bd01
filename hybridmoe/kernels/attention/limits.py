"""What the attention cores accept, and which one `auto` is on each platform (pure Python, no JAX:
the validation pass reads these, and the model resolves its core with the same functions).

Cores (the config key kernels.attention.backend):
  xla         flash attention in plain XLA ops (ops.flash_attention, backend xla): blocked online
              softmax, fully masked block pairs skipped; any platform;
  blocked     the masked XLA core (xla.attention) over query blocks that skip the key blocks after
              them (blocked.py; self-attention only: under context parallelism it is the masked
              core over all the gathered keys); any platform;
  pallas_tpu  flash attention, Mosaic TPU kernels (pallas_tpu.py);
  pallas_gpu  flash attention, Triton kernels (pallas_gpu.py).
The Pallas ones run on CPU with kernels.interpret=true.

`auto` is pallas_tpu on TPU and `xla` elsewhere, GPUs included: the Triton kernels (pallas_gpu,
opt-in) have not yet run on a GPU (tested interpreted on CPU and lowered to Triton IR; their time
against cuDNN is benchmarks/attention_gpu.py's, not measured yet). On CPU, at the `small` recipe's
attention shape (4 x 512 tokens, 4 query heads over
2 kv heads of dim 64, float32, its packed synthetic batch) flash-xla forward + backward takes 0.47
of blocked's time at blocks of 256, 0.52 at 128, 0.62 at 64 (benchmarks/records/attention_cpu_backend.json,
from benchmarks/attention_cpu_backend.py).
"""

from __future__ import annotations

# The checkpoint name of the output and log-sum-exp the flash core saves for its backward
# (ops._flash_fwd; remat.save), here so the validator reads it without importing the kernel.
RESIDUALS_NAME = "attn_core_residuals"
CHOICES = ("auto", "xla", "blocked", "pallas_tpu", "pallas_gpu")
_AUTO = {"tpu": "pallas_tpu"}  # pallas_gpu joins for GPUs once it has run and been timed on one

# Default blocks (block_q, block_k) per flash backend; a length they do not divide gets the
# largest block below the default that does (fit_block). xla: the fastest block measured at the
# `small` shape (the record above). pallas_tpu: 128 query tokens (times the query heads per kv
# head: 2048 folded rows for Qwen3.5-397B's 16) by 512 keys, which Mosaic compiles for tpu7x at
# 397B's heads (tests/test_attention_tpu_compile.py). pallas_gpu: 64 x 64, the tile of jax's own Triton
# attention kernel (jax/experimental/pallas/ops/gpu/attention.py); not measured here (no GPU).
DEFAULT_BLOCKS = {"xla": (256, 256), "pallas_tpu": (128, 512), "pallas_gpu": (64, 64)}
# Mosaic's (8, 128) tiles: a block's token dim is a multiple of 8 or the whole length.
TPU_BLOCK_MULTIPLE = 8
# Triton: power-of-two block shapes, and tl.dot wants every matmul dim >= 16.
GPU_MIN_DIM = 16


def resolve(choice: str, platform: str) -> str:
    """The core `choice` names on `platform` (jax platform names: cpu, tpu, gpu, cuda, rocm)."""
    if choice != "auto":
        return choice
    return _AUTO.get(platform, "xla")


def block_rule(backend: str, hardware: bool) -> str | None:
    """Which compiler's block rule applies: "mosaic", "triton", or None (any divisor)."""
    if not hardware:
        return None
    return {"pallas_tpu": "mosaic", "pallas_gpu": "triton"}.get(backend)


def _power_of_two(n: int) -> bool:
    return n >= GPU_MIN_DIM and not n & (n - 1)


def block_ok(block: int, length: int, rule: str | None) -> bool:
    if block < 1 or length % block:
        return False
    if rule == "mosaic":
        return block % TPU_BLOCK_MULTIPLE == 0 or block == length
    if rule == "triton":
        return _power_of_two(block)
    return True


def fit_block(wanted: int, length: int, rule: str | None = None) -> int | None:
    """The largest block <= wanted that tiles length under the rule, else the smallest one above
    it; None when none does (Triton and a length with no power-of-two divisor >= 16)."""
    fits = [b for b in range(1, length + 1) if block_ok(b, length, rule)]
    below = [b for b in fits if b <= wanted]
    return below[-1] if below else (fits[0] if fits else None)


def blocks(backend: str, block_q: int, block_k: int, q_len: int, k_len: int, hardware: bool) -> tuple[int, int]:
    """(block_q, block_k) a flash backend runs with: the given ones, or (0) its default fitted to
    the lengths."""
    rule = block_rule(backend, hardware)
    out = []
    for name, given, default, length in (("block_q", block_q, DEFAULT_BLOCKS[backend][0], q_len),
                                         ("block_k", block_k, DEFAULT_BLOCKS[backend][1], k_len)):
        block = given or fit_block(default, length, rule)
        if block is None:
            raise ValueError(f"flash attention {backend}: no {name} tiles {length} tokens ({rule} blocks: "
                             f"{rule_text(rule)})")
        out.append(block)
    return out[0], out[1]


def rule_text(rule: str | None) -> str:
    return {"mosaic": f"a multiple of {TPU_BLOCK_MULTIPLE} (Mosaic's (8, 128) tiles) or the whole length",
            "triton": f"a power of two >= {GPU_MIN_DIM} (Triton)"}.get(rule, "any divisor")


def block_problem(name: str, block: int, length: int, what: str, rule: str | None = None) -> str | None:
    """Why `block` cannot tile `length` tokens (`what`: e.g. "local queries"); None when it can."""
    if length % block:
        return f"{name}={block} does not divide the {length} {what}"
    if not block_ok(block, length, rule):
        return f"{name}={block} must be {rule_text(rule)}; the {what}: {length}"
    return None


def head_dim_problem(head_dim: int, backend: str, hardware: bool) -> str | None:
    """Triton's matmuls need the head dim a power of two >= 16."""
    if block_rule(backend, hardware) == "triton" and not _power_of_two(head_dim):
        return f"model.head_dim={head_dim} must be a power of two >= {GPU_MIN_DIM} for the Triton kernels"
    return None


# ---------------------------------------------------------------------------------------------
# On-chip memory of the flash kernels (kernels/vmem.py), as pallas_tpu.py builds their BlockSpecs
# and scratch, and the float32 values the body makes per (query block, key block) pair: the
# scores [rows, block_k] and the probabilities in the input dtype (rows = the R query heads of a
# kv head times block_q, folded; dq: the scores only). Against the compiler's smallest accepted
# limit on tpu7x (head dim 128): the forward spills 1.44 to 1.52 x the scores' bytes (model 1.5), dq
# 0.78 to 1.10 x (model 1), dk-dv 0.28 to 1.54 x (model 1.5); checked on a sweep of blocks in
# tests/test_vmem_tpu_compile.py.

KERNELS = ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkv")


def tpu_buffers(kernel: str, *, block_q: int, block_k: int, group: int, head_dim: int, itemsize: int = 2,
                grad_itemsize: int | None = None):
    """The VMEM buffers of one Mosaic flash kernel (KERNELS) at its blocks; group = query heads per
    kv head, grad_itemsize: the gradients' (default the inputs', as the model's attention has them)."""
    grad_itemsize = grad_itemsize or itemsize
    from hybridmoe.kernels.vmem import Buffer

    rows, A = group * block_q, head_dim
    q = (group, block_q, A)
    common = [Buffer("q", q, itemsize), Buffer("k", (block_k, A), itemsize), Buffer("v", (block_k, A), itemsize)]
    ids = [Buffer("q_ids", (2, rows), 4), Buffer("kv_ids", (2, block_k), 4)]
    scores = Buffer("scores", (rows, block_k), 4, 1, "value")
    values = [scores, Buffer("probabilities", (rows, block_k), itemsize, 1, "value")]
    if kernel == "flash_attention_forward":
        return [*common, *ids, Buffer("o", q, itemsize), Buffer("lse", (1, rows), 4),
                Buffer("m", (rows, 1), 4, 1, "scratch"), Buffer("l", (rows, 1), 4, 1, "scratch"),
                Buffer("acc", (rows, A), 4, 1, "scratch"), *values]
    if kernel == "flash_attention_dq":
        return [*common, Buffer("do", q, itemsize), *ids, Buffer("stats", (2, rows), 4),
                Buffer("dq", q, grad_itemsize), Buffer("dq_acc", (rows, A), 4, 1, "scratch"), scores]
    if kernel == "flash_attention_dkv":
        return [*common, Buffer("do", q, itemsize), *ids, Buffer("stats", (2, rows), 4),
                Buffer("dk", (block_k, A), grad_itemsize), Buffer("dv", (block_k, A), grad_itemsize),
                Buffer("dk_acc", (block_k, A), 4, 1, "scratch"), Buffer("dv_acc", (block_k, A), 4, 1, "scratch"),
                *values]
    raise ValueError(f"unknown flash kernel {kernel!r}; choose one of {KERNELS}")


def vmem_needs(limit_mib: float, **blocks) -> dict:
    """Per flash kernel, its VMEM need against the scoped limit (limit_mib, 0 = the compiler's
    default); blocks: tpu_buffers' keywords."""
    from hybridmoe.kernels.vmem import MIB, Need, tpu_bytes, tpu_limit_mib

    needs = {k: tpu_bytes(tpu_buffers(k, **blocks)) for k in KERNELS}
    return {k: Need(k, need, int(tpu_limit_mib(limit_mib, need) * MIB)) for k, need in needs.items()}


# Triton (pallas_gpu.py): a program loops over the blocks of its schedule, and the software pipeline
# keeps num_stages copies of what one iteration loads in shared memory (the forward and dq: the key
# and value blocks [block_k, A]; dk-dv: one query head's q and do blocks [block_q, A]) beside the
# block the program holds for the whole loop (q, or k and v) and the probabilities it feeds the
# second matmul. Triton's default depth is 3 stages (jax's lowering on CUDA).
GPU_NUM_STAGES = 3
# jax's own Triton flash attention (jax.experimental.pallas.ops.gpu.attention): forward blocks
# 128 x 128, backward 32 x 32, num_stages 2.
JAX_GPU_ATTENTION_DEFAULTS = {"block_q": 128, "block_k": 128, "block_q_bwd": 32, "block_k_bwd": 32, "num_stages": 2}


def gpu_shared_bytes(kernel: str, *, block_q: int, block_k: int, head_dim: int, itemsize: int = 2,
                     num_stages: int = GPU_NUM_STAGES) -> int:
    """Shared memory one Triton program of a flash kernel (KERNELS) needs, by the model above."""
    A = head_dim
    if kernel in ("flash_attention_forward", "flash_attention_dq"):
        per_stage, held = 2 * block_k * A * itemsize, block_q * A * itemsize * (1 if kernel.endswith("forward") else 2)
        return num_stages * per_stage + held + block_q * block_k * itemsize
    if kernel == "flash_attention_dkv":
        return num_stages * 2 * block_q * A * itemsize + 2 * block_k * A * itemsize + block_q * block_k * itemsize
    raise ValueError(f"unknown flash kernel {kernel!r}; choose one of {KERNELS}")
