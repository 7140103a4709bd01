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

`auto` on CPU is `xla`: at the `small` recipe's attention shape (4 x 512 tokens, 4 query heads over
2 kv heads of dim 64, float32, its packed synthetic batch) flash-xla forward + backward takes 0.47
of blocked's time at blocks of 256, 0.52 at 128, 0.62 at 64 (benchmarks/records/attention_cpu_backend.json,
from benchmarks/attention_cpu_backend.py).
"""

from __future__ import annotations

CHOICES = ("auto", "xla", "blocked", "pallas_tpu", "pallas_gpu")
# The Pallas backends whose kernels exist (pallas_gpu: issue 18 item 3, not built yet).
BUILT = ("xla", "blocked", "pallas_tpu")
_AUTO = {"tpu": "pallas_tpu", "cpu": "xla"}

# Default blocks (block_q, block_k) per flash backend; a length they do not divide gets the
# largest block below the default that does (fit_block). xla: the fastest block measured at the
# `small` shape (the record above). pallas_tpu: 128 query tokens (times the
# query heads per kv head: 2048 folded rows for Qwen3.5-397B's 16) by 512 keys, which Mosaic
# compiles for tpu7x at 397B's heads (tests/test_gmm_tpu_compile.py).
DEFAULT_BLOCKS = {"xla": (256, 256), "pallas_tpu": (128, 512), "pallas_gpu": (64, 64)}
# Mosaic's (8, 128) tiles: a block's token dim is a multiple of 8 or the whole length.
TPU_BLOCK_MULTIPLE = 8


def resolve(choice: str, platform: str) -> str:
    """The core `choice` names on `platform` (jax platform names: cpu, tpu, gpu, cuda, rocm)."""
    if choice != "auto":
        return choice
    return _AUTO.get(platform, "xla")


def block_multiple(backend: str, hardware: bool) -> int:
    return TPU_BLOCK_MULTIPLE if backend == "pallas_tpu" and hardware else 1


def fit_block(wanted: int, length: int, multiple: int = 1) -> int:
    """The largest block <= wanted that divides length and is a multiple of `multiple`, else the
    smallest such block above it (the whole length at most)."""
    fits = [b for b in range(1, length + 1) if length % b == 0 and (b % multiple == 0 or b == length)]
    below = [b for b in fits if b <= wanted]
    return below[-1] if below else fits[0]


def blocks(backend: str, block_q: int, block_k: int, q_len: int, k_len: int, hardware: bool) -> tuple[int, int]:
    """(block_q, block_k) a flash backend runs with: the given ones, or (0) its default fitted to
    the lengths."""
    dq, dk = DEFAULT_BLOCKS[backend]
    m = block_multiple(backend, hardware)
    return (block_q or fit_block(dq, q_len, m), block_k or fit_block(dk, k_len, m))


def block_problem(name: str, block: int, length: int, what: str, multiple: int = 1) -> str | None:
    """Why `block` cannot tile `length` tokens (`what`: e.g. "local queries"); None when it can."""
    if length % block:
        return f"{name}={block} does not divide the {length} {what}"
    if block % multiple and block != length:
        return f"{name}={block} must be a multiple of {multiple} (Mosaic's (8, 128) tiles) or all {length} {what}"
    return None
