"""data.loss_on=assistant: the loss covers exactly the assistant's turns, per template form.

The reference for each form is the conversation written out by hand as pieces of text, each
trained or not: an assistant turn trains what a generation of it writes, from after the
generation prompt (`<|im_start|>assistant\\n`) through the end-of-turn token `<|im_end|>`; the
newline after it, the headers and every system/user turn do not. The template forms: ChatML
without generation markers (spans from rendering prefixes), ChatML with `{% generation %}` markers,
and a template that rewrites earlier turns once later ones follow (as Qwen3's does with its think
block), each multi-turn with a system turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from broken_variants import mutated
from hybridmoe.data import chat
from hybridmoe.data.packing import pack_documents
from hybridmoe.data.text import TextSource, tokenize_document
from hybridmoe.data.tokenizer import load_tokenizer
from hybridmoe.run.loss_mask import loss_mask

FIXTURES = Path(__file__).parent / "fixtures"
HF_TINY = FIXTURES / "hf_tiny"

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And 4 plus 4?"},
    {"role": "assistant", "content": "8"},
]

MARKED_CHATML = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

# The last assistant turn after the last user turn carries a think block; earlier ones lose it.
REWRITING = (
    "{%- set ns = namespace(last_user=0) %}\n"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_user %}\n"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)


def _tokenizer(tmp_path_factory, template: str | None):
    if template is None:
        return load_tokenizer(HF_TINY)
    d = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (d / name).write_bytes((HF_TINY / name).read_bytes())
    (d / "chat_template.jinja").write_text(template)
    return load_tokenizer(d)


def _pieces(think_last: bool):
    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n"
    return [
        (head + "<|im_start|>assistant\n", 0),
        ("The answer is 5.<|im_end|>", 1),
        ("\n<|im_start|>user\nAnd 4 plus 4?<|im_end|>\n<|im_start|>assistant\n", 0),
        (("<think>\n\n</think>\n\n" if think_last else "") + "8<|im_end|>", 1),
        ("\n", 0),
    ]


FORMS = {"chatml_prefixes": (None, False), "chatml_generation_markers": (MARKED_CHATML, False),
         "history_rewriting_prefixes": (REWRITING, True)}


@pytest.fixture(scope="module", params=sorted(FORMS))
def form(request, tmp_path_factory):
    template, think_last = FORMS[request.param]
    return request.param, _tokenizer(tmp_path_factory, template), _pieces(think_last)


def expected(tok, pieces):
    ids, mask = [], []
    for text, trained in pieces:
        part = tok.encode(text)
        ids += part
        mask += [trained] * len(part)
    return ids, mask


def mask_error(tok, pieces, messages=CONVERSATION) -> int:
    """Tokens where the mask differs from the hand-written reference (or the ids do)."""
    got_ids, got_mask = tokenize_document({"messages": messages}, tok, "text")
    want_ids, want_mask = expected(tok, pieces)
    if got_ids != want_ids:
        return max(len(got_ids), len(want_ids))
    return int(np.sum(np.asarray(got_mask) != np.asarray(want_mask)))


def test_the_mask_covers_exactly_the_assistant_turns(form):
    name, tok, pieces = form
    ids, mask = tokenize_document({"messages": CONVERSATION}, tok, "text")
    assert mask_error(tok, pieces) == 0, name
    trained = "".join(tok._tok.decode([i], skip_special_tokens=False) for i, m in zip(ids, mask) if m)
    want = "".join(text for text, t in pieces if t)
    assert trained.replace(" ", "").replace("\u2581", "") == want.replace(" ", ""), (trained, want)
    # What the document holds is what the template renders (the pieces rejoin to the rendering).
    assert "".join(text for text, _ in pieces) == tok.render_chat(CONVERSATION, add_generation_prompt=False)


def test_single_turn_without_system(form):
    name, tok, pieces = form
    messages = CONVERSATION[3:]
    last = pieces[3][0]
    single = [("<|im_start|>user\nAnd 4 plus 4?<|im_end|>\n<|im_start|>assistant\n", 0), (last, 1), ("\n", 0)]
    assert mask_error(tok, single, messages) == 0, name


BROKEN = {
    # The end-of-turn token left out of the loss: the model never learns to stop.
    "closing_token_masked": (chat, "turn_end", "return p + n", "return p"),
    # The newline the template puts after the end-of-turn token trained as well.
    "newline_after_turn_trained": (chat, "turn_end", "return p + n", "return p + n + 1"),
    # The prompt pieces trained too.
    "prompt_kept": (chat, "encode_with_spans", "(text[at:start], 0)", "(text[at:start], 1)"),
    # A generation block's span one character short (the markers' bookkeeping).
    "generation_span_short": (chat, "generation_spans", "spans.append((start, len(text)))",
                              "spans.append((start, len(text) - 1))"),
}
# Which template forms each variant reaches (the prefix search or the generation markers).
REACHES = {"closing_token_masked": ("chatml_prefixes", "history_rewriting_prefixes"),
           "newline_after_turn_trained": ("chatml_prefixes", "history_rewriting_prefixes"),
           "prompt_kept": tuple(FORMS), "generation_span_short": ("chatml_generation_markers",)}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_broken_variants_are_caught(form, variant, monkeypatch):
    name, tok, pieces = form
    if name not in REACHES[variant]:
        pytest.skip(f"{variant} is not on the {name} path")
    module, fn, old, new = BROKEN[variant]
    monkeypatch.setattr(module, fn, mutated(module, fn, old, new))
    try:
        errors = mask_error(tok, pieces)
    except ValueError:  # a variant can also make the spans unusable: caught as well
        return
    assert errors > 0, variant


def test_a_turn_ends_at_the_first_stop_token_after_it():
    """Two stop tokens after a turn's start: the turn ends with the nearer one, `<|im_end|>` at
    characters 5-14 (the end, 15), not with the `<|endoftext|>` after it; from past it, the next."""
    text = "Hi 5.<|im_end|>\nuser<|endoftext|>"
    stops = ["<|endoftext|>", "<|im_end|>"]
    assert chat.turn_end(text, 0, stops) == 15
    assert chat.turn_end(text, 15, stops) == len(text)
    assert chat.turn_end("no stop here", 0, stops) is None


def test_loss_on_all_and_text_records_train_every_token():
    tok = load_tokenizer(HF_TINY)
    ids, mask = tokenize_document({"messages": CONVERSATION}, tok, "text", loss_on="all")
    assert mask == [1] * len(ids) and tok._tok.decode(ids, skip_special_tokens=False) == tok.render_chat(
        CONVERSATION, add_generation_prompt=False)
    ids, mask = tokenize_document({"text": "1+1=2"}, tok, "text")
    assert mask == [1] * len(ids) and ids[-1] == tok.eos_id


def test_a_conversation_without_an_assistant_turn_is_a_bad_line(tmp_path):
    from hybridmoe.data.records import DataError
    from hybridmoe.recipe import load_config
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": CONVERSATION[:2]}) + "\n")
    cfg = load_config(f"hf:{HF_TINY}", ["train.data=files", f"data.path={f}", "train.batch_size=4"])
    with pytest.raises(DataError, match=r"d.jsonl:1: the conversation has no assistant turn .*data.loss_on=all"):
        TextSource(cfg, load_tokenizer(HF_TINY))


def test_packing_carries_each_documents_mask_to_its_tokens():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, n) for n in (5, 9, 3, 12, 7)]
    masks = [rng.integers(0, 2, len(d)) for d in docs]
    rows = pack_documents(docs, 2, 20, masks=masks)
    for r in range(2):
        for s in range(1, rows["segment_ids"][r].max() + 1):
            at = rows["segment_ids"][r] == s
            k = next(i for i, d in enumerate(docs) if len(d) == at.sum() and (rows["tokens"][r][at] == d).all())
            np.testing.assert_array_equal(rows["loss_mask"][r][at], masks[k])
    assert (rows["loss_mask"][rows["segment_ids"] == 0] == 0).all()


def test_loss_mask_of_targets_against_a_plain_loop():
    rng = np.random.default_rng(1)
    seg = np.sort(rng.integers(0, 4, (3, 17)), axis=1)[:, ::-1].copy()  # documents then padding
    tok_mask = rng.integers(0, 2, (3, 17))
    got = np.asarray(loss_mask(seg, tok_mask))
    want = np.zeros((3, 16), bool)
    for b in range(3):
        for t in range(16):
            want[b, t] = seg[b, t + 1] == seg[b, t] and seg[b, t + 1] > 0 and tok_mask[b, t + 1] == 1
    np.testing.assert_array_equal(got, want)


def _one_masked_row():
    """(config, params, rows) of a one-attention-layer model and one packed row of documents of 9,
    14 and 6 tokens, each token's loss mask drawn at random."""
    from helpers import tiny_config, tiny_params
    cfg = tiny_config("model.layer_pattern=[attention]", "model.num_layers=1")
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 256, n) for n in (9, 14, 6)]
    masks = [rng.integers(0, 2, len(d)) for d in docs]
    return cfg, tiny_params(cfg), pack_documents(docs, 1, 32, masks=masks)


def test_the_step_loss_averages_over_the_masked_targets_only():
    """nll_sum of rows with a loss_mask is the plain sum of -log p over the masked targets."""
    from hybridmoe.model.forward import token_logprobs
    from hybridmoe.run.step import nll_sum
    cfg, params, rows = _one_masked_row()
    lp = np.asarray(token_logprobs(params, cfg, rows["tokens"], rows["segment_ids"], rows["positions"]), np.float64)
    want_mask = np.asarray(loss_mask(rows["segment_ids"], rows["loss_mask"]))
    loss, count = jax.jit(lambda p, b: nll_sum(p, cfg, b))(params, rows)
    assert int(count) == int(want_mask.sum()) < int(np.asarray(loss_mask(rows["segment_ids"])).sum())
    np.testing.assert_allclose(float(loss), -lp[want_mask].sum(), rtol=1e-5)


def test_the_steps_tokens_are_every_target_and_loss_tokens_the_masked_ones():
    """One training step over one packed row of documents of 9, 14 and 6 tokens with loss masks:
    `tokens` counts every next-token target, 8 + 13 + 5 = 26 (the throughput's count), `loss_tokens`
    only the masked ones, the loss's denominator (fewer)."""
    from hybridmoe.data.packing import split_micro_batches
    from hybridmoe.run.step import make_optimizer, train_step
    cfg, params, rows = _one_masked_row()
    masked = int(np.asarray(loss_mask(rows["segment_ids"], rows["loss_mask"])).sum())
    optimizer = make_optimizer(cfg.train)
    state = {"params": params, "opt_state": optimizer.init(params), "step": 0}
    _, m = jax.jit(train_step(cfg, optimizer))(state, split_micro_batches(rows, 1))
    assert int(m["tokens"]) == 26 and 0 < int(m["loss_tokens"]) == masked < 26


def test_packing_by_hand_first_fit_exact_fills_and_positions_from_zero():
    """Documents of 4, 6 and 10 tokens into 2 rows of 10: the 6 fills row 0's last 6 slots exactly,
    the 10 fills row 1 whole; every document's positions count from 0 (RoPE sees each alone)."""
    a, b, c = np.arange(1, 5), np.arange(11, 17), np.arange(21, 31)
    rows = pack_documents([a, b, c], 2, 10)
    np.testing.assert_array_equal(rows["tokens"], [[1, 2, 3, 4, 11, 12, 13, 14, 15, 16], list(range(21, 31))])
    np.testing.assert_array_equal(rows["segment_ids"], [[1] * 4 + [2] * 6, [1] * 10])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], list(range(10))])
