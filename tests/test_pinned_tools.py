"""Figures and record fields of the tools and loops, pinned by hand: each test states its
expectation as literals or simple arithmetic on its own small fixture (no model compiles)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import benchmark_script


# ---------------------------------------------------------------------------------------------
# benchmarks/step_estimate.py: every field its record keeps of an estimate


def _estimate(step_s=2.0, overlapped_s=1.0):
    """An estimate whose every field read by the record holds a distinct value."""
    return {"hardware": {"name": "tpu7x", "grid_step_s": 3e-6, "measured": {"chip": "v7x"}},
            "serial": {"step_s": step_s, "tokens_per_s_per_chip": 4096 / step_s, "mfu": 0.21},
            "overlapped": {"step_s": overlapped_s, "tokens_per_s_per_chip": 4096 / overlapped_s, "mfu": 0.42},
            "categories": {"gmm": {"s": 0.25}, "attention": {"s": 0.5}},
            "collectives": {"all-reduce": 7}, "kernels": {"gmm": 2},
            "kernels_without_cost_estimate": ["k1"], "loops_with_unknown_trip_count": ["l1", "l2", "l3"],
            "hlo_flops_per_device": 11.0, "model_flops_per_device": 13.0, "designed_flops_per_device": 17.0,
            "tokens_per_step": 4096, "chips": 4, "devices": 8}


def test_step_estimate_summary_takes_each_field_from_its_own_source():
    """Distinct values per field: a field read from a neighbour's key shows; the unknown loops are
    counted (3), the categories' seconds listed apart."""
    out = benchmark_script("step_estimate")._summary(_estimate())
    assert out["hardware"] == "tpu7x" and out["grid_step_s"] == 3e-6
    assert out["calibration"] == {"chip": "v7x"}
    assert (out["step_s"], out["overlapped_step_s"]) == (2.0, 1.0)
    assert (out["tokens_per_s_per_chip"], out["overlapped_tokens_per_s_per_chip"]) == (2048.0, 4096.0)
    assert (out["mfu"], out["overlapped_mfu"]) == (0.21, 0.42)
    assert out["category_s"] == {"gmm": 0.25, "attention": 0.5}
    assert out["collectives"] == {"all-reduce": 7} and out["kernels"] == {"gmm": 2}
    assert out["kernels_without_cost_estimate"] == ["k1"]
    assert out["loops_with_unknown_trip_count"] == 3
    assert (out["hlo_flops_per_device"], out["model_flops_per_device"], out["designed_flops_per_device"]) == (
        11.0, 13.0, 17.0)
    assert (out["tokens_per_step"], out["chips"], out["devices"]) == (4096, 4, 8)


def test_step_estimate_summary_of_an_estimate_without_design_count_or_calibration():
    """designed_flops_per_device and the calibration are optional: None when absent."""
    est = _estimate()
    del est["designed_flops_per_device"], est["hardware"]["measured"]
    out = benchmark_script("step_estimate")._summary(est)
    assert out["designed_flops_per_device"] is None and out["calibration"] is None


def test_step_estimate_arm_parses_name_and_overrides():
    """NAME=a,b gives (NAME, [a, b]); NAME= the recipe as it is; no '=' is refused."""
    module = benchmark_script("step_estimate")
    assert module._arm("tiles=kernels.gmm.tm=512,gdn.cp_m_scan=false") == (
        "tiles", ["kernels.gmm.tm=512", "gdn.cp_m_scan=false"])
    assert module._arm("cell=") == ("cell", [])
    with pytest.raises(SystemExit, match="NAME="):
        module._arm("cell")


def _inspect_record(with_extrapolated: bool):
    def program(layers, seconds, step_s):
        return {"config": {"model": {"num_layers": layers}}, "recipe": "small", "compile_s": seconds,
                "overrides": [f"model.num_layers={layers}"], "step_estimate": _estimate(step_s, step_s / 2)}

    # The deeper program first: the base is the one with the fewest layers, not the first listed.
    rec = {"programs": {"deep": program(12, 5.0, 6.0), "base": program(8, 3.25, 4.0)}, "target": "tpu7x:2x2x1"}
    if with_extrapolated:
        rec["step_estimate"] = _estimate(10.0, 8.0)
    return rec


def _run_from_inspect(module, tmp_path, monkeypatch, rec, previous=None):
    from hybridmoe.analysis import step_estimate as se

    monkeypatch.setattr(se, "format_estimate", lambda *a, **k: "")
    written = []
    monkeypatch.setattr(module.harness, "write", lambda out, name, **fields: written.append(fields))
    path = tmp_path / "inspect.json"
    path.write_text(json.dumps(rec))
    assert module._from_inspect(path, {"cell": []}, tmp_path / "out.json", previous or {}) == 0
    return written[0]["arms"]


def test_from_inspect_without_layers_takes_the_base_programs_estimate(tmp_path, monkeypatch):
    """No extrapolated estimate: the arm's figures are the fewest-layer program's (4 s, overlapped
    2 s), compile_s the sum 3.25 + 5 = 8.2 (rounded to 0.1), no extrapolated_from; earlier arms kept."""
    module = benchmark_script("step_estimate")
    arms = _run_from_inspect(module, tmp_path, monkeypatch, _inspect_record(False), previous={"old": {"step_s": 1}})
    assert arms["old"] == {"step_s": 1}
    arm = arms["cell"]
    assert (arm["step_s"], arm["overlapped_step_s"]) == (4.0, 2.0)
    assert arm["compile_s"] == 8.2
    assert arm["overrides"] == [] and arm["commit"] == ""
    assert "extrapolated_from" not in arm


def test_from_inspect_with_layers_records_each_depths_own_figures(tmp_path, monkeypatch):
    """The extrapolated estimate (10 s) is the arm's; each depth's own step_s under its layer count."""
    module = benchmark_script("step_estimate")
    arm = _run_from_inspect(module, tmp_path, monkeypatch, _inspect_record(True))["cell"]
    assert arm["step_s"] == 10.0
    assert {k: v["step_s"] for k, v in arm["extrapolated_from"].items()} == {"8": 4.0, "12": 6.0}


def test_from_inspect_refuses_overrides_more_arms_and_a_foreign_record(tmp_path):
    module = benchmark_script("step_estimate")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"programs": {}}))
    with pytest.raises(SystemExit, match="one arm"):
        module._from_inspect(path, {"cell": ["a=1"]}, tmp_path / "o.json", {})
    with pytest.raises(SystemExit, match="one arm"):
        module._from_inspect(path, {"a": [], "b": []}, tmp_path / "o.json", {})
    path.write_text(json.dumps({"arms": {}}))
    with pytest.raises(SystemExit, match="not a `hybridmoe inspect --out` record"):
        module._from_inspect(path, {"cell": []}, tmp_path / "o.json", {})


# ---------------------------------------------------------------------------------------------
# tools/score.py: the token checks at their bounds


def test_score_token_checks_at_their_bounds():
    """Length 2 accepted, 1 refused; ids vocab-1 and 0 accepted, vocab and -1 refused; floats refused."""
    from hybridmoe.tools.score import check_tokens

    assert check_tokens(np.array([[0, 7]]), 8, "t").shape == (1, 2)
    with pytest.raises(ValueError, match="length >= 2"):
        check_tokens(np.array([[3]]), 8, "t")
    with pytest.raises(ValueError, match="length >= 2"):
        check_tokens(np.array([3, 4]), 8, "t")
    with pytest.raises(ValueError, match="integers"):
        check_tokens(np.array([[0.0, 1.0]]), 8, "t")
    with pytest.raises(ValueError, match=r"\[0, 8\); found 0\.\.8"):
        check_tokens(np.array([[0, 8]]), 8, "t")


def test_score_token_file_refusals(tmp_path):
    from hybridmoe.tools.score import load_token_file

    with pytest.raises(ValueError, match="no such file"):
        load_token_file(tmp_path / "missing.npy")
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="the file is empty"):
        load_token_file(empty)
    text = tmp_path / "t.npy"
    text.write_text("1 2 3")
    with pytest.raises(ValueError, match="NumPy header"):
        load_token_file(text)
    good = tmp_path / "g.npy"
    np.save(good, np.array([[1, 2]], np.int32))
    assert load_token_file(good).tolist() == [[1, 2]]


# ---------------------------------------------------------------------------------------------
# run/step.py: the per-micro-batch counts folded


def test_fold_counts_sums_and_reduces_in_micro_batch_order():
    """Counts [3, 1, 4] sum to 8; a max reducer from 0 gives 4; an int count stays int."""
    from hybridmoe.run.step import _fold_counts

    counts = {"tokens": jnp.array([3, 1, 4], jnp.int32), "gap_max": jnp.array([0.5, 2.5, 1.5], jnp.float32)}
    out = _fold_counts(counts, {"gap_max": (jnp.maximum, 0.0)})
    assert int(out["tokens"]) == 8 and out["tokens"].dtype == jnp.int32
    assert float(out["gap_max"]) == 2.5
    assert int(_fold_counts(jnp.array([2, 5], jnp.int32), {})) == 7


def test_skip_if_nonfinite_keeps_the_old_state_on_a_nan_loss_or_inf_norm():
    from hybridmoe.run.step import skip_if_nonfinite

    new, old = jnp.float32(1.0), jnp.float32(0.0)
    kept, skipped = skip_if_nonfinite(jnp.float32(2.0), jnp.float32(3.0), new, old)
    assert (float(kept), int(skipped)) == (1.0, 0)
    kept, skipped = skip_if_nonfinite(jnp.float32(jnp.nan), jnp.float32(3.0), new, old)
    assert (float(kept), int(skipped)) == (0.0, 1)
    kept, skipped = skip_if_nonfinite(jnp.float32(2.0), jnp.float32(jnp.inf), new, old)
    assert (float(kept), int(skipped)) == (0.0, 1)


# ---------------------------------------------------------------------------------------------
# tools/train_program.py: what inspect prints and records


def _tp():
    from hybridmoe.tools import train_program as tp
    return tp


def test_collective_rows_group_by_place_kind_and_dtype():
    """Two bf16 all-gathers outside loops (1 + 2 MiB) make one row of 2 ops, 3 MiB; one in a loop of
    unknown trip count reads '?' iterations; one at depth 2 of 6 iterations its own row."""
    from hybridmoe.analysis.program import Collective

    M = 2**20

    def coll(kind, dtype, nbytes, depth=0, trips=None):
        return Collective(kind, dtype, (1,), nbytes, depth, "w" if depth else None, trips, "main", "")

    rows = _tp().collective_rows([coll("all-gather", "bf16", M), coll("all-gather", "bf16", 2 * M),
                                  coll("all-reduce", "f32", 5, depth=1), coll("all-reduce", "f32", 7, depth=2, trips=6)])
    assert rows == [
        {"where": "loop depth 1, ? iterations", "kind": "all-reduce", "dtype": "f32", "ops": 1, "bytes": 5},
        {"where": "loop depth 2, 6 iterations", "kind": "all-reduce", "dtype": "f32", "ops": 1, "bytes": 7},
        {"where": "outside loops", "kind": "all-gather", "dtype": "bf16", "ops": 2, "bytes": 3 * M}]


def test_residual_rows_count_named_residuals_and_residual_bytes_all():
    """wi_out twice as bf16 [4, 8] (64 B each: 128 B), gdn f32 [2, 3] (24 B); the unnamed f32 [10]
    (40 B) has no row but counts in the block's bytes: 128 + 24 + 40 = 192."""
    from hybridmoe.analysis.program import Residual

    res = [Residual((4, 8), "bfloat16", "", "wi_out"), Residual((2, 3), "float32", "", "gdn"),
           Residual((4, 8), "bfloat16", "", "wi_out"), Residual((10,), "float32", "", None)]
    tp = _tp()
    assert tp.residual_rows(res) == [
        {"name": "gdn", "count": 1, "shape": [2, 3], "dtype": "float32", "bytes": 24},
        {"name": "wi_out", "count": 2, "shape": [4, 8], "dtype": "bfloat16", "bytes": 128}]
    assert tp.residual_bytes(res) == 192


def test_memory_facts_fit_at_the_exact_budget_and_the_memory_only_branch():
    """A step needing exactly the HBM fits, one byte more does not; a memory-only read fits by its
    default space alone and leaves the analysis figures None."""
    from types import SimpleNamespace

    tp = _tp()
    mem = {"argument": 40, "output": 30, "alias": 20, "temp": 50, "generated_code": 1}  # total 40+30-20+50 = 100
    facts = tp.memory_facts(SimpleNamespace(memory=mem), 100)
    assert facts["total"] == 100 and facts["fits"] is True and facts["generated_code"] == 1
    assert tp.memory_facts(SimpleNamespace(memory=mem), 99)["fits"] is False
    assert tp.memory_facts(SimpleNamespace(memory=mem), None)["fits"] is None
    only = {"memory_only": True, "argument": 7, "default_space": 64}
    facts = tp.memory_facts(SimpleNamespace(memory=only), 64)
    assert facts["fits"] is True and facts["argument"] == 7 and facts["total"] is None and facts["memory_only"]
    assert tp.memory_facts(SimpleNamespace(memory=only), 63)["fits"] is False
    assert tp.memory_facts(SimpleNamespace(memory={**only, "default_space": None}), 63)["fits"] is None


def test_count_search_line_of_a_refused_count_and_of_none_fitting():
    """Count 1 refused with 3 GiB of temporaries, count 2 needing 9 GiB over a 4 GiB budget."""
    G = 2**30
    line = _tp().format_count_search({
        "key": "rl.micro_batches", "chosen": None, "budget": 4 * G, "held": G // 2, "tried": [
            {"count": 1, "compiled": True, "need": None, "refused_temp": 3 * G, "fits": False},
            {"count": 2, "compiled": True, "need": 9 * G, "refused_temp": None, "fits": False}]})
    assert line == ("rl.micro_batches=auto: none fits against 4.00 GiB per device (held state 0.50 GiB): "
                    "1 refused by the compiler (3.00 GiB of temporaries); 2 needs 9.00 GiB (over)")


def test_printed_table_rows_for_outputs_aliases_hbm_fit_compile_and_refusal():
    """Figures in MiB (the need stays under a GiB): outputs 2, aliased 1, HBM 8; fits yes / NO / -;
    compile seconds to one decimal; the cache column; a refused column's message."""
    M = 2**20

    def column(fits, cached, refused=None):
        memory = {"argument": 3 * M, "output": 2 * M, "alias": M, "temp": 4 * M, "generated_code": 0,
                  "total": 8 * M, "default_space": None, "hbm": 8 * M, "fits": fits}
        if refused:
            memory["refused"] = refused
        return {"memory": memory, "flops": None, "model_flops": None, "compile_s": 2.34, "compile_cached": cached,
                "collectives": [], "saved_residuals": [], "saved_residual_bytes_per_block": None,
                "peak_buffers": [], "peak_by_category": None}

    text = _tp().format_facts({"a": column(True, True), "b": column(False, False, "too big"), "c": column(None, False)})
    cells = lambda label: [x for x in text.splitlines() if x.startswith(label)][0][len(label):].split()  # noqa: E731
    assert cells("outputs MiB") == ["2.00"] * 3
    assert cells("aliased (donated) MiB") == ["1.00"] * 3
    assert cells("HBM MiB") == ["8.00"] * 3
    assert cells("fits HBM (default space)") == ["yes", "NO", "-"]
    assert cells("TFLOPs per device (XLA)") == ["-"] * 3
    assert cells("compile s") == ["2.3"] * 3
    assert cells("  read from the compile cache") == ["yes", "no", "no"]
    assert "b: the compiler refused the step for memory" in text and text.rstrip().endswith("too big")
    assert "a: the compiler refused" not in text


def test_buffer_rows_keep_the_top_rows_and_say_where():
    from hybridmoe.analysis.program import LiveBuffer

    bufs = [LiveBuffer(f"v{i}", 100 - i, "f32[4]", "op", "main", "while.1" if i == 0 else None, "argument")
            for i in range(3)]
    rows = _tp().buffer_rows(bufs, top=2)
    assert [(r["value"], r["bytes"], r["where"], r["category"]) for r in rows] == [
        ("v0", 100, "in loop while.1", "argument"), ("v1", 99, "outside loops", "argument")]


# ---------------------------------------------------------------------------------------------
# data/tokenizer.py: ids, stop tokens and special tokens


class _FakeHF:
    """A tokenizers.Tokenizer stand-in: a fixed vocabulary; decode joins the kept ids' texts."""
    vocab = {"<pad>": 1, "<bos>": 2, "<|im_end|>": 3, "a": 4, "b": 5, "<eos>": 6}

    def get_vocab_size(self, with_added_tokens):
        return 7 if with_added_tokens else 4

    def token_to_id(self, t):
        return self.vocab.get(t)

    def decode(self, ids, skip_special_tokens):
        return ",".join(str(i) for i in ids)


def test_hf_tokenizer_ids_stop_tokens_and_pad_fallback():
    """Vocabulary with added tokens (7); no pad token: pad = eos; stop ids eos then the generation
    config's (duplicates dropped); decode stops before the first stop id."""
    from hybridmoe.data.tokenizer import HFTokenizer

    tok = HFTokenizer(_FakeHF(), eos_token="<eos>", pad_token=None, bos_token="<bos>", stop_ids=[3, 6, 3])
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (7, 6, 6, 2)
    assert tok.stop_ids == (6, 3)
    assert tok.decode([4, 5, 3, 4]) == "4,5" and tok.decode([5, 6, 4]) == "5"
    tok = HFTokenizer(_FakeHF(), eos_token="<|im_end|>", pad_token="<pad>", bos_token=None)
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.stop_ids) == (3, 1, None, (3,))
    with pytest.raises(ValueError, match="pad_token '<nope>' is not in the tokenizer's vocabulary"):
        HFTokenizer(_FakeHF(), eos_token="<eos>", pad_token="<nope>", bos_token=None)


def test_char_tokenizer_decode_stops_at_eos_and_drops_specials():
    from hybridmoe.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer

    tok = CharTokenizer()
    ids = tok.encode("12+3")
    # ids 0, 1, 2 are PAD, BOS, EOS; then digits 0-9 (3..12), then "+-*=" (13..16)
    assert ids == [4, 5, 13, 6] and tok.encode("0=") == [3, 16]
    assert tok.decode([PAD_ID, BOS_ID, *ids, EOS_ID, *ids]) == "12+3"
    assert tok.decode([*ids[:2], 10_000]) == "12"
    assert tok.vocab_size == 3 + 10 + 4 + 1 + 26 + 26 + 17  # specials, digits, +-*=, space, letters, punctuation


def test_special_tokens_and_generation_stop_ids_from_their_files(tmp_path):
    from hybridmoe.data.tokenizer import _generation_stop_ids, _special_token

    assert _special_token({"eos_token": {"content": "<e>"}}, "eos_token") == "<e>"
    assert _special_token({"eos_token": ""}, "eos_token") is None
    path = tmp_path / "generation_config.json"
    assert _generation_stop_ids(path) == []
    path.write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert _generation_stop_ids(path) == [7, 9]
    path.write_text(json.dumps({"eos_token_id": 7}))
    assert _generation_stop_ids(path) == [7]


# ---------------------------------------------------------------------------------------------
# parallel/host.py: a host's rows make a global array the hosts' count times taller


def test_process_local_rows_make_the_global_shape_over_the_hosts(monkeypatch):
    """[2 micro-batches, 3 rows, 5] on each of 4 hosts: global [2, 12, 5]."""
    import jax

    from hybridmoe.parallel import host

    seen = []
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(jax, "make_array_from_process_local_data",
                        lambda sharding, a, shape: seen.append((a.shape, shape)) or shape)
    out = host.put_process_local({"tokens": np.zeros((2, 3, 5), np.int32)}, None)
    assert out == {"tokens": (2, 12, 5)} and seen == [((2, 3, 5), (2, 12, 5))]
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert host.is_lead_host()
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert not host.is_lead_host()


# ---------------------------------------------------------------------------------------------
# model/decode.py: a prompt prefilled in chunks (the chunk and slot arithmetic)


def _fake_cached_hidden(params, cfg, cache, tokens, seg, pos, with_routing=False):
    """A decoder whose hidden state of a token is its id (D = 1), whose routing is the position
    (one layer, k = 1), and whose cache counts the slots and sums the positions it was given."""
    T = tokens.shape[1]
    hidden = tokens[..., None].astype(jnp.float32)
    new = {"slot": cache["slot"] + T, "pos_sum": cache["pos_sum"] + pos.sum()}
    return (hidden, new, pos[..., None, None]) if with_routing else (hidden, new)


@pytest.mark.parametrize("P,C", [(7, 3), (6, 3), (3, 3), (2, 3)])
def test_prefill_in_chunks_writes_every_token_once_and_returns_the_last(monkeypatch, P, C):
    """P prompt tokens in chunks of C: the cache's slot ends at P, every position is run once
    (their sum 0 + 1 + ... + P-1 per row), the hidden state is the last token's and the routing
    lists the P positions in order."""
    from hybridmoe.model import decode

    monkeypatch.setattr(decode, "cached_hidden", _fake_cached_hidden)
    B = 2
    pos = jnp.tile(jnp.arange(P, dtype=jnp.int32), (B, 1))
    tokens = pos + 100 * jnp.arange(1, B + 1, dtype=jnp.int32)[:, None]  # row b: 100 b + position
    cache = {"slot": jnp.int32(0), "pos_sum": jnp.int32(0)}
    hidden, cache, routing = decode.prefill(None, None, cache, tokens, jnp.ones_like(tokens), pos,
                                            chunk_tokens=C, with_routing=True)
    assert int(cache["slot"]) == P
    assert int(cache["pos_sum"]) == B * P * (P - 1) // 2
    assert np.asarray(hidden).tolist() == [[100.0 + P - 1], [200.0 + P - 1]]
    assert routing.shape == (B, P, 1, 1)
    assert np.asarray(routing)[:, :, 0, 0].tolist() == [list(range(P))] * B
    hidden, _, none = decode.prefill(None, None, {"slot": jnp.int32(0), "pos_sum": jnp.int32(0)}, tokens,
                                     jnp.ones_like(tokens), pos, chunk_tokens=C)
    assert none is None and np.asarray(hidden)[:, 0].tolist() == [100.0 + P - 1, 200.0 + P - 1]


@pytest.mark.parametrize("P,C,calls", [(3, 3, [("one", 3)]), (2, 3, [("one", 2)]), (6, 3, [("scan", 3)]),
                                       (7, 3, [("scan", 3), ("one", 1)])])
def test_prefill_runs_a_prompt_within_a_chunk_in_one_call_and_whole_chunks_in_a_scan(monkeypatch, P, C, calls):
    """A prompt of at most C tokens: one call over all of it; longer: the whole chunks in one scan
    (traced once, C tokens) and the remainder, if any, in one call after it."""
    import jax

    from hybridmoe.model import decode

    seen = []

    def recording(params, cfg, cache, tokens, *rest, **kw):
        seen.append(("scan" if isinstance(tokens, jax.core.Tracer) else "one", tokens.shape[1]))
        return _fake_cached_hidden(params, cfg, cache, tokens, *rest, **kw)

    monkeypatch.setattr(decode, "cached_hidden", recording)
    pos = jnp.tile(jnp.arange(P, dtype=jnp.int32), (1, 1))
    decode.prefill(None, None, {"slot": jnp.int32(0), "pos_sum": jnp.int32(0)}, pos, jnp.ones_like(pos), pos,
                   chunk_tokens=C)
    assert seen == calls


# ---------------------------------------------------------------------------------------------
# hf/weights.py: the source of a checkpoint's tensors


def test_hf_source_names_the_file_of_a_wrong_shape_and_lists_unused_tensors():
    """A multimodal name maps to model.*, its file too; the vision tower and MTP layers are not
    read; 8 unused tensors are all listed, 9 list 8 and say 9 in all."""
    from hybridmoe.hf.weights import _Source, is_text_tensor, text_prefix

    state = {"model.language_model.norm.weight": np.zeros(4), "model.visual.x": np.zeros(1),
             "mtp.fc.weight": np.zeros(1), "lm_head.weight": np.zeros((2, 4))}
    assert text_prefix(state) == "model.language_model."
    assert text_prefix({"model.norm.weight": 0}) == "model."
    assert not is_text_tensor("model.mtp.x", "model.") and is_text_tensor("lm_head.weight", "model.language_model.")
    src = _Source(state, {"model.language_model.norm.weight": "shard-2.safetensors"}, "ckpt")
    assert sorted(src.state) == ["lm_head.weight", "model.norm.weight"]
    with pytest.raises(ValueError, match=r"^shard-2.safetensors: model.norm.weight: expected \(5,\), got \(4,\)$"):
        src.take("model.norm.weight", (5,))
    with pytest.raises(ValueError, match=r"ckpt: missing tensor model.x \(expected shape \(3,\)\)"):
        src.take("model.x", (3,))
    assert src.take("model.norm.weight", (4,)).shape == (4,)
    with pytest.raises(ValueError, match=r"does not use \(wrong config or layout\?\): lm_head.weight$"):
        src.check_all_used()
    src.take("lm_head.weight", (2, 4))
    src.check_all_used()

    eight = _Source({f"model.t{i}": np.zeros(1) for i in range(8)}, None, "c")
    with pytest.raises(ValueError) as refused:
        eight.check_all_used()
    assert "in all" not in str(refused.value) and "model.t7" in str(refused.value)
    nine = _Source({f"model.t{i}": np.zeros(1) for i in range(9)}, None, "c")
    with pytest.raises(ValueError, match=r"model.t7, \.\.\. \(9 in all\)$"):
        nine.check_all_used()


# ---------------------------------------------------------------------------------------------
# rl/loop.py: the warm-up step's record, which groups teach, and a round's groups picked


def test_rl_warmup_step_record_from_a_stubbed_step_and_clock(monkeypatch):
    """A warm-up step of 120 tokens in 0.5 s (clock 10.0 -> 10.5): tokens_per_s 240; its loss,
    norm and skip from the step's metrics; the micro-batches the fewest count of train.micro_batches."""
    from types import SimpleNamespace

    from hybridmoe.config.schema import Config, TrainConfig
    from hybridmoe.rl import loop as rl_loop

    clock = iter([10.0, 10.5])
    monkeypatch.setattr(rl_loop, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(rl_loop, "solved_batch", lambda cfg, step, task, tok: {"step": step})
    monkeypatch.setattr(rl_loop, "put_global", lambda batch, sharding: batch)
    monkeypatch.setattr(rl_loop, "fetch_global", lambda m: m)
    metrics = {"loss": 2.5, "grad_norm": 0.75, "tokens": 120.0, "update_skipped": 1.0}
    run = SimpleNamespace(cfg=Config(train=TrainConfig(batch_size=8, micro_batches=4)), task=None, tokenizer=None,
                          setup=SimpleNamespace(batch_sharding=lambda n: None),
                          warmup_step=lambda state, batch: ({**state, "seen": batch["step"]}, metrics))
    state, rec = rl_loop._warmup_step(run, {"w": 1}, 3)
    assert state == {"w": 1, "seen": 3}
    assert rec == {"phase": rl_loop.WARMUP, "warmup_loss": 2.5, "grad_norm": 0.75, "tokens": 120.0,
                   "tokens_per_s": 240.0, "step_time_s": 0.5, "update_skipped": 1.0, "warmup_micro_batches": 4.0}


def test_informative_groups_need_two_valid_samples_whose_rewards_differ():
    """G = 3. Group 0 rewards 1, 0, 1: informative. Group 1 all 1: not. Group 2: only one valid
    sample (the 0 is skipped): not. Group 3: 5, 5 valid and a skipped 9: not (the skipped one's
    reward does not count)."""
    from hybridmoe.rl.loop import _informative_groups

    sample = {"rewards": np.array([1, 0, 1, 1, 1, 1, 1, 0, 0, 5, 5, 9], np.float32),
              "skipped": np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1], bool)}
    assert _informative_groups(sample, 3).tolist() == [True, False, False, False]
    sample["skipped"] = np.zeros(12, bool)
    assert _informative_groups(sample, 3).tolist() == [True, False, True, True]


def test_pick_groups_takes_each_groups_rows_and_its_per_prompt_fields():
    """Groups 2 and 0 of G = 2: rows 4, 5, 0, 1; a per-prompt array [P] its entries 2, 0; a scalar kept."""
    from hybridmoe.rl.loop import _pick_groups

    sample = {"rewards": np.arange(6.0), "lengths": np.arange(6) * 10, "prompt_skipped": np.array([7, 8, 9]),
              "new_tokens": 5.0}
    out = _pick_groups(sample, np.array([2, 0]), 2)
    assert out["rewards"].tolist() == [4.0, 5.0, 0.0, 1.0] and out["lengths"].tolist() == [40, 50, 0, 10]
    assert out["prompt_skipped"].tolist() == [9, 7] and out["new_tokens"] == 5.0


# ---------------------------------------------------------------------------------------------
# tools/score.py: the config a checkpoint is scored under


@pytest.mark.parametrize("length,want_max", [(5, 64), (200, 200)])
def test_score_runs_in_float32_at_the_longest_of_the_file_and_the_defaults(monkeypatch, length, want_max):
    """Sequences of 5 tokens: max_seq_len the defaults' longest, train.seq_len 64 (rl 16 + 8 = 24 is
    shorter); of 200: 200. Both dtypes float32, the weights cast to float32, train.seq_len the file's."""
    from hybridmoe.tools import score

    seen = {}
    monkeypatch.setattr(score, "hf_model_section", lambda d: {"vocab_size": 50, "param_dtype": "bfloat16",
                                                              "compute_dtype": "bfloat16"})
    monkeypatch.setattr(score, "load_hf_checkpoint", lambda d: (None, {"w": np.ones(2, np.float16)}))
    monkeypatch.setattr(score, "check_requirements", lambda cfg: seen.setdefault("cfg", cfg))

    def logprobs(params, cfg, tokens):
        seen["dtype"] = params["w"].dtype
        return jnp.zeros((tokens.shape[0], tokens.shape[1] - 1), jnp.float32) + tokens[:, 1:]

    monkeypatch.setattr(score, "token_logprobs", logprobs)
    tokens = np.arange(2 * length).reshape(2, length) % 50
    out = score.score_tokens("dir", tokens)
    cfg = seen["cfg"]
    assert cfg.model.max_seq_len == want_max and cfg.train.seq_len == length
    assert (cfg.model.param_dtype, cfg.model.compute_dtype, seen["dtype"]) == ("float32", "float32", jnp.float32)
    assert out.dtype == np.float32 and out.shape == (2, length - 1) and out[0, 0] == 1.0
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        score.score_tokens("dir", np.array([[0, 50]]))


# ---------------------------------------------------------------------------------------------
# tools/train_program.py: a TPU target's HBM per device


@pytest.mark.parametrize("name,devices,want_gib", [("tpu7x:2x2x1", 8, 96), ("v5e:2x2", 4, 16), ("v5p:2x2x2", 8, 95),
                                                   ("v6e:4x4", 16, 32)])
def test_tpu_target_hbm_per_device_is_the_chips_over_its_devices(monkeypatch, name, devices, want_gib):
    """tpu7x: 192 GiB a chip shared by its 2 devices (8 devices on 4 chips) = 96 GiB each; one device
    a chip: the chip's whole HBM (v5e 16, v5p 95, v6e 32)."""
    import importlib.util
    from types import SimpleNamespace

    from jax.experimental import topologies

    tp = _tp()
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: object())
    monkeypatch.setattr(topologies, "get_topology_desc",
                        lambda n, platform: SimpleNamespace(devices=[object()] * devices))
    target = tp.tpu_target(name)
    assert target.hbm_bytes_per_device == want_gib * 2**30
    assert (target.name, target.platform, target.num_devices) == (name, "tpu", devices)


def test_grpo_count_search_where_none_fits_returns_the_last_compiled(monkeypatch):
    """rl.micro_batches=auto over [1, 2, 4] against 8 GiB with 2 GiB held (the reference counted,
    rl.beta > 0): 1 needs 20 GiB; 2 (2 + 18 / 2 = 11 GiB at the least) is passed over; 4 (6.5 at the
    least) compiles and needs 9 GiB: none fits, the step is count 4's, every count is listed."""
    from types import SimpleNamespace

    import hybridmoe.rl.memory_plan as memory_plan
    import hybridmoe.run.setup as run_setup
    from hybridmoe.recipe import load_config

    tp = _tp()
    G = 2**30
    needs, compiled, held_with = {1: 20 * G, 4: 9 * G}, [], []

    def compile_one(cfg, target, **kw):
        compiled.append((cfg.rl.micro_batches, kw["program_name"]))
        return SimpleNamespace(program=SimpleNamespace(need=needs[cfg.rl.micro_batches]), out_of_memory=None,
                               count_search=None)

    monkeypatch.setattr(run_setup, "build", lambda cfg, devices: SimpleNamespace())
    monkeypatch.setattr(memory_plan, "update_counts", lambda setup: [1, 2, 4])
    monkeypatch.setattr(memory_plan, "update_held_bytes", lambda setup, ref: held_with.append(ref) or 2 * G)
    monkeypatch.setattr(tp, "compile_one", compile_one)
    monkeypatch.setattr(tp, "memory_facts", lambda prog, budget: {"total": prog.need})
    cfg = load_config("tiny", ["rl.micro_batches=auto", "rl.beta=0.1"])
    step = tp.compile_step(cfg, tp.Target("tpu7x:2x2x1", "tpu", (), 8 * G), program_name="grpo")
    assert compiled == [(1, "grpo"), (4, "grpo")] and held_with == [True]
    assert step.program.need == 9 * G
    search = step.count_search
    assert (search["key"], search["chosen"], search["held"], search["budget"]) == ("rl.micro_batches", None, 2 * G, 8 * G)
    assert [(t["count"], t["compiled"], t["need"], t["fits"]) for t in search["tried"]] == [
        (1, True, 20 * G, False), (2, False, None, False), (4, True, 9 * G, False)]


def test_count_search_is_skipped_for_a_set_count_or_a_target_without_hbm(monkeypatch):
    """train.micro_batches=2, or a CPU target (no HBM figure): one compile, no count search."""
    from types import SimpleNamespace

    from hybridmoe.recipe import load_config

    tp = _tp()
    calls = []
    monkeypatch.setattr(tp, "compile_one", lambda cfg, target, **kw: calls.append(cfg.train.micro_batches)
                        or SimpleNamespace(count_search=None))
    assert tp.compile_step(load_config("tiny", ["train.micro_batches=2"]),
                           tp.Target("tpu7x:2x2x1", "tpu", (), 2**30)).count_search is None
    assert tp.compile_step(load_config("tiny", ["train.micro_batches=auto"]),
                           tp.Target("cpu:1", "cpu", (), None)).count_search is None
    assert calls == [2, "auto"]
