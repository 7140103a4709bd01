"""Documents longer than train.seq_len (data.long_documents): split keeps every trained token,
truncate counts what it cuts, and a file with nothing trainable left names train.seq_len.

The fixture is the case a new user meets: chat rows of ~110 tokens whose assistant turn lies past
token 64, the `tiny` base's train.seq_len. The trained tokens are counted here from the rendered
chat (each assistant reply and its end-of-turn token), not from the source's own masks.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.data import text as text_mod
from hybridmoe.data.records import DataError
from hybridmoe.data.text import TextSource, tokenize_document
from hybridmoe.data.tokenizer import load_tokenizer
from hybridmoe.recipe import load_config
from broken_variants import mutated

HF_TINY = Path(__file__).parent / "fixtures" / "hf_tiny"
ROWS = 64


def _chat_file(path: Path) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(ROWS):
        a, b = (int(x) for x in rng.integers(10, 99, 2))
        lines.append({"messages": [
            {"role": "system", "content": "Be careful."},
            {"role": "user", "content": f"Please compute the sum of {a} and {b} and explain."},
            {"role": "assistant", "content": f"Adding {a} and {b} gives {a + b}. The answer is \\boxed{{{a + b}}}."}]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return _chat_file(tmp_path_factory.mktemp("long") / "chat.jsonl")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(HF_TINY)


def _cfg(path, *extra):
    return load_config(f"hf:{HF_TINY}", ["train.data=files", f"data.path={path}", "data.shuffle=false", *extra])


def _assistant_tokens(tok, path) -> Counter:
    """Every token the assistant turns train, from the rendered chat: each reply's text through the
    template's end-of-turn token (independent of the source's masks and of any cutting)."""
    out = Counter()
    for line in path.read_text().splitlines():
        for m in json.loads(line)["messages"]:
            if m["role"] == "assistant":
                out.update(tok.encode(m["content"] + "<|im_end|>"))
    return out


def _trained_targets(src) -> Counter:
    """The tokens the source's rows train: targets (not a row's first token) with the mask on."""
    out = Counter()
    for ids, mask in zip(src.docs, src.masks):
        assert len(ids) <= src.seq_len
        out.update(ids[1:][mask[1:] > 0].tolist())
    return out


# Sabotages of the split: its last piece dropped; pieces that do not overlap (the first target of
# each continuation lost); a continuation's mask reset to all-trained (its prompt tokens trained).
BROKEN_SPLIT = {
    "last_piece_dropped": ("for s in range(0, len(ids) - 1, step)]", "for s in range(0, len(ids) - 1, step)][:-1]"),
    "pieces_without_overlap": ("step = seq_len - 1", "step = seq_len"),
    "continuation_mask_all_trained": ("(ids[s:s + seq_len], mask[s:s + seq_len])",
                                      "(ids[s:s + seq_len], mask[s:s + seq_len] if s == 0 else np.ones_like(mask[s:s + seq_len]))"),
}


def _split_at(seq_len, chat_file, tok):
    """(trained targets, counts) of data.long_documents=split (the default) at train.seq_len; None
    when nothing trainable is left (a DataError)."""
    try:
        src = TextSource(_cfg(chat_file, f"train.seq_len={seq_len}"), tok)
    except DataError as e:
        print(f"seq_len={seq_len}: {e}")
        return None
    return _trained_targets(src), src.long_documents, len(src.docs)


@pytest.mark.parametrize("variant", [None, *BROKEN_SPLIT])
def test_split_trains_every_assistant_token_exactly_once(variant, chat_file, tok, monkeypatch):
    # seq_len 64 cuts each chat once, inside its prompt (the case); 24 cuts inside the replies too.
    if variant is not None:
        monkeypatch.setattr(text_mod, "fit_document", mutated(text_mod, "fit_document", *BROKEN_SPLIT[variant]))
    want = _assistant_tokens(tok, chat_file)
    results = {seq_len: _split_at(seq_len, chat_file, tok) for seq_len in (24, 64)}
    for seq_len, r in results.items():
        if r is not None:
            print(f"{variant or 'clean'} seq_len={seq_len}: {sum(r[0].values())} trained targets, "
                  f"{sum(want.values())} assistant tokens; {r[1]}")
    if variant is None:
        for seq_len, (got, n, rows) in results.items():
            assert got == want
            assert n.split == n.documents == ROWS and n.truncated == n.targets_cut == 0 and n.longest > seq_len
            assert n.pieces == rows  # pieces without a trained token (a prompt's head) are not rows
    else:
        assert any(r is None or r[0] != want for r in results.values())


def test_truncate_counts_what_it_cut(chat_file, tok, caplog):
    seq_len = 96  # inside the assistant turns: some trained tokens kept, the rest cut
    src = TextSource(_cfg(chat_file, f"train.seq_len={seq_len}", "data.long_documents=truncate"), tok)
    full = [tokenize_document(json.loads(x), tok, "text") for x in chat_file.read_text().splitlines()]
    n = src.long_documents
    want_cut = sum(max(0, len(ids) - seq_len) for ids, _ in full)
    want_trained_cut = sum(int(np.sum(m[seq_len:])) for _, m in full)
    long_docs = sum(len(ids) > seq_len for ids, _ in full)
    assert (n.truncated, n.targets_cut, n.trained_targets_cut) == (long_docs, want_cut, want_trained_cut)
    assert long_docs > 0 and want_trained_cut > 0
    # What is kept plus what was cut is every assistant token.
    assert sum(_trained_targets(src).values()) + n.trained_targets_cut == sum(_assistant_tokens(tok, chat_file).values())
    assert n.metrics()["data_trained_targets_cut"] == want_trained_cut
    # ... and says so at start.
    assert (f"{long_docs} of {ROWS} documents are longer than train.seq_len={seq_len}" in caplog.text
            and f"truncate cut {want_cut} targets past the limit, {want_trained_cut} of them trained" in caplog.text)


def test_nothing_trainable_left_names_train_seq_len_and_the_longest_document(chat_file, tok):
    longest = max(len(tokenize_document(json.loads(x), tok, "text")[0]) for x in chat_file.read_text().splitlines())
    with pytest.raises(DataError) as e:
        TextSource(_cfg(chat_file, "train.seq_len=64", "data.long_documents=truncate"), tok)
    msg = str(e.value)
    print(msg)
    assert "train.seq_len=64" in msg and f"the longest document has {longest} tokens" in msg
    assert "data.long_documents=split" in msg and f"at least {longest}" in msg


def test_long_chat_rows_train_by_default_and_the_counts_reach_the_metrics(chat_file, tmp_path):
    """The issue's run: chat rows longer than the tiny base's train.seq_len=64 train their assistant
    turns with the defaults, and the first metrics record says what the split did."""
    from hybridmoe.cli import main
    from helpers import ATTENTION_LAYERS

    out = tmp_path / "run"
    # The tiny checkpoint's recipe and tokenizer on attention layers only (helpers.ATTENTION_LAYERS):
    # what the split does and counts is the data's, whatever the mixers; its four layers only added
    # to the compile.
    assert main(["train", f"recipe=hf:{HF_TINY}", *ATTENTION_LAYERS, "train.data=files", f"data.path={chat_file}",
                 "train.steps=2", "train.warmup_steps=0", "--out", str(out)]) == 0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss_tokens"] > 0
    assert first["data_docs_split"] == ROWS and first["data_docs_truncated"] == 0
    assert first["data_longest_doc"] > 64


def test_the_metrics_sum_the_hosts_counts_and_keep_the_longest(chat_file, tok, monkeypatch):
    """Each host counts its own share; the metrics record holds the hosts' sums (the longest
    document: their maximum). Two hosts' shares, gathered as the multi-host run gathers them."""
    from jax.experimental import multihost_utils

    from hybridmoe.data import sources
    cfg = _cfg(chat_file, "train.seq_len=24")
    hosts = [TextSource(cfg, tok, h, 2).long_documents for h in range(2)]
    hosts[1].longest -= 3  # the hosts' longest documents differ
    every = np.asarray([list(n.metrics().values()) for n in hosts], np.int64)
    monkeypatch.setattr(sources.jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: every)
    source = type("FileSourceLike", (), {"text": type("Text", (), {"long_documents": hosts[0]})()})()
    got = sources.long_document_metrics(source)
    want = {k: (max if k == "data_longest_doc" else sum)(n.metrics()[k] for n in hosts) for k in hosts[0].metrics()}
    assert got == want and got["data_docs_split"] == ROWS
