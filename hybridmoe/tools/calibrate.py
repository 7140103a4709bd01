"""`hybridmoe calibrate`: what this host's accelerator does, measured, for the step-time model.

The model (analysis/step_estimate.py) charges each op the larger of its FLOPs over a matmul rate and
its bytes over an HBM rate, plus fixed costs; until a chip of a generation is measured, those are its
maker's figures and an assumed grid-step cost. This command measures, on the chip it runs on:

- the bf16 matmul rate: an n x n x n product (8,192: large enough that nothing but the MXU bounds it);
- the HBM rate: an elementwise pass over a 1 GiB bf16 array (it reads and writes every byte once);
- the fixed cost of one launched op: a loop whose body is one tiny op on the last one's result,
  run 2,000 and 500 times, its time per iteration added (each iteration a launch; fusion cannot merge
  them);
- the fixed cost of one Pallas grid step: a kernel that copies 4 KiB blocks over a long grid, its
  time per step less the step's bytes at the measured HBM rate;
- per Pallas kernel, its measured time over the model's at the kernel cases' shapes
  (tools/chip_cases.py): the model with the measured figures above, the case's non-kernel ops
  subtracted, the rest is the kernel's factor.

It writes the generation's row of analysis/chip_calibration.json (with the device, commit and date),
which every later estimate on that generation uses, and a record of what it measured (--out).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from hybridmoe.analysis.hardware import MAKERS, calibrated, generation_of_device, write_calibration


def median_seconds(fn: Callable, *args, repeats: int = 10) -> float:
    """Median wall time of fn(*args) after one untimed call, each call waited for."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops_per_s(size: int = 8192, repeats: int = 10) -> float:
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    return 2 * size**3 / median_seconds(jax.jit(jnp.matmul), a, b, repeats=repeats)


def hbm_bytes_per_s(nbytes: int = 2**30, repeats: int = 10) -> float:
    x = jnp.ones((nbytes // 2 // 1024, 1024), jnp.bfloat16)
    return 2 * nbytes / median_seconds(jax.jit(lambda x: x * 2 + 1), x, repeats=repeats)


def op_chain():
    """One tiny op launched again and again: a while loop whose body is one [8, 128] float32 op on
    the last one's result, its trip count an argument (the loop cannot be unrolled, nor its ops fused
    across iterations: each iteration is a launch of the body). A chain written out in one program
    measured nothing on a TPU (0.00 us per op): the compiler fuses a straight line of elementwise ops,
    optimization barriers or not."""
    def chain(x, n):
        return jax.lax.fori_loop(0, n, lambda i, x: jax.lax.optimization_barrier(x * 1.0001 + 1.0), x)
    return jax.jit(chain)


def op_overhead_s(length: int = 2000, repeats: int = 5) -> float:
    """Seconds one launched op costs beyond its work (the ops are [8, 128] float32: their work is
    nothing): the chain run `length` times less the chain run a quarter as many, per op added (the
    call's own fixed cost cancels). Raises when that is not positive: a figure of zero is a
    measurement that failed, not a free op."""
    fn, x = op_chain(), jnp.ones((8, 128), jnp.float32)
    if "while" not in fn.lower(x, jnp.int32(2)).compile().as_text():
        raise RuntimeError("the op chain compiled without its loop: its ops were not launched one by one")
    short = max(1, length // 4)
    long_s = median_seconds(fn, x, jnp.int32(length), repeats=repeats)
    short_s = median_seconds(fn, x, jnp.int32(short), repeats=repeats)
    per_op = (long_s - short_s) / (length - short)
    if per_op <= 0:
        raise RuntimeError(f"{length} launched ops took {long_s * 1e6:.1f} us and {short} took {short_s * 1e6:.1f}: "
                           "no per-op cost can be read from that")
    return per_op


def grid_step_s(steps: int = 2**16, hbm_rate: float | None = None, *, interpret: bool = False,
                repeats: int = 5) -> float:
    """Seconds one Pallas grid step costs beyond its bytes: a copy of [8, 128] float32 blocks
    (4 KiB) over `steps` grid steps, less each step's 8 KiB of traffic at `hbm_rate`."""
    from jax.experimental import pallas as pl

    block = (8, 128)

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.ones((steps * block[0], block[1]), jnp.float32)
    f = jax.jit(pl.pallas_call(copy, grid=(steps,), in_specs=[pl.BlockSpec(block, lambda i: (i, 0))],
                               out_specs=pl.BlockSpec(block, lambda i: (i, 0)),
                               out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret))
    per_step = median_seconds(f, x, repeats=repeats) / steps
    step_bytes = 2 * block[0] * block[1] * 4
    return max(per_step - (step_bytes / hbm_rate if hbm_rate else 0.0), 0.0)


def kernel_factor(measured_s: float, estimate: dict) -> dict[str, float]:
    """Each Pallas kernel of a case's program -> measured / modelled time: the model's time for the
    ops around the kernels is taken as right, and what is left of the measured time is the
    kernels', shared in proportion to their modelled times (one factor for the case's kernels)."""
    kernels_s = sum(k["s"] for k in estimate["kernels"].values())
    if not kernels_s:
        return {}
    rest_s = estimate["serial"]["step_s"] - kernels_s
    factor = max(measured_s - rest_s, 0.0) / kernels_s
    return {name: factor for name in estimate["kernels"]}


# The backends whose kernels the factors are read from: every Mosaic kernel the cases run is in one of
# them (the other Pallas arms run the same kernels at other tiles or settings, and would only add chip time).
CALIBRATED_BACKENDS = ("pallas_tpu", "pallas_tpu_fused")


def kernel_factors(hw, geometry: str, *, interpret: bool = False, repeats: int = 5,
                   families=None) -> dict[str, dict]:
    """{kernel: {"factor", "case", "backend", "measured_s", "modelled_s"}} over the backends
    CALIBRATED_BACKENDS of every kernel case at `geometry` (or of the families named): each timed
    forward + backward (forward where there is none), against the model of its compiled program on
    `hw` (with the measured rates, no factors yet). A kernel met in several cases keeps its first one's
    factor."""
    from hybridmoe.analysis.step_estimate import estimate
    from hybridmoe.tools import chip_cases

    out: dict[str, dict] = {}
    for case in chip_cases.cases(geometry, interpret=interpret, families=families).values():
        for backend, build in case.backends.items():
            if backend not in CALIBRATED_BACKENDS:
                continue
            built = build()
            fn, args = built.fwd_bwd or built.fwd
            measured = median_seconds(fn, *args, repeats=repeats)
            e = estimate(fn.lower(*args).compile().as_text(), hw, tokens_per_step=1, chips=1, devices=1)
            for name, factor in kernel_factor(measured, e).items():
                out.setdefault(name, {"factor": factor, "case": case.name, "backend": backend, "measured_s": measured,
                                      "modelled_s": e["serial"]["step_s"]})
            del built, fn, args
    return out


def calibrate(*, geometry: str = "one_chip", interpret: bool = False, matmul_size: int = 8192,
              hbm_bytes: int = 2**30, chain: int = 2000, grid_steps: int = 2**16, repeats: int = 10) -> dict:
    """The calibration row of this host's accelerator (analysis/hardware.py's fields) and what
    each figure came from."""
    from hybridmoe.tools.record import source_commit
    import datetime

    device = jax.devices()[0]
    generation = generation_of_device(device)
    if generation is None and not interpret:
        raise RuntimeError(f"calibrate measures a TPU or GPU the step-time model has a row for (known: {', '.join(MAKERS)});"
                           f" this host's JAX sees {device.platform} ({device.device_kind})")
    flops = matmul_flops_per_s(matmul_size, repeats)
    hbm = hbm_bytes_per_s(hbm_bytes, repeats)
    row = {"bf16_flops_chip": flops * MAKERS.get(generation, MAKERS["v5e"]).devices_per_chip,
           "hbm_bytes_per_s_chip": hbm * MAKERS.get(generation, MAKERS["v5e"]).devices_per_chip,
           "op_overhead_s": op_overhead_s(chain, max(3, repeats // 2)),
           "grid_step_s": grid_step_s(grid_steps, hbm, interpret=interpret, repeats=max(3, repeats // 2)),
           "measured": {"device": device.device_kind, "commit": source_commit(),
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "matmul": f"{matmul_size}^3 bf16", "hbm": f"{hbm_bytes / 2**20:.0f} MiB bf16 read + write",
                        "chain": chain, "grid_steps": grid_steps, "kernel_geometry": geometry}}
    hw = calibrated(MAKERS.get(generation, MAKERS["v5e"]), row)
    kernels = kernel_factors(hw, geometry, interpret=interpret, repeats=max(3, repeats // 2))
    row["kernel_factors"] = {name: k["factor"] for name, k in kernels.items()}
    row["measured"]["kernels"] = kernels
    return {"generation": generation, "row": row}


def format_calibration(result: dict) -> str:
    row, gen = result["row"], result["generation"]
    maker = MAKERS.get(gen)
    lines = [f"calibration of {row['measured']['device']} ({gen}):",
             f"  bf16 matmul     {row['bf16_flops_chip'] / 1e12:8.1f} TFLOP/s per chip"
             + (f"  (maker: {maker.bf16_flops_chip / 1e12:.0f})" if maker else ""),
             f"  HBM             {row['hbm_bytes_per_s_chip'] / 1e9:8.1f} GB/s per chip"
             + (f"  (maker: {maker.hbm_bytes_per_s_chip / 1e9:.0f})" if maker else ""),
             f"  per launched op {row['op_overhead_s'] * 1e6:8.2f} us",
             f"  per grid step   {row['grid_step_s'] * 1e6:8.3f} us  (assumed before: 0.35)"]
    for name, k in sorted(row["measured"]["kernels"].items()):
        lines.append(f"  Pallas {name:<28} measured/modelled {k['factor']:6.2f}  ({k['case']}, {k['backend']})")
    return "\n".join(lines)


def write(result: dict) -> None:
    """The generation's row into the repository's table (analysis/chip_calibration.json)."""
    write_calibration(result["generation"], result["row"])
