"""The data layer: JSONL/Parquet records, bad lines, packing into rows, host sharding, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from broken_variants import mutated
from helpers import ATTENTION_LAYERS
from hybridmoe.recipe import load_config
from hybridmoe.data.records import DataError, prompt_or_messages, read_records, text_or_messages
from hybridmoe.data.text import TextSource
from hybridmoe.data.tokenizer import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
HF_TINY = FIXTURES / "hf_tiny"
SFT = FIXTURES / "data" / "sft.jsonl"


def cfg_for(path, *extra):
    return load_config(f"hf:{HF_TINY}", ["train.data=files", f"data.path={path}", "train.batch_size=4",
                                          "train.seq_len=32", *extra])


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(HF_TINY)


def test_text_and_messages_documents_are_tokenized_with_the_template(tok):
    src = TextSource(cfg_for(SFT, "data.shuffle=false"), tok)
    lines = [json.loads(x) for x in SFT.read_text().splitlines()]
    assert len(src.docs) == len(lines)
    assert tok.decode(src.docs[1]) == lines[1]["text"] and src.docs[1][-1] == tok.eos_id
    chat = tok._tok.decode(src.docs[0].tolist(), skip_special_tokens=False)
    assert chat.startswith("<|im_start|>user\n") and "<|im_start|>assistant\nThe answer is" in chat


def _consumed(src, cursor, steps):
    """Documents of `steps` batches from `cursor`, checking each batch holds exactly those documents."""
    out = []
    for _ in range(steps):
        rows, nxt = src.batch(cursor)
        want = [src.document(k) for k in range(cursor, nxt)]
        got = [rows["tokens"][m, r][rows["segment_ids"][m, r] == s]
               for m in range(rows["tokens"].shape[0]) for r in range(rows["tokens"].shape[1])
               for s in range(1, rows["segment_ids"][m, r].max() + 1)]
        assert sorted(map(tuple, got)) == sorted(tuple(d.tolist()) for d in want)
        # Each document's loss mask travels with it (data.loss_on=assistant: the chat documents' prompts are 0).
        got_masks = [(tuple(rows["tokens"][m, r][rows["segment_ids"][m, r] == s]),
                      tuple(rows["loss_mask"][m, r][rows["segment_ids"][m, r] == s]))
                     for m in range(rows["tokens"].shape[0]) for r in range(rows["tokens"].shape[1])
                     for s in range(1, rows["segment_ids"][m, r].max() + 1)]
        want_masks = [(tuple(src.document(k)), tuple(src.document_mask(k))) for k in range(cursor, nxt)]
        assert sorted(got_masks) == sorted(want_masks)
        out.append((rows, cursor, nxt))
        cursor = nxt
    return out


def test_packing_consumes_each_document_once_per_epoch_and_resumes_exactly(tok):
    src = TextSource(cfg_for(SFT, "train.micro_batches=2", "train.batch_size=8"), tok)
    assert any(0 < m.sum() < len(m) for m in src.masks)  # conversations train only their assistant turns
    run = _consumed(src, 0, 6)
    assert run[-1][2] > len(src.docs)  # crossed into the second epoch
    first_epoch = [src.document(k).tolist() for k in range(len(src.docs))]
    assert sorted(map(tuple, first_epoch)) == sorted(tuple(d.tolist()) for d in src.docs)
    # A fresh source (a restarted process) from a saved cursor gives the same batches.
    again = TextSource(cfg_for(SFT, "train.micro_batches=2", "train.batch_size=8"), tok)
    for rows, cursor, nxt in run[3:]:
        got, got_next = again.batch(cursor)
        assert got_next == nxt
        for k in rows:
            np.testing.assert_array_equal(got[k], rows[k])


def test_a_step_s_rows_and_cursor_are_the_same_at_any_micro_batch_count(tok):
    """train.batch_size rows are packed together and split after: 2 micro-batches of 4 are the 8 rows
    of 1 micro-batch in order, from the same documents (packed per micro-batch, the first 4 rows
    would fill before the next 4 start: other rows, another cursor)."""
    one = TextSource(cfg_for(SFT, "train.micro_batches=1", "train.batch_size=8"), tok)
    two = TextSource(cfg_for(SFT, "train.micro_batches=2", "train.batch_size=8"), tok)
    cursor_one = cursor_two = 0
    for _ in range(3):
        rows_one, cursor_one = one.batch(cursor_one)
        rows_two, cursor_two = two.batch(cursor_two)
        assert cursor_one == cursor_two
        for k in rows_one:
            assert rows_one[k].shape == (1, 8, 32) and rows_two[k].shape == (2, 4, 32)
            np.testing.assert_array_equal(rows_two[k].reshape(8, 32), rows_one[k][0])


def test_hosts_read_disjoint_shares_that_cover_the_file(tok):
    cfg = cfg_for(SFT, "data.shuffle=false")
    hosts = [TextSource(cfg, tok, h, 2) for h in range(2)]
    assert hosts[0].rows == 2
    assert len(hosts[0].docs) + len(hosts[1].docs) == len(TextSource(cfg, tok).docs)
    both = [tuple(d.tolist()) for h in hosts for d in h.docs]
    assert sorted(both) == sorted(tuple(d.tolist()) for d in TextSource(cfg, tok).docs)


def test_parquet_reads_the_same_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(x) for x in SFT.read_text().splitlines() if "text" in x]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    recs, bad = read_records(tmp_path, "data.path", text_or_messages("text"), "stop")
    assert [r.fields for r in recs] == rows and bad.count == 0 and recs[2].line == 3
    (tmp_path / "t.parquet").write_bytes(b"PAR1 broken")
    with pytest.raises(DataError, match="t.parquet: not a readable Parquet file"):
        read_records(tmp_path, "data.path", text_or_messages("text"), "stop")


def test_a_folder_is_read_in_file_name_order_whatever_order_the_filesystem_lists(tmp_path, monkeypatch):
    """A folder's records are in file-name order: the hosts' shares (records h, h + n, ...) and the
    saved cursors index that order, so it must not be the filesystem's listing order (a copy of the
    folder on another disk, or another host's copy, lists it otherwise)."""
    for name in ("c.jsonl", "a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n" + json.dumps({"text": name + " line 2"}) + "\n")
    (tmp_path / "notes.txt").write_text("not data")
    listing = Path.iterdir
    for order in (sorted, lambda files: sorted(files, reverse=True)):
        monkeypatch.setattr(Path, "iterdir", lambda self, order=order: iter(order(listing(self))))
        recs, _ = read_records(tmp_path, "data.path", text_or_messages("text"), "stop")
        assert [r.fields["text"] for r in recs] == ["a.jsonl", "a.jsonl line 2", "b.jsonl", "b.jsonl line 2",
                                                    "c.jsonl", "c.jsonl line 2"], order


BAD = ['{"prompt": "1+1=", "answer": "2"}', "{not json", '{"answer": "3"}', "", '["a list"]',
       '{"messages": [{"role": "user"}]}', '{"prompt": "2+2=", "answer": "4"}']


def test_bad_lines_stop_with_the_first_line_and_the_count(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(BAD) + "\n")
    with pytest.raises(DataError) as e:
        read_records(f, "data.prompts", prompt_or_messages, "stop")
    msg = str(e.value)
    assert f"4 bad line(s); the first is {f}:2: not valid JSON" in msg and "data.on_bad_line=skip" in msg


def test_bad_lines_skipped_are_counted(tmp_path, caplog):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(BAD) + "\n")
    recs, bad = read_records(f, "data.prompts", prompt_or_messages, "skip")
    assert [r.line for r in recs] == [1, 7] and bad.count == 4 and bad.first.startswith(f"{f}:2:")
    assert "skipped 4 bad line(s)" in caplog.text


def test_an_empty_conversation_is_a_bad_line(tmp_path):
    """`messages: []` (and a `messages` that is not a list) is no document and no prompt: line 2 is
    refused by name, and skipped lines leave lines 1 and 4."""
    f = tmp_path / "t.jsonl"
    f.write_text('{"text": "1+1=2"}\n{"messages": []}\n{"messages": "hi"}\n{"text": "2+2=4"}\n')
    with pytest.raises(DataError) as e:
        read_records(f, "data.path", text_or_messages("text"), "stop")
    assert f"2 bad line(s); the first is {f}:2: 'messages' must be a non-empty list" in str(e.value)
    recs, bad = read_records(f, "data.path", text_or_messages("text"), "skip")
    assert [r.line for r in recs] == [1, 4] and bad.count == 2
    assert prompt_or_messages({"messages": []}) == "'messages' must be a non-empty list of {role, content} objects"


def test_text_the_tokenizer_cannot_encode_names_the_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"text": "12+3=15"}\n{"text": "12\u20ac"}\n')
    cfg = load_config("tiny", ["train.data=files", f"data.path={f}"])
    with pytest.raises(DataError, match=f"{f}:2: character"):
        TextSource(cfg, load_tokenizer())
    assert len(TextSource(load_config("tiny", ["train.data=files", f"data.path={f}", "data.on_bad_line=skip"]),
                          load_tokenizer()).docs) == 1


@pytest.mark.parametrize("path, needle", [("missing.jsonl", "no such file"), ("x.txt", "expected a")])
def test_bad_paths(tmp_path, path, needle):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match=needle):
        read_records(tmp_path / path, "data.path", text_or_messages("text"), "stop")


@pytest.mark.slow  # three compiled runs: ~4 min on a loaded 2-core machine
def test_train_on_jsonl_from_a_checkpoint_resumes_at_the_exact_document(tmp_path):
    """`train --init-hf` on a JSONL file; killed after step 2 (a run of 2 steps) and resumed to
    step 4, it gives the uninterrupted run's losses bit for bit (same documents, same state)."""
    from hybridmoe.cli import main
    from hybridmoe.run.metrics import JSONL_NAME
    words = ["train", "train.data=files", f"data.path={SFT}", "train.batch_size=8", "train.seq_len=32",
             "train.checkpoint_every=2", "--init-hf", str(HF_TINY)]

    def losses(out):
        return {r["step"]: r["loss"] for r in map(json.loads, (out / JSONL_NAME).read_text().splitlines())}

    assert main([*words, "train.steps=4", "--out", str(tmp_path / "a")]) == 0
    assert main([*words, "train.steps=2", "--out", str(tmp_path / "b")]) == 0
    assert main([*words, "train.steps=4", "--out", str(tmp_path / "b"), "--resume"]) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(a) == [0, 1, 2, 3] and a == b


# Attention layers only (helpers.ATTENTION_LAYERS): where a resumed run reads on does not depend on the mixers.
RESUME_OVER = ("train.data=files", "train.batch_size=8", "train.seq_len=16", "train.checkpoint_every=2",
               "train.warmup_steps=0", *ATTENTION_LAYERS)


@pytest.fixture(scope="module")
def file_runs(tmp_path_factory):
    """A JSONL of 60 documents of 3..14 characters (the character tokenizer: 5..16 tokens), so a step
    packs a dozen or so and ends where the next document fits no row; three steps straight, and two
    steps then `--resume` to three (the smallest run that resumes from a cursor), in one process."""
    from hybridmoe.train.loop import train
    root = tmp_path_factory.mktemp("file_runs")
    rng = np.random.default_rng(5)
    docs = ["".join(map(str, rng.integers(0, 10, size=n))) for n in rng.integers(3, 15, size=60)]
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = lambda steps: load_config("tiny", [*RESUME_OVER, f"data.path={data}", f"train.steps={steps}"])  # noqa: E731
    straight = train(cfg(3), root / "straight", progress=False)
    train(cfg(2), root / "killed", progress=False)
    return cfg, root, straight


def _resumed(file_runs, tmp_path):
    from hybridmoe.train.loop import train
    import shutil
    cfg, root, _ = file_runs
    shutil.copytree(root / "killed", tmp_path / "run")
    return train(cfg(3), tmp_path / "run", resume=True, progress=False)


def test_resume_continues_at_the_exact_next_document(file_runs, tmp_path):
    """`--resume` after the step-2 checkpoint of a run on a JSONL file: step 2 packs the documents the
    uninterrupted run's step 2 packed (its loss bit for bit), starting at the document that did
    not fit step 1."""
    from hybridmoe.run.checkpoint import Checkpoints
    cfg, root, straight = file_runs
    meta = Checkpoints(root / "killed" / "checkpoints").restore_meta(2)
    src = TextSource(cfg(3), load_tokenizer())
    assert meta["data_position"] == [src.batch(src.batch(0)[1])[1]] and 0 < meta["data_position"][0] < 60
    resumed = _resumed(file_runs, tmp_path)
    assert [h["step"] for h in resumed] == [2] and resumed[0]["loss"] == straight[2]["loss"], (resumed, straight)


@pytest.mark.parametrize("variant", ["one_document_late", "from_the_first_document"])
def test_a_resume_at_another_document_is_caught(variant, file_runs, tmp_path, monkeypatch):
    """Broken variants of the cursor a resume starts from: each changes step 2's loss."""
    import hybridmoe.train.loop as train_loop
    real = train_loop.start_position
    shift = {"one_document_late": 1, "from_the_first_document": None}[variant]
    monkeypatch.setattr(train_loop, "start_position",
                        lambda meta, *rest: 0 if shift is None else real(meta, *rest) + shift)
    _, _, straight = file_runs
    assert _resumed(file_runs, tmp_path)[0]["loss"] != straight[2]["loss"], variant


def test_cursor_round_trips_through_checkpoint_metadata():
    from hybridmoe.data.sources import position_record, start_position
    assert start_position({"data_position": position_record(17)}) == 17
    assert start_position(None) == 0 and start_position({}) == 0  # a fresh run
    assert start_position({"data_position": [17, 4]}, host_local=False) == 0  # step-derived rows: no cursor


# Broken variants of where a host's cursor comes from (hybridmoe/data/sources.py start_position).
CURSOR_BROKEN = {
    # Every host resumes at host 0's cursor.
    "every_host_at_the_first_cursor": ("int(positions[jax.process_index()])", "int(positions[0])"),
    # Every host resumes at the last host's cursor.
    "every_host_at_the_last_cursor": ("int(positions[jax.process_index()])", "int(positions[-1])"),
    # The host count not checked: a checkpoint of 2 hosts resumes on 1 at host 0's cursor, into another share.
    "host_count_unchecked": ("if len(positions) != jax.process_count():", "if len(positions) < jax.process_count():"),
}


def resume_cursors(start_position, monkeypatch) -> dict[str, object]:
    """What start_position gives each host of a 2-host checkpoint (cursors 5 and 9, as
    position_record writes them: index = process index) on 2 hosts, and on 1 host (refused)."""
    import jax
    from hybridmoe.data.records import DataError
    meta, out = {"data_position": [5, 9]}, {}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for host in range(2):
        monkeypatch.setattr(jax, "process_index", lambda: host)
        out[f"host {host} of 2"] = start_position(meta, True)
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    try:
        out["host 0 of 1"] = start_position(meta, True)
    except DataError as e:
        out["host 0 of 1"] = str(e)
    return out


def test_each_host_resumes_at_its_own_cursor_and_another_host_count_is_refused(monkeypatch):
    from hybridmoe.data import sources
    got = resume_cursors(sources.start_position, monkeypatch)
    assert got["host 0 of 2"] == 5 and got["host 1 of 2"] == 9, got
    refusal = got["host 0 of 1"]
    assert isinstance(refusal, str) and "data_position [5, 9]" in refusal and "2 host(s)" in refusal, refusal
    assert "this run has 1 process(es)" in refusal and "data.path" in refusal, refusal


@pytest.mark.parametrize("variant", list(CURSOR_BROKEN))
def test_broken_cursors_are_caught(variant, monkeypatch):
    from hybridmoe.data import sources
    got = resume_cursors(mutated(sources, "start_position", *CURSOR_BROKEN[variant]), monkeypatch)
    assert (got["host 0 of 2"], got["host 1 of 2"]) != (5, 9) or not isinstance(got["host 0 of 1"], str), got


# ---------------------------------------------------------------------------------------------
# The stream across epochs: epoch e visits the host's documents in an order drawn from
# (train.seed, e), each a permutation of the host's share of the file (lines h, h + n, ...). The
# expectations are read from the file here (json, the tokenizer's decode), not from the source.

EPOCH_TEXTS = [str(10 ** 3 + 37 * i) * (1 + i % 3) for i in range(16)]  # 16 distinct documents, 4-12 characters
EPOCHS = 4


@pytest.fixture(scope="module")
def epoch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("epochs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in EPOCH_TEXTS))
    return path


def epoch_orders(source_class, path, *over, hosts=2, start_epoch=0) -> dict[int, list[list[str]]]:
    """{host: [the texts epoch e visits, for e from start_epoch]}, read through document(cursor)."""
    cfg = load_config("tiny", ["train.data=files", f"data.path={path}", "train.batch_size=8", "train.seq_len=16",
                               *over])
    tok = load_tokenizer()
    out = {}
    for h in range(hosts):
        src = source_class(cfg, tok, h, hosts)
        n = len(src.docs)
        out[h] = [[tok.decode(src.document(e * n + i)) for i in range(n)] for e in range(start_epoch, EPOCHS)]
    return out


def epoch_problems(source_class, path) -> list[str]:
    lines = [json.loads(x)["text"] for x in path.read_text().splitlines()]
    orders, problems = epoch_orders(source_class, path), []
    for h, epochs in orders.items():
        share = lines[h::2]
        if any(sorted(e) != sorted(share) for e in epochs):
            problems.append(f"host {h}: an epoch does not visit each of its documents once")
        if len({tuple(e) for e in epochs}) != EPOCHS or share in epochs:
            problems.append(f"host {h}: two epochs in one order, or one in the file's order")
    # A pure function of (seed, epoch): a source started in a later epoch (a resumed process) visits
    # the same orders; another seed visits others; data.shuffle=false visits the file's order.
    later = epoch_orders(source_class, path, start_epoch=2)
    if any(later[h] != orders[h][2:] for h in orders):
        problems.append("a source started in epoch 2 visits other orders")
    reseeded = epoch_orders(source_class, path, "train.seed=1")
    if any(reseeded[h][e] == orders[h][e] for h in orders for e in range(EPOCHS)):
        problems.append("another train.seed visits an epoch in the same order")
    in_order = epoch_orders(source_class, path, "data.shuffle=false")
    if any(e != lines[h::2] for h in in_order for e in in_order[h]):
        problems.append("data.shuffle=false does not visit the file's order")
    return problems


def test_each_epoch_visits_every_document_once_in_an_order_of_its_own(epoch_file):
    assert epoch_problems(TextSource, epoch_file) == []


# Broken variants of the epoch order (hybridmoe/data/text.py TextSource): the fragment, its
# replacement, and the problem epoch_problems must report.
EPOCH_BROKEN = {
    # Every epoch reuses the first epoch's order.
    "every_epoch_in_the_first_order": ("[self.seed, DATA_STREAM, epoch]", "[self.seed, DATA_STREAM, 0]",
                                       "two epochs in one order"),
    # The order ignores train.seed.
    "order_without_the_seed": ("[self.seed, DATA_STREAM, epoch]", "[DATA_STREAM, epoch]", "another train.seed"),
    # An epoch one document short: its last document is never visited.
    "epoch_one_document_short": ("epoch, i = divmod(cursor, len(self.docs))",
                                 "epoch, i = divmod(cursor, len(self.docs) - 1)", "each of its documents once"),
    # Every host reads host 0's share.
    "every_host_reads_the_first_share": ("records[host_index::host_count]", "records[0::host_count]",
                                         "host 1: an epoch does not visit each of its documents once"),
}


@pytest.mark.parametrize("variant", list(EPOCH_BROKEN))
def test_broken_epoch_orders_are_caught(variant, epoch_file):
    from hybridmoe.data import text
    old, new, expected = EPOCH_BROKEN[variant]
    problems = epoch_problems(mutated(text, "TextSource", old, new), epoch_file)
    assert any(expected in p for p in problems), (variant, problems)


def test_fine_tune_a_checkpoint_on_jsonl_and_export_it(tmp_path):
    """The user's path end to end: `train --init-hf DIR` on a JSONL file, `--export-hf` a folder
    that our loader reads back with the trained weights (not the initial ones)."""
    from hybridmoe.cli import main
    from hybridmoe import hf
    out = tmp_path / "hf_out"
    assert main(["train", "train.data=files", f"data.path={SFT}", "train.steps=2", "train.warmup_steps=0",
                 "train.seq_len=32", "--init-hf", str(HF_TINY), "--export-hf", str(out),
                 "--out", str(tmp_path / "run")]) == 0
    # The metrics count the loss tokens per step: fewer than the targets (the chats' prompts are not trained).
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["loss_tokens"] < r["tokens"] for r in records), records
    assert (out / "tokenizer.json").read_bytes() == (HF_TINY / "tokenizer.json").read_bytes()
    _, trained = hf.load_hf_checkpoint(str(out))
    _, initial = hf.load_hf_checkpoint(str(HF_TINY))
    assert trained["embed"].shape == initial["embed"].shape
    assert not np.array_equal(trained["embed"], initial["embed"])  # two optimizer steps moved the weights


def test_a_line_that_is_not_json_names_where_in_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x"\n{"prompt": x}\n')
    with pytest.raises(DataError) as e:
        read_records(f, "data.prompts", prompt_or_messages, "stop")
    assert "p.jsonl:1: not valid JSON (Expecting ',' delimiter at the end of the line)" in str(e.value)
    f.write_text('{"prompt": x}\n')
    with pytest.raises(DataError, match=r"p.jsonl:1: not valid JSON \(Expecting value at column 12\)"):
        read_records(f, "data.prompts", prompt_or_messages, "stop")


@pytest.mark.parametrize("lines, needle", [
    (['{"text": "1+1=2"}', "{oops"], ":2: not valid JSON"),
    (['{"txt": "1+1=2"}'], "no 'text' string and no 'messages' list (fields: txt)"),
])
def test_train_on_bad_data_stops_before_anything_is_written(tmp_path, capsys, lines, needle):
    from hybridmoe.cli import main
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    assert main(["train", "train.data=files", f"data.path={f}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(f) in err and "data.on_bad_line=skip" in err and "Traceback" not in err
    assert not out.exists()
