"""`hybridmoe bench` on the chip's terms: one arm's state on the device at a time, whether an arm fits
judged by the device (its compiler and runtime, their figures recorded), MFU against the chip's
ceiling, and the step-time model's estimate beside each measured time."""

import pytest

import jax
import numpy as np

from hybridmoe.tools.bench import arguments_refusal, run_bench
from hybridmoe.analysis.device_refusal import device_refusal
from tests.helpers import TWO_LAYERS

GIB = 2**30
ARMS_COMMON = [*TWO_LAYERS, "bench.steps=2", "train.seq_len=16"]
# The chip's words (2026-12-06, TPU v5e, libtpu with JAX 0.10.2) and another libtpu's compile form.
COMPILER_NO = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(19.76G) exceeds available HBM (15.75G).")
COMPILER_NO_USED = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
                    "Used 17.14G of 15.48G hbm. Exceeded hbm capacity by 1.66G.")
RUNTIME_NO = ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 4.39G. That was not "
              "possible. There are 2.30G free.; (0x0x0_HBM0)")


def test_the_devices_refusals_are_read_with_its_own_figures():
    got = device_refusal(jax.errors.JaxRuntimeError(COMPILER_NO))
    assert got["when"] == "compile" and got["what"] == "HLO temporaries"
    assert got["needed_bytes"] == round(19.76 * GIB) and got["available_bytes"] == round(15.75 * GIB)
    used = device_refusal(COMPILER_NO_USED)
    assert used["when"] == "compile" and (used["needed_bytes"], used["available_bytes"]) == (
        round(17.14 * GIB), round(15.48 * GIB))
    run = device_refusal(RUNTIME_NO)
    assert run["when"] == "run" and run["needed_bytes"] == round(4.39 * GIB) and run["available_bytes"] == round(2.30 * GIB)
    assert device_refusal("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 196.00M. "
                          "That was not possible. There are 60.94M free.")["needed_bytes"] == round(196.00 * 2**20)
    vague = device_refusal("INTERNAL: CompileTimeScopedVmemOom: something", "compile")
    assert vague["when"] == "compile" and vague["needed_bytes"] is None and "VmemOom" in vague["message"]
    assert device_refusal("INVALID_ARGUMENT: shapes differ") is None


def test_a_refusals_two_figures_each_keep_their_own_unit():
    """The runtime asks for gigabytes with megabytes free: 4.39 GiB needed, 512 MiB available (not
    512 GiB); the compiler's form with a kibibyte figure the same way."""
    run = device_refusal("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 4.39G. "
                         "That was not possible. There are 512.00M free.")
    assert (run["needed_bytes"], run["available_bytes"]) == (round(4.39 * GIB), 512 * 2**20)
    compile_no = device_refusal("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 1.50G of 900.00K hbm.")
    assert (compile_no["needed_bytes"], compile_no["available_bytes"]) == (round(1.5 * GIB), 900 * 2**10)


def test_only_the_arguments_are_judged_before_the_device_is_asked():
    """The chip's `default` arm: arguments 2.66 GiB, XLA's temporaries 14.02 (16.68 summed) against
    15.75 free, and `hybridmoe train` runs it: not refused. Arguments of 16 GiB cannot be on the
    device at all: refused, with those figures."""
    chip_default = {"argument": int(2.66 * GIB), "temp": int(14.02 * GIB), "output": int(2.66 * GIB),
                    "alias": int(2.66 * GIB)}
    assert arguments_refusal(chip_default, int(15.75 * GIB)) is None
    got = arguments_refusal({**chip_default, "argument": 16 * GIB}, int(15.75 * GIB))
    assert got["needed_bytes"] == 16 * GIB and got["available_bytes"] == int(15.75 * GIB)
    assert arguments_refusal({"argument": 16 * GIB}, None) is None  # a CPU keeps no figures: unchecked


def _stub_timing(monkeypatch, bench, step_s=0.25, runtime_no=()):
    """Each visit adds `steps` steps of step_s; an arm named in runtime_no meets the runtime's refusal."""
    def visit(arm, setup, compiled, visit, steps, profile=0):
        if arm.name in runtime_no:
            raise jax.errors.JaxRuntimeError(RUNTIME_NO)
        arm.times.extend([step_s] * steps)
    monkeypatch.setattr(bench, "_timed_visit", visit)
    monkeypatch.setattr(bench, "peak_flops", lambda mesh, dtype: (1e12, "stub"))


def test_the_device_judges_each_arm_and_its_figures_are_recorded(monkeypatch):
    """Four arms on a device with 15.75 GiB free, the memory analysis stubbed with the chip's figures:
    `fits` (16.68 GiB summed, arguments 2.66: timed, as `train` runs it), `compiler_no` (the compiler
    refuses it: 19.76 against 15.75), `runtime_no` (an allocation refused at its visit: 4.39 against
    2.30) and `huge_state` (arguments 16 GiB: refused before anything runs). No traceback reaches the
    caller; each refusal carries the device's numbers."""
    from hybridmoe.tools import bench

    chip = {"argument": int(2.66 * GIB), "temp": int(14.02 * GIB), "output": int(2.66 * GIB), "alias": int(2.66 * GIB),
            "generated_code": 0}
    figures = iter([chip, chip, {**chip, "argument": 16 * GIB}])  # fits, runtime_no, huge_state (compiler_no has none)
    monkeypatch.setattr(bench, "memory_figures", lambda compiled: next(figures))
    real_compile = bench.compile_lowered
    compiled_arms = []

    def compile_lowered(lowered):
        compiled_arms.append(lowered)
        if len(compiled_arms) == 2:  # the second arm: compiler_no
            raise jax.errors.JaxRuntimeError(COMPILER_NO)
        return real_compile(lowered)

    monkeypatch.setattr(bench, "compile_lowered", compile_lowered)
    _stub_timing(monkeypatch, bench, runtime_no={"runtime_no"})
    out = run_bench("tiny", ARMS_COMMON, [("fits", []), ("compiler_no", []), ("runtime_no", []), ("huge_state", [])],
                    2, free_bytes=int(15.75 * GIB), skip_unfit=True)
    assert out["fits"]["seconds_per_step"] == 0.25 and "refused" not in out["fits"]
    no = out["compiler_no"]["device_refusal"]
    assert (no["when"], no["needed_bytes"], no["available_bytes"]) == ("compile", round(19.76 * GIB), round(15.75 * GIB))
    assert "19.76 GiB against 15.75 GiB available" in out["compiler_no"]["refused"]
    run = out["runtime_no"]["device_refusal"]
    assert (run["when"], run["needed_bytes"], run["available_bytes"]) == ("run", round(4.39 * GIB), round(2.30 * GIB))
    assert "step_times_s" not in out["runtime_no"]
    huge = out["huge_state"]["device_refusal"]
    assert (huge["needed_bytes"], huge["available_bytes"]) == (16 * GIB, int(15.75 * GIB))
    assert "16.00 GiB" in out["huge_state"]["refused"] and "15.75 GiB free" in out["huge_state"]["refused"]
    assert all("Traceback" not in a.get("refused", "") for a in out.values())


def test_an_error_that_is_not_about_memory_is_not_a_refusal(monkeypatch):
    from hybridmoe.tools import bench

    def broken(lowered):
        raise jax.errors.JaxRuntimeError("INTERNAL: the compiler crashed")
    monkeypatch.setattr(bench, "compile_lowered", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="crashed"):
        run_bench("tiny", ARMS_COMMON, [("control", [])], 2, free_bytes=None, skip_unfit=True)


def test_bench_refuses_arms_whose_state_cannot_be_on_the_device_before_timing(monkeypatch):
    """The arms of tests/test_cli.py's bench (their programs in the compile cache) on a device with
    one byte free: their arguments alone cannot be there; both named, and no step runs; with
    skip_unfit (the chip's step benchmark) each says why and the table prints it as refused."""
    from hybridmoe.tools import bench
    from hybridmoe.tools.bench import format_table

    monkeypatch.setattr(bench, "_timed_visit", lambda *a: pytest.fail("an arm was timed"))
    arms = [("control", []), ("no_remat", ["remat.policy=none"])]
    with pytest.raises(ValueError, match="nothing was timed") as e:
        run_bench("tiny", ARMS_COMMON, arms, 2, free_bytes=1)
    assert "--arm control:" in str(e.value) and "--arm no_remat:" in str(e.value)
    out = run_bench("tiny", ARMS_COMMON, arms, 2, free_bytes=1, skip_unfit=True)
    assert set(out) == {"control", "no_remat"} and all("refused" in a and "step_times_s" not in a for a in out.values())
    assert "refused: the step's arguments" in format_table(out)


class _Device:
    def __init__(self, kind, platform="tpu"):
        self.device_kind, self.platform = kind, platform


class _Mesh:
    def __init__(self, *devices):
        self.devices = np.array(devices, dtype=object)
        self.size = len(devices)


def test_the_peak_is_the_calibration_row_per_device_or_a_large_matmul(monkeypatch):
    """The chip's calibration (163.9 TFLOP/s a v5e chip, one device a chip; a tpu7x chip shows two
    devices: 4000 a chip is 2000 a device); a generation with no row measures 8192^3 on the spot (a
    TPU) or 1024^3 (a CPU), and the source says which."""
    from hybridmoe.analysis import hardware
    from hybridmoe.tools import bench

    table = {"v5e": {"bf16_flops_chip": 163.9e12, "measured": {"device": "TPU v5 lite", "commit": "abc",
                                                               "matmul": "8192^3 bf16"}},
             "tpu7x": {"bf16_flops_chip": 4000e12, "measured": {}}}
    monkeypatch.setattr(hardware, "read_calibration", lambda *a: table)
    sizes = []
    monkeypatch.setattr(bench, "measure_peak_flops", lambda mesh, dtype, size=None: sizes.append(size) or 7e12)
    peak, source = bench.peak_flops(_Mesh(_Device("TPU v5 lite")), np.dtype("float32"))
    assert peak == 163.9e12 and "v5e calibration row" in source
    assert bench.peak_flops(_Mesh(_Device("TPU7x"), _Device("TPU7x")), np.dtype("float32"))[0] == 2000e12
    peak, source = bench.peak_flops(_Mesh(_Device("TPU v6 lite")), np.dtype("float32"))
    assert (peak, sizes[-1]) == (7e12, 8192) and "8192^3" in source
    assert bench.peak_flops(_Mesh(_Device("cpu", "cpu")), np.dtype("float32"))[0] == 7e12 and sizes[-1] == 1024


def test_the_arms_rates_by_hand(monkeypatch):
    """tokens/s per device and the useful MFU of an arm whose steps took 0.25 s each against a peak
    of 1e12 FLOP/s per device (the timing and the peak measurement stubbed; the arm is test_cli's
    control at two micro-batches). Its model FLOPs by hand (tests/test_figures.py's
    table at T = 16): attention 2 x (16384 + 64 x 17) = 34944, GDN 39936, 2 MoE 76032, LM head 32768
    -> 183680 forward FLOPs a token, x 3 = 551040 forward + backward."""
    from hybridmoe.tools import bench

    step_s, peak = 0.25, 1e12
    monkeypatch.setattr(bench, "_timed_visit", lambda arm, setup, compiled, visit, steps, profile=0:
                        arm.times.extend([step_s] * steps))
    monkeypatch.setattr(bench, "peak_flops", lambda mesh, dtype: (peak, "a stub's peak"))
    monkeypatch.setattr(bench, "hlo_flops", lambda text: 3.5e9 if "ENTRY" in text else None)  # the program's count
    out = run_bench("tiny", ARMS_COMMON, [("control", ["train.micro_batches=2", "train.batch_size=16"])], 2,
                    free_bytes=None)
    arm = out["control"]
    assert arm["program"]["flops_per_device"] == 3.5e9 and arm["program"]["xla_cost_flops_per_device"] > 0
    t = arm["config"]["train"]
    assert t["micro_batches"] == 2 and t["batch_size"] == 16
    tokens = 16 * 16  # the step's 16 sequences of 16 tokens, in 2 micro-batches of 8
    assert arm["seconds_per_step"] == step_s and arm["tokens_per_step"] == tokens
    assert arm["tokens_per_s_per_device"] == pytest.approx(tokens / step_s / 8, rel=1e-12)
    assert arm["useful_flops_per_step"] == 551040 * tokens
    assert arm["useful_mfu"] == pytest.approx(551040 * tokens / 8 / step_s / peak, rel=1e-12)
    assert arm["mfu"] == pytest.approx(3.5e9 / step_s / peak, rel=1e-12)
    assert arm["peak_flops_per_device"] == peak and arm["peak_source"] == "a stub's peak"
    assert 0 <= arm["useful_mfu"] <= 1 and 0 <= arm["mfu"] <= 1

