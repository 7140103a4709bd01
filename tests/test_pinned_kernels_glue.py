"""Glue of the kernels and the layout pinned to hand-worked answers: the weight-split refusal's
message (model/fit.py), the local launcher's command lines and exit status (parallel/launch.py),
the fused SwiGLU epilogue's tile layout and float32 math (kernels/gmm/epilogue.py) and the chunked
log-probs at a vocabulary and a token count the chunks do not divide (kernels/logprobs.py)."""

from __future__ import annotations

import math
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.config.schema import ModelConfig
from hybridmoe.kernels import logprobs
from hybridmoe.kernels.gmm import epilogue
from hybridmoe.model import fit
from hybridmoe.parallel import launch
from hybridmoe.parallel.rules import DEFAULT_RULES

# One block of (gdn, attention): 2 layers; 6 routed experts.
MODEL = dict(vocab_size=10, d_model=8, num_layers=2, layer_pattern=("gdn", "attention"), num_heads=4, num_kv_heads=2,
             head_dim=8, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_dim=3, gdn_value_dim=5,
             num_experts=6, num_experts_per_tok=2, moe_intermediate_size=7, shared_expert_intermediate_size=9)


def test_weight_split_refusal_names_the_field_the_shards_and_the_weights():
    # 6 experts over expert=4: each block's wi and wo (4 weights); D 8 splits over 4 (the dense FSDP split)
    problems = fit.sharding_problems(ModelConfig(**MODEL), DEFAULT_RULES, {"expert": 4})
    assert problems == [("model.num_experts",
                         "a dimension of 6 does not split over the 4 shards of mesh.expert=4, which the rules give "
                         "logical axis 'exp' (blocks/0/moe/wi, blocks/0/moe/wo, blocks/1/moe/wi and 1 more); "
                         "make it a multiple of 4 or change the mesh")]
    # 8 experts: nothing; an axis of size 1 or not known yet is not checked
    assert fit.sharding_problems(ModelConfig(**{**MODEL, "num_experts": 8}), DEFAULT_RULES, {"expert": 4}) == []
    assert fit.sharding_problems(ModelConfig(**MODEL), DEFAULT_RULES, {"expert": 1, "tensor": 1}) == []


def test_weight_split_refusal_multiplies_the_axes_a_dimension_takes():
    # D 8 over fsdp 2 x context 3 = 6 shards. Dense weights take fsdp x context x expert (expert 1: still
    # named): per gdn layer 2 norms + 6 projections and wo + router and 3 shared-expert weights = 13, per
    # attention layer 2 + 4 + 4 = 10, and embed, final_norm, lm_head: 26 weights. The routed experts'
    # D takes fsdp x context only (expert holds their experts): wi and wo of 2 layers.
    problems = fit.sharding_problems(ModelConfig(**MODEL), DEFAULT_RULES, {"fsdp": 2, "context": 3, "expert": 1})
    assert problems == [
        ("model.d_model", "a dimension of 8 does not split over the 6 shards of mesh.fsdp=2 x mesh.context=3 x "
                          "mesh.expert=1, which the rules give logical axis 'embed' (blocks/0/input_norm, "
                          "blocks/0/mixer/wa, blocks/0/mixer/wb and 23 more); make it a multiple of 6 or change the mesh"),
        ("model.d_model", "a dimension of 8 does not split over the 6 shards of mesh.fsdp=2 x mesh.context=3, which "
                          "the rules give logical axis 'embed' (blocks/0/moe/wi, blocks/0/moe/wo, blocks/1/moe/wi and "
                          "1 more); make it a multiple of 6 or change the mesh")]


def test_process_argv_adds_the_distributed_mesh_keys():
    assert launch.process_argv(["train", "tiny"], 3, 1, 4567) == [
        sys.executable, "-m", "hybridmoe", "train", "tiny", "mesh.distributed=true",
        "mesh.coordinator_address=127.0.0.1:4567", "mesh.num_processes=3", "mesh.process_id=1"]


class _FakeProc:
    def __init__(self, codes):
        self.codes = list(codes)
        self.killed = False

    def poll(self):
        if self.killed:
            return -9
        return self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]

    def kill(self):
        self.killed = True

    def wait(self):
        return None


def _launch(monkeypatch, codes_per_process):
    procs = [_FakeProc(c) for c in codes_per_process]
    made = []

    def popen(argv, stdout=None):
        made.append((argv, stdout))
        return procs[len(made) - 1]

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    code = launch.launch(["train", "tiny"], len(procs), port=999, poll_s=0)
    return code, procs, made


def test_launch_returns_zero_when_every_process_ends_well(monkeypatch):
    code, procs, made = _launch(monkeypatch, [[None, 0], [None, None, 0]])
    assert code == 0 and not any(p.killed for p in procs)
    assert made[0][1] is None and made[1][1] == launch.subprocess.DEVNULL  # process 0 speaks for the run
    assert made[1][0][-1] == "mesh.process_id=1" and made[0][0][-2] == "mesh.num_processes=2"


def test_launch_returns_the_first_failure_and_stops_the_others(monkeypatch):
    code, procs, _ = _launch(monkeypatch, [[None], [None, 3]])
    assert code == 3 and procs[0].killed
    # killed by a signal (negative status): 128 + the signal, as a shell reports it
    code, _, _ = _launch(monkeypatch, [[None], [-15]])
    assert code == 128 + 15


# ---------------------------------------------------------------------------------------------
# kernels/gmm/epilogue.py


def test_per_tile_layout_interleaves_gate_and_up_tiles():
    # F 4, tiles of 2 per half: [g0 g1 | u0 u1 | g2 g3 | u2 u3]
    gate = jnp.array([[0.0, 1.0, 2.0, 3.0]])
    up = jnp.array([[10.0, 11.0, 12.0, 13.0]])
    stored = epilogue.write_tiles(gate, up, 2)
    assert np.asarray(stored).tolist() == [[0, 1, 10, 11, 2, 3, 12, 13]]
    g, u = epilogue.read_halves(stored, 2)
    assert np.asarray(g).tolist() == [[0, 1, 2, 3]] and np.asarray(u).tolist() == [[10, 11, 12, 13]]
    # one tile spanning F: the contiguous [gate | up]
    assert np.asarray(epilogue.write_tiles(gate, up, None)).tolist() == [[0, 1, 2, 3, 10, 11, 12, 13]]
    g, u = epilogue.read_tile(stored, 1, 2)
    assert np.asarray(g).tolist() == [[2, 3]] and np.asarray(u).tolist() == [[12, 13]]
    assert [(c.start, c.stop, a, b) for c, a, b in epilogue.tile_columns(4, 2)] == [(0, 2, 0, 2), (2, 4, 4, 6)]


def test_float32_swiglu_epilogues_by_hand():
    # gate 0 and 2, up 3, u 2, row scale 0.5: silu(0) = 0, silu'(0) = 1/2; silu(2) = 2 s, silu'(2) = s (1 + 2 (1 - s))
    s2 = 1 / (1 + math.exp(-2.0))
    gate = jnp.array([[0.0, 2.0]])
    up = jnp.array([[3.0, 3.0]])
    h = epilogue.swiglu_fwd(gate, up, jnp.float32, "float32")
    np.testing.assert_allclose(np.asarray(h), [[0.0, 2 * s2 * 3]], rtol=1e-6)
    d_gate, d_up, dot = epilogue.dswiglu(jnp.array([[2.0, 2.0]]), gate, up, jnp.array([[0.5]]), "float32", jnp.float32)
    np.testing.assert_allclose(np.asarray(d_gate), [[2 * 0.5 * 3 * 0.5, 2 * 0.5 * 3 * s2 * (1 + 2 * (1 - s2))]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(d_up), [[0.0, 2 * 0.5 * 2 * s2]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dot), [[2 * 2 * s2 * 3]], rtol=1e-6)  # <u, silu(gate) up>, unscaled
    # no row scale: s = 1
    d_gate, _, _ = epilogue.dswiglu(jnp.array([[2.0, 2.0]]), gate, up, None, "float32", jnp.float32)
    np.testing.assert_allclose(np.asarray(d_gate)[0, 0], 2 * 3 * 0.5, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown epilogue"):
        epilogue.swiglu_fwd(gate, up, jnp.float32, "bf16")
    np.testing.assert_allclose(np.asarray(epilogue.scale_rows(jnp.array([[2.0, 4.0]]), jnp.array([0.25]))), [[0.5, 1.0]])


# ---------------------------------------------------------------------------------------------
# kernels/logprobs.py


def test_chunked_logprobs_and_entropy_by_hand_at_padded_chunks():
    # D 1, V 4, lm_head (0, ln 2, ln 5, ln 3): a hidden of 1 gives probabilities (1, 2, 5, 3) / 11; a
    # hidden of 2 gives (1, 4, 25, 9) / 39. 4 tokens and 4 columns in chunks of 3: both padded by 2.
    head = jnp.array([[0.0, math.log(2.0), math.log(5.0), math.log(3.0)]])
    hidden = jnp.array([[[1.0], [1.0], [2.0], [1.0]]])
    targets = jnp.array([[1, 2, 0, 3]])
    logp, ent = logprobs.chunked_token_logprobs(hidden, head, targets, chunk_tokens=3, chunk_vocab=3)
    p1, p2 = np.array([1, 2, 5, 3]) / 11, np.array([1, 4, 25, 9]) / 39
    np.testing.assert_allclose(np.asarray(logp), [[math.log(2 / 11), math.log(5 / 11), math.log(1 / 39), math.log(3 / 11)]],
                               rtol=1e-5)
    h1, h2 = -(p1 * np.log(p1)).sum(), -(p2 * np.log(p2)).sum()
    np.testing.assert_allclose(np.asarray(ent), [[h1, h1, h2, h1]], rtol=1e-5)
    # temperature 2 on the hidden of 2: the hidden of 1's distribution
    logp, ent = logprobs.chunked_token_logprobs(hidden[:, 2:3], head, jnp.array([[1]]), chunk_tokens=4,
                                                chunk_vocab=4, temperature=2.0)
    np.testing.assert_allclose(np.asarray(logp), [[math.log(2 / 11)]], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), [[h1]], rtol=1e-5)


def test_chunked_logprobs_refuse_bad_sizes():
    with pytest.raises(ValueError, match="chunk sizes must be >= 1, got chunk_tokens=0, chunk_vocab=2"):
        logprobs.chunked_token_logprobs(jnp.zeros((1, 1, 2)), jnp.zeros((2, 3)), jnp.zeros((1, 1), int),
                                        chunk_tokens=0, chunk_vocab=2)
    with pytest.raises(ValueError, match=r"lm_head \(3, 3\) does not match hidden width 2"):
        logprobs.chunked_token_logprobs(jnp.zeros((1, 1, 2)), jnp.zeros((3, 3)), jnp.zeros((1, 1), int),
                                        chunk_tokens=1, chunk_vocab=2)
