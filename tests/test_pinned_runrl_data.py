"""Data figures pinned on tiny hand-made documents: a text document's ids and mask, what the long
documents of a source became (split, truncated, targets cut), the epoch order of a shuffled source
and the arithmetic tasks' edges."""

import types

import numpy as np
import pytest

from hybridmoe.data.tokenizer import CharTokenizer


class _Tok:
    """Characters as their code points, BOS 1, EOS 2."""
    bos_id, eos_id, pad_id = 1, 2, 0

    def encode(self, text):
        return [ord(c) for c in text]


def test_a_text_document_is_bos_its_text_eos_and_trains_every_token():
    from hybridmoe.data.text import tokenize_document
    ids, mask = tokenize_document({"text": "ab"}, _Tok(), "text")
    assert ids == [1, 97, 98, 2]  # BOS, 'a', 'b', EOS
    assert mask == [1, 1, 1, 1]
    no_bos = _Tok()
    no_bos.bos_id = None
    assert tokenize_document({"body": "a"}, no_bos, "body") == ([97, 2], [1, 1])


def _bare_source():
    from hybridmoe.data.text import LongDocuments, TextSource
    src = TextSource.__new__(TextSource)
    src.docs, src.masks, src.long_documents = [], [], LongDocuments()
    return src


def test_split_documents_count_their_pieces_and_keep_every_trained_target():
    src = _bare_source()
    # 7 tokens at seq_len 3: pieces start at 0, 2, 4 (step seq_len - 1 = 2): [0:3], [2:5], [4:7];
    # a start at 6 would hold only the last token (no target): range(0, 6, 2) stops before it.
    src._add(np.arange(10, 17), np.ones(7, np.int32), 3, "split")
    n = src.long_documents
    assert (n.documents, n.split, n.pieces, n.truncated, n.targets_cut, n.longest) == (1, 1, 3, 0, 0, 7)
    assert [d.tolist() for d in src.docs] == [[10, 11, 12], [12, 13, 14], [14, 15, 16]]
    # A document that fits is neither split nor counted as a piece.
    src._add(np.array([5, 6, 7]), np.ones(3, np.int32), 3, "split")
    assert (n.documents, n.split, n.pieces, n.longest) == (2, 1, 3, 7)
    assert src.docs[-1].tolist() == [5, 6, 7]


def test_a_split_piece_without_a_trained_target_is_left_out_but_not_the_document():
    src = _bare_source()
    # 5 tokens at seq_len 3: pieces [0:3] and [2:5]; only the last token is trained, so the first
    # piece (targets 1, 2) trains nothing and is dropped.
    src._add(np.array([1, 2, 3, 4, 5]), np.array([0, 0, 0, 0, 1], np.int32), 3, "split")
    n = src.long_documents
    assert (n.documents, n.split, n.pieces) == (1, 1, 1)
    assert [d.tolist() for d in src.docs] == [[3, 4, 5]]


def test_truncation_counts_the_targets_past_the_limit_and_the_trained_ones_among_them():
    src = _bare_source()
    # 6 tokens at seq_len 4: tokens 4 and 5 are cut (2 targets), of which token 5 is trained.
    src._add(np.array([1, 2, 3, 4, 5, 6]), np.array([0, 1, 1, 1, 0, 1], np.int32), 4, "truncate")
    n = src.long_documents
    assert (n.documents, n.split, n.pieces, n.truncated, n.targets_cut, n.trained_targets_cut, n.longest) == (
        1, 0, 0, 1, 2, 1, 6)
    assert src.docs[0].tolist() == [1, 2, 3, 4] and src.masks[0].tolist() == [0, 1, 1, 1]


def test_a_document_without_a_trained_target_counts_toward_the_longest_only():
    src = _bare_source()
    src._add(np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]), np.array([1, 0, 0, 0, 0, 0, 0, 0, 0], np.int32), 4, "truncate")
    n = src.long_documents
    assert (n.documents, n.truncated, n.longest) == (0, 0, 9) and src.docs == []


def test_a_document_of_exactly_seq_len_is_kept_whole():
    from hybridmoe.data.text import fit_document
    ids, mask = np.arange(4), np.ones(4)
    out = fit_document(ids, mask, 4, "split")
    assert len(out) == 1 and out[0][0].tolist() == [0, 1, 2, 3]
    # 7 tokens at seq_len 3: pieces at 0, 2, 4 only; a piece at 6 would hold the last token alone.
    assert [o[0].tolist() for o in fit_document(np.arange(7), np.ones(7), 3, "split")] == [[0, 1, 2], [2, 3, 4],
                                                                                         [4, 5, 6]]
    out = fit_document(np.arange(5), np.ones(5), 4, "truncate")
    assert [o[0].tolist() for o in out] == [[0, 1, 2, 3]]


def test_a_shuffled_source_visits_each_epoch_in_the_order_of_its_own_stream():
    from hybridmoe.data.text import TextSource
    src = TextSource.__new__(TextSource)
    src.docs = [np.array([i]) for i in range(6)]
    src.masks = [np.array([1]) for _ in range(6)]
    src.seed, src.shuffle, src._orders = 5, True, {}
    # The documented stream: (train.seed, 3, epoch); 1 and 2 are the warm-up's and the prompts'.
    want0 = np.random.default_rng([5, 3, 0]).permutation(6).tolist()
    want1 = np.random.default_rng([5, 3, 1]).permutation(6).tolist()
    assert [int(src.document(c)[0]) for c in range(6)] == want0
    assert [int(src.document(c)[0]) for c in range(6, 12)] == want1
    assert want0 != np.random.default_rng([5, 1, 0]).permutation(6).tolist()


# ------------------------------------------------------------------------------------------------
# arithmetic tasks


def test_an_arithmetic_answer_must_be_the_whole_integer_and_may_be_signed():
    from hybridmoe.data.arithmetic import ArithmeticTask
    t = ArithmeticTask(digits=1, operators="-")
    assert t.reward("3-5=", " -2\n") == 1.0
    assert t.reward("3-5=", "2") == 0.0
    assert t.reward("3-5=", "-2 apples") == 0.0
    assert ArithmeticTask(operators="*").reward("12*3=", "36") == 1.0


def test_a_task_of_zero_digits_or_no_operator_is_refused_and_one_digit_is_accepted():
    from hybridmoe.data.arithmetic import ArithmeticTask, get_task
    with pytest.raises(ValueError, match="digits must be >= 1, got 0"):
        ArithmeticTask(digits=0)
    assert ArithmeticTask(digits=1).max_completion_chars == 2  # 9 + 9 = 18
    assert ArithmeticTask(digits=1, operators="-").max_completion_chars == 2  # 0 - 9 = -9: the sign counts
    with pytest.raises(ValueError, match="non-empty subset"):
        ArithmeticTask(operators="")
    with pytest.raises(ValueError, match="non-empty subset"):
        ArithmeticTask(operators="+/")
    with pytest.raises(KeyError, match="known tasks: arithmetic, format"):
        get_task("nope")


def test_the_format_reward_is_one_for_a_bare_integer_plus_the_bonus_when_right():
    from hybridmoe.data.arithmetic import FormatTask
    t = FormatTask(correct_bonus=0.5)
    assert t.reward("answer only: 1+2=", "3") == 1.5
    assert t.reward("answer only: 1+2=", "4") == 1.0
    assert t.reward("answer only: 1+2=", " 3") == 0.0
    assert FormatTask().reward("answer only: 1+2=", "3") == 1.0


def test_a_prompt_that_does_not_end_with_its_expression_is_not_scored():
    from hybridmoe.data.arithmetic import _evaluate
    assert _evaluate("12+34=") == 46 and _evaluate("x 7*6=") == 42 and _evaluate("2-9=") == -7
    with pytest.raises(ValueError, match="does not end with"):
        _evaluate("1+2= and more")


def test_solved_examples_train_on_the_answer_and_eos_only():
    from hybridmoe.data.arithmetic import Example, solved_token_ids
    tok = CharTokenizer()
    ids, mask = solved_token_ids(Example("1+2=", "3"), tok)
    assert ids == [1] + tok.encode("1+2=") + tok.encode("3") + [2]
    assert mask == [False] * 5 + [True, True]  # BOS + 4 prompt characters; '3' and EOS


# ------------------------------------------------------------------------------------------------
# chat: the spans an assistant turn trains


def test_generation_markers_give_the_outermost_blocks_spans_and_an_empty_block_none():
    from hybridmoe.data.chat import GENERATION_CLOSE as C, GENERATION_OPEN as O, generation_spans
    text, spans = generation_spans(f"a{O}bc{C}d{O}{O}e{C}f{C}{O}{C}g")
    assert text == "abcdefg"
    assert spans == [(1, 3), (4, 6)]  # 'bc'; 'ef' with the nested 'e' counted once; the empty block none


def test_a_turn_ends_after_the_first_stop_token_at_or_after_its_start():
    from hybridmoe.data.chat import turn_end
    assert turn_end("<e>z", 0, ["<e>"]) == 3  # a stop at the very start counts
    assert turn_end("x<e>y<ff>", 0, ["<ff>", "<e>"]) == 4  # the earliest of the stops: '<e>' at 1, 3 long
    assert turn_end("x<e>y<ff>", 2, ["<ff>", "<e>"]) == 9  # from 2 on: '<ff>' at 5, 4 long
    assert turn_end("xyz", 0, ["<e>"]) is None


class _Chat:
    """'<r>content|' per turn, '<a>' the generation prompt; id 3 is the end-of-turn '|', id 2 none."""
    stop_ids = (2, 3)

    def token_text(self, i):
        return "|" if i == 3 else None

    def encode(self, text):
        return [ord(c) for c in text]

    def render_chat(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role'][0]}>{m['content']}|" for m in messages) + ("<a>" if add_generation_prompt else "")

    def render_chat_marked(self, messages):
        return None


def test_every_assistant_turn_trains_from_its_generation_prompt_through_its_end_of_turn():
    from hybridmoe.data.chat import assistant_spans, end_of_turn_tokens
    assert end_of_turn_tokens(_Chat()) == ["|"]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"},
            {"role": "user", "content": "r"}, {"role": "assistant", "content": "c"}]
    full, spans = assistant_spans(_Chat(), msgs)
    assert full == "<u>q|<a>ab|<u>r|<a>c|"
    # Turn 1: after '<u>q|<a>' (5 + 3 characters) through 'ab|' (3); turn 3: after
    # '<u>q|<a>ab|<u>r|<a>' (5 + 6 + 5 + 3 = 19) through 'c|' (2).
    assert spans == [(8, 11), (19, 21)]


def test_a_template_that_renders_a_prefix_otherwise_is_refused():
    from hybridmoe.data.chat import prefix_spans

    class Odd(_Chat):
        def render_chat(self, messages, add_generation_prompt=True):
            return super().render_chat(messages, add_generation_prompt) + ("!" if add_generation_prompt else "")

    with pytest.raises(ValueError, match="before assistant turn 1 differently"):
        prefix_spans(Odd(), [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])


def test_a_turn_without_an_end_of_turn_token_runs_to_the_end_of_its_rendering():
    from hybridmoe.data.chat import prefix_spans

    class NoStop(_Chat):
        stop_ids = (2,)

    full, spans = prefix_spans(NoStop(), [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"},
                                          {"role": "user", "content": "r"}])
    assert spans == [(8, 11)]  # 'ab|' ends where the rendering of the first two turns ends


def test_text_is_encoded_piece_by_piece_with_the_spans_trained():
    from hybridmoe.data.chat import encode_with_spans
    ids, mask = encode_with_spans(_Chat(), "abcdef", [(3, 5), (1, 3)])
    assert ids == [97, 98, 99, 100, 101, 102]
    assert mask == [0, 1, 1, 1, 1, 0]  # spans sorted; adjacent spans are not an overlap
    with pytest.raises(ValueError, match="overlap at character 2"):
        encode_with_spans(_Chat(), "abcdef", [(1, 3), (2, 4)])


# ------------------------------------------------------------------------------------------------
# tokenizer, sources, prompt sets


def test_the_character_tokenizer_ids_are_pad_bos_eos_then_the_alphabet_in_order():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.stop_ids) == (0, 1, 2, (2,))
    # 3 special ids, then digits (3..12), '+-*=' (13..16), ' ' (17), a..z (18..43), A..Z (44..69),
    # then ':' (70) and 16 more punctuation characters: 3 + 10 + 4 + 1 + 26 + 26 + 17 = 87 ids.
    assert tok.encode("09+=  azAZ:") == [3, 12, 13, 16, 17, 17, 18, 43, 44, 69, 70]
    assert tok.vocab_size == 87
    assert tok.decode([1, 3, 0, 200, 13, 2, 4]) == "0+"  # PAD, BOS, unknown ids decode to nothing; EOS stops


def test_a_tokenizer_as_large_as_the_models_vocabulary_is_accepted(monkeypatch):
    import hybridmoe.data.text as text
    from hybridmoe.data.sources import FileSource
    monkeypatch.setattr(text, "TextSource", lambda cfg, tok, index, count: ("text", tok.vocab_size, index, count))
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(tokenizer=None),
                                model=types.SimpleNamespace(vocab_size=CharTokenizer().vocab_size))
    assert FileSource(cfg).text == ("text", 87, 0, 1)


def test_a_prompt_set_has_no_answer_length_of_its_own():
    from hybridmoe.data.prompts import PromptSetTask
    assert PromptSetTask(()).max_completion_chars == 0
    assert PromptSetTask(()).name == "prompts"


def test_a_prompt_set_keeps_prompts_up_to_the_limit_and_warns_of_the_longer_ones(tmp_path, caplog):
    import json
    import logging

    from hybridmoe.data.prompts import PromptSetTask
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc", "abcd", "abcdefg")))
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(prompts=str(f), on_bad_line="stop"),
                                rl=types.SimpleNamespace(max_prompt_len=5))
    with caplog.at_level(logging.WARNING, logger="hybridmoe.data.prompts"):
        task = PromptSetTask.from_config(cfg, CharTokenizer())
    # With BOS: 4, 5 and 8 tokens; 5 is at the limit (kept), 8 is over it.
    assert len(task.examples) == 3
    assert "1 of 3 prompts exceed rl.max_prompt_len=5 tokens (longest 8)" in caplog.text
