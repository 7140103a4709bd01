"""Data glue pinned on tiny hand-made inputs: prompt sets measured against rl.max_prompt_len, the
built-in tasks' figures, the step-derived batches' structure, the shipped answer rewards at their
edges and the reward weights."""

import json
import logging
import types

import numpy as np
import pytest

from hybridmoe.data.arithmetic import ArithmeticTask, Example, FormatTask, solved_batch
from hybridmoe.data.prompts import PromptSetTask, read_prompt_set
from hybridmoe.data.records import DataError
from hybridmoe.data.synthetic import synthetic_batch
from hybridmoe.data.tokenizer import CharTokenizer


def _prompt_cfg(path, max_prompt_len):
    return types.SimpleNamespace(data=types.SimpleNamespace(prompts=str(path), on_bad_line="stop"),
                                 rl=types.SimpleNamespace(max_prompt_len=max_prompt_len))


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "p.jsonl"
    # 2, 4 and 6 characters: with BOS, 3, 5 and 7 tokens.
    f.write_text("".join(json.dumps({"prompt": p, "answer": a, "task": "t"}) + "\n"
                         for p, a in (("ab", 1), ("abcd", 2), ("abcdef", 3))))
    return f


def test_a_prompt_set_counts_its_prompts_longer_than_the_limit_bos_included(prompt_file, caplog):
    with caplog.at_level(logging.WARNING):
        task = PromptSetTask.from_config(_prompt_cfg(prompt_file, 5), CharTokenizer())
    assert len(task.examples) == 3
    # Only the 7-token prompt exceeds 5 (the 5-token one is exactly at it).
    assert "1 of 3 prompts exceed rl.max_prompt_len=5 tokens (longest 7)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        PromptSetTask.from_config(_prompt_cfg(prompt_file, 7), CharTokenizer())
    assert "exceed" not in caplog.text


def test_a_prompt_set_of_only_too_long_prompts_is_refused_with_the_length_to_raise_to(prompt_file):
    with pytest.raises(DataError, match=r"every prompt is longer than rl.max_prompt_len=2 tokens \(shortest 3, "
                                        r"longest 7\); raise rl.max_prompt_len to at least 7"):
        PromptSetTask.from_config(_prompt_cfg(prompt_file, 2), CharTokenizer())


def test_a_prompt_sets_examples_carry_the_line_and_its_answer(prompt_file):
    examples = read_prompt_set(prompt_file, CharTokenizer())
    assert [(e.prompt, e.reference) for e in examples] == [("ab", "1"), ("abcd", "2"), ("abcdef", "3")]
    assert examples[1].fields == {"prompt": "abcd", "answer": 2, "task": "t"}


def test_a_prompt_set_draws_without_replacement_until_asked_for_more_than_it_holds():
    task = PromptSetTask(tuple(Example(str(i), "") for i in range(3)))
    rng = np.random.default_rng(0)
    assert sorted(e.prompt for e in task.sample(rng, 3)) == ["0", "1", "2"]
    assert len(task.sample(rng, 7)) == 7
    with pytest.raises(RuntimeError, match="set rl.reward"):
        task.reward("p", "c")


def test_the_longest_answer_of_each_task_is_counted_in_characters():
    # 2 digits: 99 + 99 = 198 (3), 99 * 99 = 9801 (4), 0 - 99 = -99 (3).
    assert ArithmeticTask(digits=2, operators="+").max_completion_chars == 3
    assert ArithmeticTask(digits=2, operators="+-*").max_completion_chars == 4
    assert ArithmeticTask(digits=2, operators="-").max_completion_chars == 3
    assert ArithmeticTask(digits=1, operators="+").max_completion_chars == 2  # 18, and -9
    assert FormatTask(digits=3, operators="*").max_completion_chars == 6  # 999 * 999 = 998001
    with pytest.raises(ValueError, match="digits must be >= 1, got 0"):
        ArithmeticTask(digits=0)


def test_arithmetic_examples_are_in_range_and_answer_their_own_prompt():
    task = ArithmeticTask(digits=1, operators="-*")
    for e in task.sample(np.random.default_rng(3), 50):
        a, op, b = e.prompt[0], e.prompt[1], e.prompt[2]
        assert e.prompt == f"{a}{op}{b}=" and op in "-*"
        assert int(e.reference) == (int(a) - int(b) if op == "-" else int(a) * int(b))
        assert task.reward(e.prompt, e.reference) == 1.0
    # Each operand runs over 0 .. 9: 0 and 9 both drawn in 200 examples.
    many = task.sample(np.random.default_rng(4), 200)
    assert {int(e.prompt[0]) for e in many} == {int(e.prompt[2]) for e in many} == set(range(10))
    assert FormatTask(correct_bonus=0.5).sample(np.random.default_rng(0), 1)[0].prompt.startswith("answer only: ")
    assert FormatTask(correct_bonus=0.5).reward("answer only: 3-5=", "-2") == 1.5


def test_solved_batch_packs_bos_prompt_answer_eos_documents_into_the_rows():
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(seed=0, batch_size=4, seq_len=16, fewest_micro_batches=2),
                                rl=types.SimpleNamespace(task="arithmetic", digits=1, operators="+"))
    tok = CharTokenizer()
    rows = solved_batch(cfg, step=0, tokenizer=tok)
    assert rows["tokens"].shape == (2, 2, 16)
    tokens, seg = rows["tokens"].reshape(4, 16), rows["segment_ids"].reshape(4, 16)
    for r in range(4):
        for s in range(1, seg[r].max() + 1):
            doc = tokens[r][seg[r] == s]
            # [BOS] a + b = answer [EOS]
            assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
            text = tok.decode(doc[1:])
            a, rest = text.split("+")
            b, answer = rest.split("=")
            assert int(answer) == int(a) + int(b)
    # Documents are at most 9 tokens (BOS 9+9=18 EOS); 4 x 16 tokens take at least 8 of them.
    assert (seg.max(axis=1) >= 1).all() and seg.max(axis=1).sum() >= 8


def test_synthetic_rows_follow_a_chain_with_four_successors_a_token():
    rows = synthetic_batch(seed=1, step=0, micro_batches=2, batch_size=4, seq_len=64, vocab=8)
    assert rows["tokens"].shape == (2, 4, 64)
    tokens, seg = rows["tokens"].reshape(-1, 64), rows["segment_ids"].reshape(-1, 64)
    assert tokens[seg > 0].min() >= 1 and tokens.max() < 8  # 0 is never drawn (it pads)
    successors: dict[int, set] = {}
    for r in range(tokens.shape[0]):
        for t in range(63):
            if seg[r, t] > 0 and seg[r, t + 1] == seg[r, t]:
                successors.setdefault(int(tokens[r, t]), set()).add(int(tokens[r, t + 1]))
    assert max(len(s) for s in successors.values()) <= 4
    again = synthetic_batch(seed=1, step=0, micro_batches=1, batch_size=8, seq_len=64, vocab=8)
    np.testing.assert_array_equal(again["tokens"].reshape(-1, 64), tokens)  # the same rows at any split
    other = synthetic_batch(seed=1, step=1, micro_batches=2, batch_size=4, seq_len=64, vocab=8)
    assert not np.array_equal(other["tokens"], rows["tokens"])


# ------------------------------------------------------------------------------------------------
# answer rewards and reward weights


@pytest.mark.parametrize("completion, answer, want", [
    ("#### 42..", "42", 1.0),                # full stops after the number are not part of it
    ("\\boxed{New   York}", "New York", 1.0),  # text compares whitespace-collapsed
    ("\\boxed{new york}", "New York", 0.0),  # but not case-folded
    ("#### 0.50", "0.5", 1.0),
    ("#### 7\nmore text", "7", 1.0),          # the line of the last #### only
])
def test_final_answers_compare_numbers_as_numbers_and_text_as_text(completion, answer, want):
    from hybridmoe.rl.answer_rewards import final_answer_match
    assert final_answer_match("q", completion, {"answer": answer}) == want


def test_the_answer_format_allows_a_closing_full_stop_or_dollar_only():
    from hybridmoe.rl.answer_rewards import answer_format
    assert answer_format("q", "so \\boxed{7}$.  ", {}) == 1.0
    assert answer_format("q", "so \\boxed{7}!", {}) == 0.0
    assert answer_format("q", "#### 7\n", {}) == 1.0
    assert answer_format("q", "#### 7\nthanks", {}) == 0.0
    assert answer_format("q", "no answer", {}) == 0.0


def test_rewards_without_weights_weigh_one_each_and_a_count_mismatch_is_refused():
    from hybridmoe.rl.reward_loading import load_rewards
    spec = "hybridmoe.rl.answer_rewards:answer_format"
    loaded = load_rewards([spec, spec])
    assert [w for _, w in loaded] == [1.0, 1.0] and loaded[0][0].takes_example
    assert loaded[0][0].__qualname__ == spec
    with pytest.raises(ValueError):
        load_rewards([spec, spec], [0.5])


def test_a_reward_file_path_with_colons_splits_at_the_last(tmp_path):
    from hybridmoe.rl.reward_loading import RewardSpecError, load_reward
    (tmp_path / "a:b").mkdir()
    f = tmp_path / "a:b" / "r.py"
    f.write_text("def score(prompt, completion, example):\n    return len(completion) * 0.5\n")
    assert load_reward(f"{f}:score")("p", "abcd", {}) == 2.0
    with pytest.raises(RewardSpecError, match="expected path/to/file.py:function"):
        load_reward(f"{f}:")


# ------------------------------------------------------------------------------------------------
# training documents from files


def test_a_document_trains_something_only_with_a_trained_token_after_the_first():
    from hybridmoe.data.text import has_target
    assert not has_target(np.array([5, 6]), np.array([1, 0]))  # the first token is never a target
    assert has_target(np.array([5, 6]), np.array([0, 1]))
    assert not has_target(np.array([5]), np.array([1]))


class _ChatTokenizer:
    """Characters as ids (their code points), BOS 1, a ChatML-like template, '|' ends a turn."""
    bos_id, eos_id, stop_ids = 1, 2, (3,)

    def encode(self, text):
        return [ord(c) for c in text]

    def token_text(self, i):
        return "|" if i == 3 else None

    def render_chat(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role'][0]}>{m['content']}|" for m in messages)
        return text + ("<a>" if add_generation_prompt else "")

    def render_chat_marked(self, messages):
        return None


def test_a_conversation_trains_its_assistant_turn_through_the_end_of_turn_and_never_bos():
    from hybridmoe.data.text import tokenize_document
    ids, mask = tokenize_document({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                   "content": "yo"}]},
                                  _ChatTokenizer(), "text")
    # BOS, then "<u>hi|" (6, untrained), "<a>" (3, the generation prompt, untrained), "yo|" (3, trained).
    assert ids == [1] + [ord(c) for c in "<u>hi|<a>yo|"]
    assert mask == [0] + [0] * 9 + [1] * 3
    all_ids, all_mask = tokenize_document({"messages": [{"role": "user", "content": "hi"}]}, _ChatTokenizer(),
                                          "text", loss_on="all")
    assert all_ids == [1] + [ord(c) for c in "<u>hi|"] and all_mask == [1] * 7
    with pytest.raises(ValueError, match="no assistant turn"):
        tokenize_document({"messages": [{"role": "user", "content": "hi"}]}, _ChatTokenizer(), "text")


def test_file_rows_must_split_evenly_over_the_hosts():
    from hybridmoe.data.text import TextSource
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(), train=types.SimpleNamespace(rows_per_micro_batch=4,
                                                                                          batch_size=8))
    with pytest.raises(DataError, match=r"train.batch_size=8 \(4 per micro-batch\) does not split over 3 hosts"):
        TextSource(cfg, CharTokenizer(), host_index=0, host_count=3)


def _source(docs, rows, seq_len, micro_batches=1):
    from hybridmoe.data.text import TextSource
    src = TextSource.__new__(TextSource)
    src.docs = [np.asarray(d, np.int32) for d in docs]
    src.masks = [np.ones(len(d), np.int32) for d in docs]
    src.seed, src.shuffle, src.pad_id = 0, False, 0
    src.micro_batches, src.rows, src.seq_len, src._orders = micro_batches, rows, seq_len, {}
    return src


def test_a_step_packs_documents_from_the_cursor_until_one_fits_no_row():
    src = _source([[1, 2, 3], [4, 5], [6, 7, 8, 9]], rows=1, seq_len=5)
    rows, cursor = src.batch(0)
    # 3 + 2 tokens fill the row exactly; the 4-token document opens the next step.
    assert rows["tokens"].tolist() == [[[1, 2, 3, 4, 5]]] and cursor == 2
    rows, cursor = src.batch(2)
    # Document 2, then the next epoch's document 0 does not fit beside it (4 + 3 > 5).
    assert rows["tokens"].tolist() == [[[6, 7, 8, 9, 0]]] and cursor == 3
    rows, cursor = src.batch(3)  # cursor 3 = epoch 1, document 0
    assert rows["tokens"].tolist() == [[[1, 2, 3, 4, 5]]] and cursor == 5


def test_a_steps_rows_are_packed_together_then_split_into_micro_batches():
    src = _source([[1, 2], [3, 4], [5, 6], [7, 8], [9, 9, 9]], rows=2, seq_len=4, micro_batches=2)
    rows, cursor = src.batch(0)
    # 2 micro-batches x 2 rows of 4, first fit: [1 2 3 4], [5 6 7 8], [9 9 9] in row 2; the next epoch's
    # [1 2] does not fit beside it (3 + 2 > 4): row 3, and [3 4] fills row 3; [5 6] fits nowhere.
    assert rows["tokens"].shape == (2, 2, 4)
    assert rows["tokens"].reshape(4, 4).tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 0], [1, 2, 3, 4]]
    assert cursor == 7


# ------------------------------------------------------------------------------------------------
# training sources


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused():
    from hybridmoe.data.sources import FileSource
    n = CharTokenizer().vocab_size
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(tokenizer=None),
                                model=types.SimpleNamespace(vocab_size=n - 1))
    with pytest.raises(DataError, match=f"the tokenizer \\(built-in\\) has {n} ids but model.vocab_size={n - 1}"):
        FileSource(cfg)


def test_the_long_document_figures_of_one_host_are_its_own_and_step_rows_have_none():
    from hybridmoe.data.sources import long_document_metrics
    from hybridmoe.data.text import LongDocuments
    counts = LongDocuments(documents=9, split=2, pieces=5, truncated=1, targets_cut=7, trained_targets_cut=3,
                           longest=40)
    src = types.SimpleNamespace(text=types.SimpleNamespace(long_documents=counts))
    assert long_document_metrics(src) == {"data_docs_split": 2, "data_split_pieces": 5, "data_docs_truncated": 1,
                                          "data_targets_cut": 7, "data_trained_targets_cut": 3,
                                          "data_longest_doc": 40}
    assert long_document_metrics(types.SimpleNamespace()) == {}


def test_step_rows_are_synthetic_or_solved_and_leave_the_position_alone():
    from hybridmoe.data.sources import StepSource
    train = types.SimpleNamespace(data="synthetic", seed=0, fewest_micro_batches=1, rows_per_micro_batch=2,
                                  seq_len=8, batch_size=2)
    cfg = types.SimpleNamespace(train=train, model=types.SimpleNamespace(vocab_size=16),
                                rl=types.SimpleNamespace(task="arithmetic", digits=1, operators="+"))
    rows, position = StepSource(cfg).batch(3, 11)
    assert position == 11 and rows["tokens"].shape == (1, 2, 8)
    np.testing.assert_array_equal(rows["tokens"], synthetic_batch(0, 3, 1, 2, 8, 16)["tokens"])
    train.data = "arithmetic"
    rows, position = StepSource(cfg).batch(3, 11)
    assert position == 11 and CharTokenizer().decode(rows["tokens"][0, 0, 1:]).count("+") == 1
