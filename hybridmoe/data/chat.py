"""Conversations as training documents with the loss on the assistant's turns (data.loss_on).

What an assistant turn trains is what a generation of that turn would produce: from the end of the
prompt the template renders for it (`add_generation_prompt=True`: `<|im_start|>assistant\\n` in
ChatML) through the template's end-of-turn token (`<|im_end|>`, so the model learns to stop), not
the formatting the template puts after it (the newline before the next turn). Every assistant
turn of a multi-turn conversation trains; system, user and tool turns do not.

The spans come from the chat template:
- A template with generation markers (`{% generation %} ... {% endgeneration %}` around what the
  assistant writes, as transformers' `return_assistant_tokens_mask` reads them) says it itself.
- Otherwise from renderings of the conversation's prefixes: turn i starts where the rendering of
  messages[:i] with the generation prompt ends (that rendering must begin the full conversation's),
  and ends after the first end-of-turn token from there.

The document is then encoded piece by piece (prompt pieces and assistant pieces apart), so the
mask is exact at every boundary and each prompt piece is the token sequence the sampler would
be given for it.
"""

from __future__ import annotations

from collections.abc import Sequence

# Private-use characters that wrap a generation block while rendering; never left in the text.
GENERATION_OPEN, GENERATION_CLOSE = "\ue000", "\ue001"


def generation_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """A rendering with generation blocks wrapped in the markers -> (the text without them, the
    blocks' character spans in it). Nested blocks count as their outermost one."""
    text, spans, depth, start = [], [], 0, 0
    for ch in marked:
        if ch == GENERATION_OPEN:
            if depth == 0:
                start = len(text)
            depth += 1
        elif ch == GENERATION_CLOSE:
            depth -= 1
            if depth == 0 and len(text) > start:
                spans.append((start, len(text)))
        else:
            text.append(ch)
    return "".join(text), spans


def end_of_turn_tokens(tokenizer) -> list[str]:
    """The texts of the tokenizer's stop tokens (`<|im_end|>`, `<|endoftext|>`, ...)."""
    out = []
    for i in tokenizer.stop_ids:
        text = tokenizer.token_text(i)
        if text:
            out.append(text)
    return out


def turn_end(text: str, start: int, stops: Sequence[str]) -> int | None:
    """The end of the first end-of-turn token at or after `start` (None: there is none)."""
    found = [(p, len(s)) for s in stops for p in [text.find(s, start)] if p >= 0]
    if not found:
        return None
    p, n = min(found)
    return p + n


def prefix_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character span each assistant turn trains), found from
    renderings of the conversation's prefixes (a template without generation markers)."""
    full = tokenizer.render_chat(messages, add_generation_prompt=False)
    stops = end_of_turn_tokens(tokenizer)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        if not full.startswith(prompt):
            raise ValueError(f"the chat template renders the conversation before assistant turn {i} differently once "
                             "the turn follows, so the turn cannot be found from prefixes: add {% generation %} "
                             "markers around the assistant's part of the template, or pass data.loss_on=all")
        start = len(prompt)
        end = turn_end(full, start, stops)
        if end is None:  # a template without an end-of-turn token: the turn runs to where its rendering ends
            turn = tokenizer.render_chat(messages[:i + 1], add_generation_prompt=False)
            if not full.startswith(turn):
                raise ValueError(f"assistant turn {i}: the chat template ends it with none of the stop tokens "
                                 f"{stops} and renders it differently once later turns follow: add {{% generation %}} "
                                 "markers to the template, or pass data.loss_on=all")
            end = len(turn)
        spans.append((start, end))
    return full, spans


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans the assistant's turns train)."""
    marked = tokenizer.render_chat_marked(messages)
    if marked is not None and GENERATION_OPEN in marked:
        return generation_spans(marked)
    return prefix_spans(tokenizer, messages)


def encode_with_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(token ids, 1 where the token is trained) of `text`, encoded piece by piece at the spans' edges."""
    ids, mask, at = [], [], 0
    for start, end in sorted(spans):
        if start < at:
            raise ValueError(f"assistant spans overlap at character {start}")
        for piece, trained in ((text[at:start], 0), (text[start:end], 1)):
            if piece:
                part = tokenizer.encode(piece)
                ids += part
                mask += [trained] * len(part)
        at = end
    if text[at:]:
        part = tokenizer.encode(text[at:])
        ids += part
        mask += [0] * len(part)
    return ids, mask
