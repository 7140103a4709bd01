"""On a TPU the micro-batch search judges a program by the default memory space of XLA's
memory-usage report, which the TPU compiler checks against HBM, not by memory_analysis' sum, whose
temporaries count far more than the heap buffer assignment packs (run/memory_fit.compile_measured).
Compiled for compile-only devices of tests/tpu_target.py's topology on this CPU host, on attention
layers only (helpers.ATTENTION_LAYERS: the search reads the program's memory, whatever its mixer)."""

from __future__ import annotations

from helpers import ATTENTION_LAYERS
from hybridmoe.recipe.load import load_config
from hybridmoe.run import memory_fit
from hybridmoe.run.setup import build
from hybridmoe.run.step_plan import plan_train, train_measured
from tests.tpu_target import TOPOLOGY


def test_a_tpu_program_s_need_is_its_default_memory_space_and_the_search_keeps_a_count_that_fits_by_it():
    from hybridmoe.tools.train_program import tpu_target

    target = tpu_target(TOPOLOGY)
    # 16 sequences of 256 over the 8 devices' batch shards: the counts 1 and 2.
    cfg = load_config("tiny", ["mesh.cpu_devices=0", "train.batch_size=16", "train.seq_len=256", *ATTENTION_LAYERS],
                      platform="tpu")
    setup = build(cfg, list(target.devices))
    compiled, need = train_measured(setup, 1)
    summed = memory_fit.program_bytes(compiled)
    state = memory_fit.per_device_bytes(setup.abstract_state())
    # The heap holds the arguments (the state among them) and is smaller than the sum's temporaries say.
    assert state < need < summed, (state, need, summed)
    # A budget between the two: the count of 1 fits as the chip's compiler packs it (by the sum it
    # would not, and the search would take 2 micro-batches the device does not need).
    fit = plan_train(setup, (need + summed) // 2, setting="auto")
    assert fit.count == 1 and fit.need == need and fit.compiled is compiled


def test_inspect_chooses_an_auto_count_for_a_compile_only_target_as_a_run_does():
    """`hybridmoe inspect` of a program whose count is auto searches the counts against the target's
    HBM (tools/train_program.compile_step): with HBM set between the default spaces at 1 and 2
    micro-batches (read here from each count's own compile), 1 is compiled and over, 2 chosen."""
    import dataclasses

    from hybridmoe.run.memory_fit import with_count
    from hybridmoe.tools import train_program as tp

    target = tp.tpu_target(TOPOLOGY)
    cfg = load_config("tiny", ["mesh.cpu_devices=0", "train.batch_size=16", "train.seq_len=256", *ATTENTION_LAYERS],
                      platform="tpu")
    need = {m: tp.fit_bytes(tp.memory_facts(tp.compile_one(with_count(cfg, "train.micro_batches", m), target).program,
                                            None)) for m in (1, 2)}
    assert need[1] > need[2], need
    tight = dataclasses.replace(target, hbm_bytes_per_device=(need[1] + need[2]) // 2)
    step = tp.compile_step(cfg, tight)
    search = step.count_search
    assert step.cfg.train.micro_batches == 2 and search["chosen"] == 2, search
    assert [(t["count"], t["compiled"], t["need"], t["fits"]) for t in search["tried"]] == [
        (1, True, need[1], False), (2, True, need[2], True)]
    assert "train.micro_batches=auto: 2 chosen" in tp.format_count_search(search)
