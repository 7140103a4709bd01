"""The accelerators the step-time model knows: the makers' figures, and what a chip measured.

A row (`Hardware`) holds a chip's published peak FLOP/s, HBM size and bandwidth, on-core memory and
interconnect, with its source. A generation that has been measured also has a row in the
calibration table (`chip_calibration.json` beside this file, written by `hybridmoe calibrate` on a
chip of that generation): the bf16 matmul rate and HBM bandwidth the chip reached, the fixed cost of
one Pallas grid step and of one launched XLA op, and per Pallas kernel the ratio of its measured
time to the model's at the calibration shapes. `hardware_for` applies a generation's measurements
over its maker's figures; an estimate says which it used.

Device kinds (what `jax.devices()[0].device_kind` says on a TPU host) map to generations, so a
TPU host estimates for its own chip.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from hybridmoe.kernels.platform import DEVICE_KINDS, generation_of_device  # noqa: F401 (the rows' keys)

T, G, GIB, MIB = 1e12, 1e9, 2**30, 2**20

# The fixed cost of one Pallas TPU grid step (the pipeline's DMA issue and bookkeeping, with no work
# in the step), for a generation not yet measured: the figure Pallas kernel authors quote. A
# calibrated generation uses the value its chip measured.
ASSUMED_GRID_STEP_S = 0.35e-6


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    devices_per_chip: int        # JAX devices on one chip (a TPU7x chip shows two)
    bf16_flops_chip: float       # dense peak, FLOP/s
    fp8_flops_chip: float        # the bf16 peak where the chip has no fp8 matrix unit
    hbm_bytes_per_s_chip: float
    hbm_bytes_chip: float
    vmem_bytes_device: float     # on-core scratchpad per device (GPU: shared memory per SM)
    link_bytes_per_s_chip: float  # chip-to-chip interconnect, all links, one direction
    grid_step_s: float           # fixed cost of one Pallas grid step
    op_overhead_s: float = 0.0   # fixed cost of one launched XLA op (0 until a chip measured it)
    kernel_factors: tuple = ()   # ((Pallas kernel name, measured / modelled time), ...)
    measured: dict | None = None  # the calibration's provenance (device, commit, date), None: makers' figures

    def per_device(self, value: float) -> float:
        return value / self.devices_per_chip

    @property
    def bf16_flops(self) -> float:
        return self.per_device(self.bf16_flops_chip)

    @property
    def fp8_flops(self) -> float:
        return self.per_device(self.fp8_flops_chip)

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.per_device(self.hbm_bytes_per_s_chip)

    @property
    def link_bytes_per_s(self) -> float:
        return self.per_device(self.link_bytes_per_s_chip)

    def kernel_factor(self, kernel: str) -> float:
        """The kernel's measured / modelled time; one no calibration case timed takes the factor of the
        kernel whose body it shares (FACTOR_PROXIES), else 1 (the bare model)."""
        source = self.factor_source(kernel)
        return 1.0 if source is None else dict(self.kernel_factors)[source]

    def factor_source(self, kernel: str) -> str | None:
        """Where kernel_factor's figure comes from: the kernel itself, its proxy's name, or None (no factor)."""
        factors = dict(self.kernel_factors)
        if kernel in factors:
            return kernel
        return FACTOR_PROXIES.get(kernel) if FACTOR_PROXIES.get(kernel) in factors else None


# Kernels whose factor is borrowed until a calibration case times them: each shares its body with
# the one named (the same kernels/gdn/tpu_chunk.py math on the same layout and grid). The first chip
# run of their case (tools/chip_cases.py gdn_cp) ran one rank alone, where the cross-rank prefix is
# zero and XLA removed both kernels from the program: it timed neither.
FACTOR_PROXIES = {"gdn_cp_transition": "gdn_chunk_forward", "gdn_cp_local_cotangent": "gdn_chunk_backward"}


# Makers' figures. TPU rows: Google Cloud TPU documentation, each generation's "system architecture"
# page (per chip: peak bf16 compute, HBM capacity and bandwidth, interchip interconnect bandwidth,
# given there bidirectional; halved here for one direction); VMEM per core: JAX's Pallas TPU hardware
# table (jax/_src/pallas/mosaic/tpu_info.py). v5e, v5p and v6e have no fp8 matrix unit (fp8 operands
# run at the bf16 rate).
MAKERS = {
    # TPU v5e: 197 TFLOP/s bf16 (394 int8), 16 GiB HBM2 at 819 GB/s, ICI 1,600 Gbit/s; VMEM 128 MiB.
    "v5e": Hardware("v5e", 1, 197 * T, 197 * T, 819 * G, 16 * GIB, 128 * MIB, 100 * G, ASSUMED_GRID_STEP_S),
    # TPU v5p: 459 TFLOP/s bf16 (918 int8), 95 GiB HBM2e at 2,765 GB/s, ICI 4,800 Gbit/s; VMEM 64 MiB.
    "v5p": Hardware("v5p", 1, 459 * T, 459 * T, 2765 * G, 95 * GIB, 64 * MIB, 300 * G, ASSUMED_GRID_STEP_S),
    # TPU v6e (Trillium): 918 TFLOP/s bf16 (1,836 int8), 32 GiB HBM at 1,640 GB/s, ICI 3,584 Gbit/s;
    # VMEM 128 MiB.
    "v6e": Hardware("v6e", 1, 918 * T, 918 * T, 1640 * G, 32 * GIB, 128 * MIB, 224 * G, ASSUMED_GRID_STEP_S),
    # TPU7x (Ironwood): per chip 2,307 TFLOP/s bf16, 4,614 fp8, 192 GiB HBM at 7,380 GB/s,
    # bidirectional ICI 1,200 GB/s (600 each way), two TensorCores per chip (two JAX devices).
    # VMEM 64 MiB per TensorCore.
    "tpu7x": Hardware("tpu7x", 2, 2307 * T, 4614 * T, 7380 * G, 192 * GIB, 64 * MIB, 600 * G, ASSUMED_GRID_STEP_S),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense (1,979 with sparsity),
    # 1,979 fp8 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional (450 each way);
    # 228 KB shared memory per SM (NVIDIA Hopper tuning guide) in the VMEM column. Triton launches
    # whole programs: no per-step cost on the GPUs.
    "h100": Hardware("h100", 1, 989 * T, 1979 * T, 3350 * G, 80e9, 228 * 1024, 450 * G, 0.0),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100's compute (same GH100 die), 141 GB HBM3e
    # at 4.8 TB/s, NVLink 900 GB/s bidirectional.
    "h200": Hardware("h200", 1, 989 * T, 1979 * T, 4800 * G, 141e9, 228 * 1024, 450 * G, 0.0),
}

CALIBRATION_FILE = Path(__file__).with_name("chip_calibration.json")
# The measured fields a calibration row holds, and the Hardware field each one replaces.
MEASURED_FIELDS = {"bf16_flops_chip": "bf16_flops_chip", "hbm_bytes_per_s_chip": "hbm_bytes_per_s_chip",
                   "grid_step_s": "grid_step_s", "op_overhead_s": "op_overhead_s"}


def read_calibration(path: Path = CALIBRATION_FILE) -> dict:
    """{generation: calibration row} from the table (empty when there is none)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def write_calibration(generation: str, row: dict, path: Path = CALIBRATION_FILE) -> None:
    """Set one generation's row of the table, written whole to a temporary file and renamed over the
    old one: a reader never meets half a table, and the other generations' rows are kept."""
    if generation not in MAKERS:
        raise ValueError(f"no maker's row for generation {generation!r}; known: {', '.join(MAKERS)}")
    missing = [k for k in (*MEASURED_FIELDS, "measured") if k not in row]
    if missing:
        raise ValueError(f"a calibration row needs {', '.join(missing)}")
    table = read_calibration(path)
    table[generation] = row
    write_json_atomically(path, table)


def write_json_atomically(path: Path, obj) -> None:
    """A JSON table written whole to a temporary file beside `path`, flushed to disk and renamed over
    the old one: a reader (or a kill mid-write) never meets half a table."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def calibrated(hw: Hardware, row: dict) -> Hardware:
    """`hw` with a calibration row's measurements in place of the maker's figures."""
    return dataclasses.replace(hw, **{field: float(row[k]) for k, field in MEASURED_FIELDS.items()},
                               kernel_factors=tuple(sorted(row.get("kernel_factors", {}).items())),
                               measured=dict(row["measured"]))


def carried(hw: Hardware, source: str, row: dict) -> Hardware:
    """`hw` (a generation no chip of which has been measured) calibrated by another generation's row:
    its matmul and HBM rates scaled by the fractions of the maker's figures the `source` chip
    reached, the source's fixed costs (per launched op, per Pallas grid step) and kernel factors
    taken as they are; the links keep the maker's figure (nothing measured them). The provenance
    says it was carried."""
    maker = MAKERS[source]
    return dataclasses.replace(
        hw, bf16_flops_chip=hw.bf16_flops_chip * float(row["bf16_flops_chip"]) / maker.bf16_flops_chip,
        fp8_flops_chip=hw.fp8_flops_chip * float(row["bf16_flops_chip"]) / maker.bf16_flops_chip,
        hbm_bytes_per_s_chip=hw.hbm_bytes_per_s_chip * float(row["hbm_bytes_per_s_chip"]) / maker.hbm_bytes_per_s_chip,
        grid_step_s=float(row["grid_step_s"]), op_overhead_s=float(row["op_overhead_s"]),
        kernel_factors=tuple(sorted(row.get("kernel_factors", {}).items())),
        measured={**row["measured"], "carried_from": source})


def hardware_for(target: str, *, use_calibration: bool = True, table: dict | None = None,
                 calibration_from: str | None = None) -> Hardware:
    """The row of a target name ("tpu7x:2x2x1" -> tpu7x, "v5e:2x2" -> v5e, "h200" / "gpu:h200" ->
    h200), with its chip's measurements applied when the calibration table has them.
    calibration_from: another generation whose row calibrates this one (`carried`), for a target no
    chip has measured; refused where the target has its own row or the source has none."""
    gen = target.split(":")[-1] if target.startswith("gpu:") else target.split(":")[0]
    if gen not in MAKERS:
        raise ValueError(f"no hardware figures for target {target!r}; known: {', '.join(MAKERS)} "
                         "(estimate a CPU compile against one with --estimate-for NAME)")
    hw = MAKERS[gen]
    rows = read_calibration() if table is None else table
    if calibration_from:
        if gen in rows:
            raise ValueError(f"{gen} has its own calibration row (measured on {rows[gen]['measured'].get('device')}); "
                             f"drop --calibration-from {calibration_from}")
        if calibration_from not in rows:
            raise ValueError(f"--calibration-from {calibration_from}: the calibration table has no {calibration_from} "
                             f"row (run `hybridmoe calibrate` on a {calibration_from} chip); it has: "
                             f"{', '.join(sorted(rows)) or 'none'}")
        return carried(hw, calibration_from, rows[calibration_from])
    row = rows.get(gen) if use_calibration else None
    return calibrated(hw, row) if row else hw

