"""The figures a user reads, each against a number worked out by hand from the shapes, at 8
devices on several chips: the model's FLOPs per device (analysis/flops.py) of the training step
and of the GRPO update, the step estimate's totals (serial and overlapped time, tokens/s per chip,
MFU: analysis/step_estimate.py) on a two-devices-per-chip row and a one-device row, with a second
hand-written program for what the first leaves out (an op bound by HBM bandwidth, an fp8 matmul, an
all-reduce and a reduce-scatter), a layer pattern repeated over the layers, and the train loop's logged
tokens and tokens/s over two micro-batches.

The expected values are written out in the tests with their arithmetic in comments; nothing here
calls the code under test to get them. Each broken variant below is a realistic small bug of the
kind (a factor dropped, per device and per chip confused, one micro-batch counted, the overlapped
time summed) and `test_the_broken_variants_are_caught` watches the tests fail under it.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from broken_variants import mutated
from helpers import TWO_LAYERS, tiny_config
from hybridmoe.analysis import flops as flops_module
from hybridmoe.analysis import hlo_cost
from hybridmoe.analysis import step_estimate as se

DEVICES = 8

# ---------------------------------------------------------------------------------------------
# The model's FLOPs, by hand
#
# tiny with one layer of each mixer: V 256, D 64; attention N 4 query heads, G 2 kv heads, head
# dim A 16; GDN Hk 2 key heads, Hv 4 value heads, dk = dv = 16; MoE E 8 experts, k 2 per token,
# expert hidden F 32, shared expert hidden S 32. Multiply-adds (MACs) per token, forward:
#
#   attention layer  q and its gate  D x 2 N A = 64 x 128 =  8192
#                    k, v            D x 2 G A = 64 x  64 =  4096
#                    out             N A x D   = 64 x  64 =  4096
#                    core            q k^T and p v over the (T + 1) / 2 keys a query sees on
#                                    average: 2 x N A x (T + 1) / 2 = 64 (T + 1)
#   GDN layer        q, k            D x 2 Hk dk = 64 x 64  =  4096
#                    v, gate z       D x 2 Hv dv = 64 x 128 =  8192
#                    a, b            D x 2 Hv    = 64 x 8   =   512
#                    out             Hv dv x D   = 64 x 64  =  4096
#                    core            S k, S q, the rank-one update: 3 dk dv per value head
#                                    = 4 x 3 x 256 = 3072                       -> 19968
#   MoE block        router          D x E = 512
#                    routed experts  k x (D x 2F + F x D) = 2 x (4096 + 2048) = 12288
#                    shared expert   D x 2S + S x D + its gate D = 4096 + 2048 + 64 = 6208
#                                                                              -> 19008
#   LM head          D x V = 16384
#
# FLOPs = 2 x MACs; forward + backward = 3 x forward (the backward: input and weight gradients).

TRAIN = ("train.batch_size=16", "train.seq_len=64", "train.micro_batches=2")  # 2 micro-batches of 8


def _forward_flops_per_token(T: int) -> int:
    """The table above at sequence length T, in FLOPs (2 x MACs): attention, GDN, 2 MoE, LM head."""
    attention = 2 * (8192 + 4096 + 4096 + 64 * (T + 1))
    return attention + 2 * 19968 + 2 * (2 * 19008) + 2 * 16384


def test_training_step_model_flops_per_device_by_hand():
    # T = 64: attention 2 x (16384 + 64 x 65 = 4160) = 41088; GDN 39936; 2 MoE 76032; LM head 32768
    # -> 189824 forward FLOPs a token, x 3 = 569472 forward + backward.
    assert _forward_flops_per_token(64) == 189824
    # Tokens of a step: 8 rows x 64 tokens x 2 micro-batches = 1024 -> 583139328 FLOPs, over 8
    # devices 72892416 each.
    cfg = tiny_config(*TWO_LAYERS, *TRAIN)
    assert flops_module.step_flops(cfg) == 583_139_328
    assert flops_module.model_flops_per_device(cfg, DEVICES, "train") == 72_892_416


# GRPO: 8 prompts x 4 completions = 32 rollouts, 2 updates a rollout (2 mini-batches of 16 rows, each
# in 2 micro-batches of 8, one a batch shard), rows of 16 prompt + 16 new = 32 tokens.
GRPO = ("rl.prompts_per_step=8", "rl.group_size=4", "rl.updates_per_rollout=2", "rl.micro_batches=2",
        "rl.max_prompt_len=16", "rl.max_new_tokens=16")


@pytest.mark.parametrize("beta, per_device", [
    # T = 32: attention 2 x (16384 + 64 x 33 = 2112) = 36992, + 39936 + 76032 + 32768 = 185728
    # forward FLOPs a token, x 3 = 557184; one update's 16 rows x 32 tokens = 512 -> 285278208, over
    # 8 devices 35659776.
    (0.0, 35_659_776),
    # A reference policy (rl.beta > 0) adds its forward, a third of forward + backward:
    # 285278208 x 4 / 3 = 380370944, over 8 devices 47546368.
    (0.1, 47_546_368),
])
def test_grpo_update_model_flops_per_device_by_hand(beta, per_device):
    assert _forward_flops_per_token(32) == 185728
    cfg = tiny_config(*TWO_LAYERS, *GRPO, f"rl.beta={beta}")
    assert flops_module.model_flops_per_device(cfg, DEVICES, "grpo") == per_device
    assert se.tokens_per_step(cfg, "grpo") == 16 * 32  # one update's rows x their tokens


def test_the_designed_count_of_a_fully_rematerialised_step_by_hand():
    """designed_flops_per_device, the check of a compiled TPU step's FLOPs, at T = 64, gdn.chunk_size 8,
    remat full. Per token, forward (the table above): attention 41088, GDN 39936, 2 MoE 76032, LM
    head 32768. The GDN core runs chunked: 3 C K + 2 C V + 3 K V multiply-adds a value head in place
    of 3 K V, (3 x 8 x 16 + 2 x 8 x 16) = 640 more, x 4 value heads x 2 = 5120 FLOPs -> GDN 45056.
    Full remat runs the stack's forward twice: 4 x (41088 + 45056 + 76032) = 648704; the LM head 4 x
    32768 = 131072 (its logits recomputed in the chunked log-probs' backward); the flash backward's
    recomputation, 1.5 attention cores: 1.5 x 2 x 2 N A (T + 1) / 2 = 1.5 x 8320 = 12480. 792256 FLOPs
    a token x 1024 tokens over 8 devices = 101408768."""
    cfg = tiny_config(*TWO_LAYERS, *TRAIN, "gdn.chunk_size=8", "remat.policy=full")
    assert flops_module.designed_flops_per_device(cfg, DEVICES, "tpu") == 101_408_768
    assert flops_module.designed_flops_per_device(tiny_config(*TWO_LAYERS, *TRAIN, "remat.policy=auto"),
                                                  DEVICES, "tpu") is None  # resolved at trace time


# ---------------------------------------------------------------------------------------------
# The step estimate's totals, by hand

def test_totals_by_hand():
    """Compute 3 + 1 + 2 = 6 ms, collectives 4 ms: serial 10 ms, overlapped the larger, 6 ms; at
    4096 tokens on 2 chips, 204800 and 341333.3 tokens/s per chip; 3e12 model FLOPs a device over
    a 1e15 FLOP/s device: MFU 0.3 and 0.5."""
    cats = {"dense matmuls": {"s": 3e-3}, "attention": {"s": 1e-3}, "the rest": {"s": 2e-3},
            "collectives": {"s": 4e-3}}
    cats = {c: {"flops": 0.0, **v} for c, v in cats.items()}
    out = se.totals(cats, 1e15, tokens_per_step=4096, chips=2, model_flops_per_device=3e12)
    assert out["serial"]["step_s"] == pytest.approx(10e-3, rel=1e-12)
    assert out["overlapped"]["step_s"] == pytest.approx(6e-3, rel=1e-12)
    assert out["serial"]["tokens_per_s_per_chip"] == pytest.approx(204800.0, rel=1e-12)  # 4096 / 0.010 / 2
    assert out["overlapped"]["tokens_per_s_per_chip"] == pytest.approx(4096 / 0.006 / 2, rel=1e-12)
    assert out["serial"]["mfu"] == pytest.approx(0.3, rel=1e-12)  # 3e12 / (0.010 x 1e15)
    assert out["overlapped"]["mfu"] == pytest.approx(0.5, rel=1e-12)  # 3e12 / (0.006 x 1e15)
    # Collectives longer than the compute: the overlapped step is theirs.
    cats["collectives"]["s"] = 9e-3
    out = se.totals(cats, 1e15, tokens_per_step=4096, chips=2, model_flops_per_device=None)
    assert out["overlapped"]["step_s"] == pytest.approx(9e-3, rel=1e-12)
    assert out["serial"]["step_s"] == pytest.approx(15e-3, rel=1e-12)
    assert out["serial"]["mfu"] is None


# One bf16 matmul [4096, 4096] x [4096, 4096] and an all-gather of a [1024, 4096] bf16 shard over
# the 8 devices: 2 x 4096^3 = 137438953472 FLOPs (compute bound: 3 x 32 MiB = 100663296 bytes
# moved), 8192 x 4096 x 2 = 67108864 gathered bytes of which a device sends 7/8 = 58720256.
STEP_HLO = """HloModule figures

ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096], s: bf16[1024,4096]) -> (bf16[4096,4096], bf16[8192,4096]) {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %b = bf16[4096,4096]{1,0} parameter(1)
  %s = bf16[1024,4096]{1,0} parameter(2)
  %dot = bf16[4096,4096]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag = bf16[8192,4096]{1,0} all-gather(%s), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %out = (bf16[4096,4096]{1,0}, bf16[8192,4096]{1,0}) tuple(%dot, %ag)
}
"""
DOT_FLOPS, WIRE_BYTES = 137_438_953_472, 58_720_256

# (hardware row, chips the 8 devices are, per-device bf16 FLOP/s, per-device link bytes/s):
# TPU7x shows two devices a chip (2307 TFLOP/s and 600 GB/s each way per chip, halved per device);
# an H100 is one device a chip (989 TFLOP/s, 450 GB/s).
ROWS = {"tpu7x": (4, 1153.5e12, 300e9), "h100": (8, 989e12, 450e9)}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_compiled_step_estimate_at_8_devices_by_hand(row):
    """estimate_step on a hand-written program of the 8-device training step of TRAIN: compute,
    collective, serial and overlapped seconds, tokens/s per chip and MFU, each from the numbers
    above."""
    chips, bf16_per_device, link_per_device = ROWS[row]
    cfg = tiny_config(*TWO_LAYERS, *TRAIN)
    step = types.SimpleNamespace(
        cfg=cfg, program_name="train", program=types.SimpleNamespace(compiled_text=STEP_HLO),
        target=types.SimpleNamespace(name=f"{row}:2x2x2", num_devices=DEVICES, platform="tpu"))
    est = se.estimate_step(step, row)
    compute_s = DOT_FLOPS / bf16_per_device  # tpu7x: 1.1915e-4 s; h100: 1.3897e-4 s
    collective_s = WIRE_BYTES / link_per_device  # tpu7x: 1.9573e-4 s; h100: 1.3049e-4 s
    assert est["chips"] == chips and est["devices"] == DEVICES
    assert est["categories"]["dense matmuls"]["s"] == pytest.approx(compute_s, rel=1e-9)
    assert est["categories"]["collectives"]["s"] == pytest.approx(collective_s, rel=1e-9)
    assert est["tokens_per_step"] == 1024  # 8 rows x 64 tokens x 2 micro-batches
    assert est["model_flops_per_device"] == 72_892_416  # test_training_step_model_flops_per_device_by_hand
    for total, step_s in (("serial", compute_s + collective_s), ("overlapped", max(compute_s, collective_s))):
        r = est[total]
        assert r["step_s"] == pytest.approx(step_s, rel=1e-9), total
        assert r["tokens_per_s_per_chip"] == pytest.approx(1024 / step_s / chips, rel=1e-9), total
        assert r["mfu"] == pytest.approx(72_892_416 / (step_s * bf16_per_device), rel=1e-9), total


# A repeated layer pattern: 4 layers of [gdn, attention] are 2 of each mixer and 4 MoE blocks. At
# T = 64 (the table above): 2 x 41088 + 2 x 39936 + 4 x 38016 + 32768 = 346880 forward FLOPs a
# token, x 3 = 1040640; x 1024 tokens = 1065615360, over 8 devices 133201920.
def test_a_repeated_layer_pattern_counts_every_layer_by_hand():
    cfg = tiny_config("model.layer_pattern=[gdn,attention]", "model.num_layers=4", *TRAIN)
    assert flops_module.step_flops(cfg) == 1_065_615_360
    assert flops_module.model_flops_per_device(cfg, DEVICES, "train") == 133_201_920


# What the step above leaves out: an op bound by HBM bandwidth, an fp8 matmul (its own peak) and the
# reductions' wire bytes, in a second hand-written program over the 8 devices:
#   add of two bf16 [8192, 8192]: no FLOPs, 3 x 128 MiB = 402653184 bytes read and written;
#   fp8 dot [4096, 4096] x [4096, 4096] -> bf16: 137438953472 FLOPs at the fp8 peak, 64 MiB moved;
#   all-reduce of f32 [1024, 1024] (4 MiB): a ring sends 2 x 7/8 of it, 7340032 bytes;
#   reduce-scatter to a bf16 [512, 4096] shard (4 MiB): a ring sends 7 shards, 29360128 bytes.
MIXED_HLO = """HloModule mixed

%sum_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%sum_bf16 (c: bf16[], d: bf16[]) -> bf16[] {
  %c = bf16[] parameter(0)
  %d = bf16[] parameter(1)
  ROOT %t = bf16[] add(%c, %d)
}

ENTRY %main (x: bf16[8192,8192], y: bf16[8192,8192], p: f8e4m3fn[4096,4096], q: f8e4m3fn[4096,4096], g: f32[1024,1024], h: bf16[4096,4096]) -> (bf16[8192,8192], bf16[4096,4096], f32[1024,1024], bf16[512,4096]) {
  %x = bf16[8192,8192]{1,0} parameter(0)
  %y = bf16[8192,8192]{1,0} parameter(1)
  %p = f8e4m3fn[4096,4096]{1,0} parameter(2)
  %q = f8e4m3fn[4096,4096]{1,0} parameter(3)
  %g = f32[1024,1024]{1,0} parameter(4)
  %h = bf16[4096,4096]{1,0} parameter(5)
  %sum = bf16[8192,8192]{1,0} add(%x, %y)
  %dot8 = bf16[4096,4096]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[1024,1024]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum_f32
  %rs = bf16[512,4096]{1,0} reduce-scatter(%h), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%sum_bf16
  ROOT %out = (bf16[8192,8192]{1,0}, bf16[4096,4096]{1,0}, f32[1024,1024]{1,0}, bf16[512,4096]{1,0}) tuple(%sum, %dot8, %ar, %rs)
}
"""
ADD_BYTES, FP8_DOT_FLOPS, AR_WIRE, RS_WIRE = 402_653_184, 137_438_953_472, 7_340_032, 29_360_128
# Per device (a TPU7x chip is two devices: its figures halved): fp8 FLOP/s, HBM bytes/s, link bytes/s.
MIXED_ROWS = {"tpu7x": (4614e12 / 2, 7380e9 / 2, 300e9), "h100": (1979e12, 3350e9, 450e9)}


@pytest.mark.parametrize("row", sorted(MIXED_ROWS))
def test_memory_time_the_fp8_peak_and_the_reductions_wire_bytes_by_hand(row):
    fp8_per_device, hbm_per_device, link_per_device = MIXED_ROWS[row]
    hw = se.HARDWARE[row]
    assert hw.op_overhead_s == 0.0  # the makers' row: no fixed cost per op
    est = se.estimate(MIXED_HLO, hw, tokens_per_step=1024, chips=8 // hw.devices_per_chip, devices=DEVICES)
    cats = est["categories"]
    memory_s = ADD_BYTES / hbm_per_device  # tpu7x 1.0912e-4 s; h100 1.2019e-4 s
    assert cats["the rest"]["memory_s"] == pytest.approx(memory_s, rel=1e-9)
    assert cats["the rest"]["s"] == pytest.approx(memory_s, rel=1e-9)
    fp8_s = FP8_DOT_FLOPS / fp8_per_device  # compute bound: tpu7x 5.9574e-5 s; h100 6.9449e-5 s
    assert cats["dense matmuls"]["s"] == pytest.approx(fp8_s, rel=1e-9)
    assert est["collectives"]["all-reduce"]["wire_bytes"] == AR_WIRE
    assert est["collectives"]["reduce-scatter"]["wire_bytes"] == RS_WIRE
    collective_s = (AR_WIRE + RS_WIRE) / link_per_device
    assert cats["collectives"]["s"] == pytest.approx(collective_s, rel=1e-9)
    assert est["serial"]["step_s"] == pytest.approx(memory_s + fp8_s + collective_s, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# The train loop's logged tokens and tokens/s

def _targets_by_hand(segment_ids: np.ndarray) -> int:
    """Next-token targets of packed rows [..., T]: a run of n tokens of one document (id > 0) has
    n - 1 targets; padding (id 0) none. Counted run by run, over every row of every micro-batch."""
    total = 0
    for row in segment_ids.reshape(-1, segment_ids.shape[-1]).tolist():
        start = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[start]:
                total += (t - start - 1) if row[start] > 0 else 0
                start = t
    return total


# The loop's figures do not depend on the layers: one attention layer compiles fastest.
ONE_LAYER = ("model.layer_pattern=[attention]", "model.num_layers=1")


def test_the_train_loop_logs_every_micro_batchs_tokens_and_their_rate():
    """One step of 2 micro-batches x 8 rows x 16 tokens on the 8 devices: `tokens` is every
    target of both micro-batches (the synthetic batch counted run by run), and tokens_per_s is
    that count over the step's time. The loop's own broken variants run here, on the set-up the
    clean run keeps (no second trace)."""
    from hybridmoe.data.synthetic import synthetic_batch
    from hybridmoe.train import loop as train_loop

    cfg = tiny_config(*ONE_LAYER, "train.steps=1", "train.batch_size=16", "train.seq_len=16",
                      "train.micro_batches=2")
    rows = synthetic_batch(cfg.train.seed, 0, 2, 8, 16, cfg.model.vocab_size)
    want = _targets_by_hand(rows["segment_ids"])
    one_micro_batch = _targets_by_hand(rows["segment_ids"][0])
    assert 0 < one_micro_batch < want <= 2 * 8 * 15, (one_micro_batch, want)

    def check(rec):
        assert rec["tokens"] == want, (rec["tokens"], want)
        assert rec["tokens_per_s"] == pytest.approx(want / rec["step_time_s"], rel=1e-9)

    check(*train_loop.train(cfg, None, progress=False))
    for variant in LOOP_VARIANTS:
        with pytest.MonkeyPatch.context() as patch:
            for module, attr, value in _variants()[variant][0]():
                patch.setattr(module, attr, value)
            (rec,) = train_loop.train(cfg, None, progress=False)
        with pytest.raises(AssertionError):
            check(rec)


# ---------------------------------------------------------------------------------------------
# Broken variants: each a realistic small bug of the kind, [(module, attribute, broken value)] to
# patch in (built when asked: mutated() reads the source), and the tests that must catch it.

def _variants():
    from hybridmoe.run import setup as setup_module
    from hybridmoe.run import step as step_module
    from hybridmoe.train import loop as train_loop

    def fl(name, old, new):
        return [(flops_module, name, mutated(flops_module, name, old, new))]

    def est(name, old, new):
        return [(se, name, mutated(se, name, old, new))]

    step_by_hand = ["test_training_step_model_flops_per_device_by_hand"]
    grpo_by_hand = ["test_grpo_update_model_flops_per_device_by_hand"]
    estimate_by_hand = ["test_a_compiled_step_estimate_at_8_devices_by_hand"]
    loop = ["test_the_train_loop_logs_every_micro_batchs_tokens_and_their_rate"]
    repeated = ["test_a_repeated_layer_pattern_counts_every_layer_by_hand"]
    mixed = ["test_memory_time_the_fp8_peak_and_the_reductions_wire_bytes_by_hand"]

    def wire(old, new):
        return [(hlo_cost, "wire_bytes", mutated(hlo_cost, "wire_bytes", old, new))]
    return {
        # forward + backward counted as 2 forwards (the weight gradient's matmul forgotten)
        "backward_as_one_forward": (lambda: fl("component_flops", "3.0 * f * tokens", "2.0 * f * tokens"),
                                    step_by_hand + grpo_by_hand),
        # the MoE block's multiply-adds counted as FLOPs (the factor 2 dropped)
        "moe_macs_as_flops": (lambda: fl("forward_flops_per_token", '"moe": 2.0 * moe', '"moe": moe'),
                              step_by_hand + grpo_by_hand),
        # the attention core over every key, not the causal half
        "attention_core_not_causal": (lambda: fl("forward_flops_per_token", "(seq_len + 1) / 2", "seq_len"),
                                      step_by_hand + grpo_by_hand),
        # the step's FLOPs of one micro-batch
        "flops_of_one_micro_batch": (lambda: fl("step_flops", "t.batch_size if", "t.rows_per_micro_batch if"),
                                     step_by_hand + estimate_by_hand),
        # the GRPO update counted over every rollout of the step, not its mini-batch
        "grpo_flops_of_every_rollout": (lambda: fl("model_flops_per_device", "rows = r.rollouts_per_step // r.mini_batches",
                                                   "rows = r.rollouts_per_step"), grpo_by_hand),
        # the reference policy's forward counted as a whole forward + backward
        "grpo_reference_as_fwd_bwd": (lambda: fl("model_flops_per_device", "1 / 3 if r.beta", "1 if r.beta"),
                                      grpo_by_hand),
        # per chip and per device confused: the peak of a chip given to each of its devices ...
        "chip_peak_per_device": (lambda: [(se.Hardware, "per_device", lambda self, value: value)], estimate_by_hand),
        # ... or the chips counted as devices
        "chips_as_devices": (lambda: est("estimate_step", "chips=max(1, devices // hw.devices_per_chip)",
                                         "chips=devices"), estimate_by_hand),
        # tokens of one micro-batch
        "tokens_of_one_micro_batch": (lambda: est("tokens_per_step", "t.batch_size * t.seq_len",
                                                  "t.rows_per_micro_batch * t.seq_len"), estimate_by_hand),
        # the overlapped time as the sum (collectives not hidden at all)
        "overlapped_as_sum": (lambda: est("totals", "rates(max(compute_s, collective_s))",
                                          "rates(compute_s + collective_s)"),
                              ["test_totals_by_hand"] + estimate_by_hand),
        # the overlapped time as the compute alone (collectives free)
        "overlapped_as_compute": (lambda: est("totals", "rates(max(compute_s, collective_s))", "rates(compute_s)"),
                                  ["test_totals_by_hand"] + estimate_by_hand),
        # the layer pattern's mixers counted once, not once per layer that repeats them
        "layers_of_the_pattern_once": (lambda: fl("step_flops", "for kind in m.layer_kinds", "for kind in m.layer_pattern"),
                                       repeated),
        # a device's memory time at its chip's HBM bandwidth (per chip and per device confused)
        "memory_time_at_the_chips_bandwidth": (lambda: est("op_seconds", "memory = c.bytes / hw.hbm_bytes_per_s",
                                                           "memory = c.bytes / hw.hbm_bytes_per_s_chip"), mixed),
        # an fp8 matmul timed at the bf16 peak
        "fp8_at_the_bf16_peak": (lambda: est("op_seconds", "(hw.fp8_flops if c.fp8 else hw.bf16_flops)", "hw.bf16_flops"),
                                 mixed),
        # an all-reduce's ring sending its buffer once (the reduce-scatter half only)
        "all_reduce_sent_once": (lambda: wire('"all-reduce": 2 * result_bytes', '"all-reduce": result_bytes'), mixed),
        # a reduce-scatter's wire bytes as a fraction of its result (the shard), not of its input
        "reduce_scatter_over_n": (lambda: wire('"reduce-scatter": result_bytes * (n - 1),',
                                               '"reduce-scatter": result_bytes * (n - 1) / n,'), mixed),
        # the designed count without the flash backward's recomputation of the attention core
        "designed_without_flash_recompute": (lambda: fl("designed_step_flops", "per_token += 1.5 * attention_core",
                                                        "per_token += 0.5 * attention_core"),
                                             ["test_the_designed_count_of_a_fully_rematerialised_step_by_hand"]),
        # the loop's rate per device
        "tokens_per_s_per_device": (lambda: [(train_loop, "train", mutated(
            train_loop, "train", '"tokens_per_s": m["tokens"] / dt', '"tokens_per_s": m["tokens"] / dt / 8'))], loop),
        # the step's token count of its first micro-batch only
        "step_tokens_of_one_micro_batch": (lambda: [(setup_module, "train_step", mutated(
            step_module, "train_step", "loss_mask(seg.reshape(-1, seg.shape[-1]))", "loss_mask(seg[0])"))], loop),
    }


VARIANT_NAMES = ("backward_as_one_forward", "moe_macs_as_flops", "attention_core_not_causal",
                 "flops_of_one_micro_batch", "grpo_flops_of_every_rollout", "grpo_reference_as_fwd_bwd",
                 "chip_peak_per_device", "chips_as_devices", "tokens_of_one_micro_batch", "overlapped_as_sum",
                 "overlapped_as_compute", "tokens_per_s_per_device", "step_tokens_of_one_micro_batch",
                 "layers_of_the_pattern_once", "memory_time_at_the_chips_bandwidth", "fp8_at_the_bf16_peak",
                 "all_reduce_sent_once", "reduce_scatter_over_n", "designed_without_flash_recompute")
# Bugs of the loop's Python, run by the loop's test on its kept set-up.
LOOP_VARIANTS = ("tokens_per_s_per_device",)
# A variant of the jitted step compiles a step of its own (13 s cold here): it repeats the default
# suite's check of the loop's count in the slow suite only.
SLOW_VARIANTS = ("step_tokens_of_one_micro_batch",)


def _run_test(name: str) -> None:
    """Run the named test of this file with each of its parameter sets."""
    fn = globals()[name]
    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
    if not marks:
        fn()
        return
    names, values = marks[0].args
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    for value in values:
        fn(**dict(zip(names, value if len(names) > 1 else (value,))))


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v in SLOW_VARIANTS else v
                                     for v in VARIANT_NAMES if v not in LOOP_VARIANTS])
def test_the_broken_variants_are_caught(variant, monkeypatch):
    patches, tests = _variants()[variant]
    for module, attr, value in patches():
        monkeypatch.setattr(module, attr, value)
    for name in tests:
        with pytest.raises(AssertionError):
            _run_test(name)


def test_every_broken_variant_is_run():
    assert set(VARIANT_NAMES) == set(_variants())


def test_the_row_tiles_routed_rows_round_the_tile_count_up():
    """CPU row tiles of R = 64 rows, tiny's E 8 experts, k 2: 100 tokens a shard route 200 rows,
    cdiv(200, 64) = 4 tiles (the last one part-filled) + 8 = 12 tiles of 64 rows computed: 7.68 rows a
    token; at 128 tokens, 256 / 64 = 4 exactly, 12 x 64 / 128 = 6. Another grouped matmul: k rows."""
    cfg = tiny_config(*TWO_LAYERS, "kernels.gmm.xla_impl=row_tiles", "kernels.gmm.xla_tile_rows=64")
    assert flops_module.routed_rows_per_token(cfg, 100) == 12 * 64 / 100
    assert flops_module.routed_rows_per_token(cfg, 128) == 6.0
    ragged = tiny_config(*TWO_LAYERS, "kernels.gmm.xla_impl=ragged_dot", "kernels.gmm.xla_tile_rows=64")
    assert flops_module.routed_rows_per_token(ragged, 100) == 2.0


# A loop of 3 trips (XLA's known_trip_count) around the all-reduce of MIXED_HLO's f32 [1024, 1024]
# over the 8 devices: 3 x 7340032 = 22020096 bytes sent per device.
LOOPED_AR_HLO = """HloModule looped_ar

%sum_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %p = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %g = f32[1024,1024]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %ar = f32[1024,1024]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum_f32
  ROOT %t = (s32[], f32[1024,1024]{1,0}) tuple(%next, %ar)
}

%cond (c: (s32[], f32[1024,1024])) -> pred[] {
  %c = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (g0: f32[1024,1024]) -> f32[1024,1024] {
  %g0 = f32[1024,1024]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024,1024]{1,0}) tuple(%zero, %g0)
  %w = (s32[], f32[1024,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[1024,1024]{1,0} get-tuple-element(%w), index=1
}
"""


def test_a_collective_in_a_loop_sends_its_bytes_every_trip():
    """The all-reduce runs 3 times: 22020096 bytes per device, on h100's 450 GB/s links 48.93 us,
    the GiB printed the same 3 trips' (0.0205 GiB)."""
    est = se.estimate(LOOPED_AR_HLO, se.HARDWARE["h100"], tokens_per_step=1024, chips=8, devices=DEVICES)
    ar = est["collectives"]["all-reduce"]
    assert ar["wire_bytes"] == 3 * AR_WIRE == 22_020_096
    assert ar["s"] == pytest.approx(3 * AR_WIRE / 450e9, rel=1e-9)
    assert est["categories"]["collectives"]["bytes"] == 3 * AR_WIRE
    assert "0.0205 GiB sent per device" in se.format_estimate(est)
