"""`hybridmoe bench` on the chip's terms: one arm's state on the device at a time, an arm that cannot
fit refused before anything runs, and the step-time model's estimate beside each measured time."""

import pytest

from hybridmoe.tools.bench import Arm, fit_problems, program_bytes, run_bench
from tests.helpers import TWO_LAYERS

GIB = 2**30


def test_program_bytes_is_arguments_temporaries_and_unaliased_outputs():
    # 3 GiB of arguments (the state and batch), 2 of temporaries, 3 of outputs of which 2.5 reuse a
    # donated argument's buffer: 3 + 2 + 3 - 2.5 = 5.5 GiB at the peak.
    figures = {"argument": 3 * GIB, "temp": 2 * GIB, "output": 3 * GIB, "alias": int(2.5 * GIB)}
    assert program_bytes(figures) == int(5.5 * GIB)


def test_each_arm_is_checked_alone_against_the_free_memory():
    small = Arm("small", [], None, program={"argument": 4 * GIB, "temp": 4 * GIB, "output": 4 * GIB, "alias": 4 * GIB})
    large = Arm("large", [], None, program={"argument": 8 * GIB, "temp": 6 * GIB, "output": 8 * GIB, "alias": 8 * GIB})
    # 8 and 14 GiB against 10.4 free (the chip after another program's arrays): only `large` is refused,
    # though the two together (22) would not fit: one arm's state is on the device at a time.
    problems = fit_problems([small, large], int(10.4 * GIB))
    assert len(problems) == 1 and problems[0].startswith("--arm large:")
    assert "14.00 GiB" in problems[0] and "10.40 GiB free" in problems[0] and "remat" in problems[0]
    assert fit_problems([small, large], None) == []  # a CPU keeps no figures: unchecked


def test_bench_refuses_arms_that_cannot_fit_before_timing(monkeypatch):
    """The arms of tests/test_cli.py's bench (their programs in the compile cache) on a device with
    one byte free: both named, and no step runs."""
    from hybridmoe.tools import bench

    monkeypatch.setattr(bench, "_timed_visit", lambda *a: pytest.fail("an arm was timed"))
    with pytest.raises(ValueError, match="nothing was timed") as e:
        run_bench("tiny", [*TWO_LAYERS, "bench.steps=2", "train.seq_len=16"],
                  [("control", []), ("no_remat", ["remat.policy=none"])], 2, free_bytes=1)
    assert "--arm control:" in str(e.value) and "--arm no_remat:" in str(e.value)


def test_bench_can_leave_out_an_arm_that_cannot_fit():
    """skip_unfit (the chip's step benchmark): the refused arm says why and nothing of it is timed;
    the table prints it as refused."""
    from hybridmoe.tools.bench import format_table

    out = run_bench("tiny", [*TWO_LAYERS, "bench.steps=2", "train.seq_len=16"],
                    [("control", []), ("no_remat", ["remat.policy=none"])], 2, free_bytes=1, skip_unfit=True)
    assert set(out) == {"control", "no_remat"} and all("refused" in a and "step_times_s" not in a for a in out.values())
    assert "refused: its step needs" in format_table(out)


def test_traced_ops_go_to_the_category_of_their_instruction():
    """A profile's op names are the compiled program's instruction names: each op's seconds go to the
    category the model gives that instruction; a name the model's walk does not list is kept apart."""
    from hybridmoe.tools.profile import UNMATCHED, by_category

    text = """HloModule step

ENTRY %main (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  %dot.1 = bf16[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/gdn_core/dot_general"}
  %dot.2 = bf16[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/mlp/dot_general"}
  ROOT %add.3 = bf16[64,64]{1,0} add(%dot.1, %dot.2), metadata={op_name="jit(step)/add"}
}
"""
    got = by_category({"dot.1": 2e-3, "dot.2": 1.5e-3, "add.3": 1e-3, "copy-start.9": 5e-4}, text)
    assert got["GDN"] == 2e-3 and got["dense matmuls"] == 1.5e-3 and got["the rest"] == 1e-3
    assert got[UNMATCHED] == 5e-4 and got["attention"] == 0.0


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
    monkeypatch.setattr(bench, "measure_peak_flops", lambda mesh, dtype: peak)
    out = run_bench("tiny", [*TWO_LAYERS, "bench.steps=2", "train.seq_len=16"], [("control", ["train.micro_batches=2"])], 2,
                    free_bytes=None)
    arm = out["control"]
    t = arm["config"]["train"]
    assert t["micro_batches"] == 2
    tokens = 2 * t["batch_size"] * 16
    assert arm["seconds_per_step"] == step_s and arm["tokens_per_step"] == tokens
    assert arm["tokens_per_s_per_device"] == pytest.approx(tokens / step_s / 8, rel=1e-12)
    assert arm["useful_flops_per_step"] == 551040 * tokens
    assert arm["useful_mfu"] == pytest.approx(551040 * tokens / 8 / step_s / peak, rel=1e-12)
    assert arm["mfu"] == pytest.approx(arm["program"]["flops_per_device"] / step_s / peak, rel=1e-12)
