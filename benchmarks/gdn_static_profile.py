"""The Mosaic GDN kernels' cycles by libtpu's static profile, compiled for a v5e target on this host.

    python benchmarks/gdn_static_profile.py                       # every arm, 1,024 tokens of the cell's heads
    python benchmarks/gdn_static_profile.py --arms default,chunk_128 --tokens 2048

No chip. Each arm's kernels (the core at the 397B cell's heads: 16 key heads, 64 value heads, dims
128, bfloat16 inputs, packed rows) are compiled for a v5e topology in child processes whose libtpu
writes a static profile of every kernel it schedules (`--xla_jf_dump_static_llo_profile_to`: the
scheduled kernel's cycles, loops counted). Two compiles per arm: the forward alone (the kernel as
inference runs it, without the backward's residuals), and forward + backward for the backward
kernel. libtpu's analysis fails on the forward that saves residuals (it states 0 cycles) and then
aborts the process; the backward's profile is written before that, so the abort is tolerated once
the backward's file is there. A kernel's cycles grow with its grid steps, so a shorter sequence
(--tokens) is profiled and scaled to the cell's 16,384 tokens. Milliseconds at the clock the
maker's peak implies (197 TFLOP/s over 4 MXUs of 128 x 128 multiply-adds: 1.5 GHz).

The profile is the compiler's model of the schedule, not the chip: it ranks changes to a kernel's
body on this host before a chip times them. At 459723c it put the default's forward and backward
at 6.8 and 13.4 ms at the cell where a v5e measured 25.55 ms for the core's forward + backward with
its layout copies (tpu_kernels.json gdn_cell).

Writes benchmarks/records/gdn_static_profile.json: per arm, per kernel, the cycles at --tokens, the
cycles scaled to the cell and ms at the clock. libtpu's logs go to a temporary folder (its static
profile logs gigabytes there otherwise).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402

CELL_TOKENS = 16384
KEY_HEADS, VALUE_HEADS, DIM = 16, 64, 128
V5E_CLOCK_HZ = 197e12 / (4 * 128 * 128 * 2)
# name -> the Mosaic core's keyword arguments (pallas_tpu.gated_delta_rule)
ARMS = {
    "default": {},
    "chunk_128": {"chunk_size": 128},
    "bfloat16": {"precision": "bfloat16"},
    "bfloat16_chunk_128": {"precision": "bfloat16", "chunk_size": 128},
    "bfloat16x3": {"precision": "bfloat16x3"},
}
# What each compile profiles: the forward alone, or forward + backward (for the backward kernel).
PARTS = {"forward": "gdn_chunk_forward", "backward": "gdn_chunk_backward"}


def _child(arm: str, part: str, tokens: int) -> None:
    """Compile one arm's part for a v5e target (the profile flag was set before libtpu started)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from hybridmoe.kernels.gdn import pallas_tpu
    from hybridmoe.tools.train_program import tpu_target

    device = tpu_target("v5e:2x2").devices[0]
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))  # noqa: E731
    args = (spec((1, tokens, KEY_HEADS, DIM), jnp.bfloat16), spec((1, tokens, KEY_HEADS, DIM), jnp.bfloat16),
            spec((1, tokens, VALUE_HEADS, DIM), jnp.bfloat16), spec((1, tokens, VALUE_HEADS), jnp.float32),
            spec((1, tokens, VALUE_HEADS), jnp.float32), spec((1, tokens), jnp.int32))
    kw = {"chunk_size": 64, **ARMS[arm]}

    def rule(q, k, v, g, beta, seg):
        return pallas_tpu.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, **kw)[0]

    if part == "forward":
        jax.jit(rule).lower(*args).compile()
    else:
        loss = lambda *a: jnp.sum(rule(*a).astype(jnp.float32))  # noqa: E731
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()


def kernel_cycles(folder: Path) -> dict[str, int]:
    """{kernel: estimated cycles} of the Mosaic GDN kernels in a profile folder, summed over their
    calls (a file per call; autodiff prefixes the names: jvp_..., transpose_jvp_...)."""
    out = {}
    for f in folder.glob("*_static_llo_profile.textproto"):
        text = f.read_text()
        if 'hlo_op_name: "' not in text or "estimated_cycles: " not in text:
            continue
        op = text.split('hlo_op_name: "')[1].split('"')[0]
        name = next((k for k in PARTS.values() if k in op), None)
        if name is not None:
            out[name] = out.get(name, 0) + int(text.split("estimated_cycles: ")[1].split()[0])
    return out


def profile(arm: str, part: str, tokens: int) -> int:
    """The cycles of `part`'s kernel (PARTS) of one arm at `tokens`, from a child's compile."""
    kernel = PARTS[part]
    with tempfile.TemporaryDirectory() as tmp:
        dump, logs = Path(tmp, "profile"), Path(tmp, "logs")
        logs.mkdir()
        env = dict(os.environ, LIBTPU_INIT_ARGS=f"--xla_jf_dump_static_llo_profile_to={dump}", TPU_LOG_DIR=str(logs),
                   TPU_MIN_LOG_LEVEL="3", TPU_STDERR_LOG_LEVEL="3",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        run = subprocess.run([sys.executable, __file__, "--child", arm, part, str(tokens)], env=env,
                             capture_output=True, text=True)
        cycles = kernel_cycles(dump).get(kernel, 0) if dump.is_dir() else 0
    if not cycles:
        raise RuntimeError(f"{arm} {part}: libtpu wrote no profile of {kernel} (exit {run.returncode})\n"
                           f"{run.stderr[-2000:]}")
    return cycles


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--tokens", type=int, default=1024, help="tokens profiled (scaled to the cell's 16,384)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        arm, part, tokens = args.child
        _child(arm, part, int(tokens))
        return 0
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown arms {unknown}; known: {', '.join(ARMS)}")
    scale = CELL_TOKENS / args.tokens
    arms = {}
    print(f"{'arm':<20} {'kernel':<20} {'cycles':>12} {'cell cycles':>14} {'cell ms':>9}")
    for arm in args.arms.split(","):
        kernels = {}
        for part, name in PARTS.items():
            cycles = profile(arm, part, args.tokens)
            kernels[name] = {"cycles": cycles, "cell_cycles": cycles * scale,
                             "cell_ms": cycles * scale / V5E_CLOCK_HZ * 1e3}
            print(f"{arm:<20} {name:<20} {cycles:>12,} {cycles * scale:>14,.0f} {kernels[name]['cell_ms']:>9.2f}")
        arms[arm] = {"settings": ARMS[arm], "kernels": kernels, "cell_ms": sum(k["cell_ms"] for k in kernels.values())}
        print(f"{arm:<20} {'both':<20} {'':>12} {'':>14} {arms[arm]['cell_ms']:>9.2f}")
    harness.write(args.out, "gdn_static_profile", target="v5e:2x2", tokens=args.tokens, cell_tokens=CELL_TOKENS,
                  clock_hz=V5E_CLOCK_HZ, arms=arms,
                  method="each kernel compiled for a v5e target with libtpu's static LLO profile; forward alone "
                         "(no residuals), the backward from a forward + backward compile; cycles scaled by the "
                         "cell's tokens over those profiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
