"""Two ready rewards for prompt sets with reference answers (`rl.reward=hybridmoe.rl.answer_rewards:NAME`).

final_answer_match: 1.0 when the completion's final answer equals the example's `answer`. The
final answer is the content of the last \\boxed{...} (nested braces allowed), else the text after
the last `####` (the GSM8K convention). A reference answer may itself be a GSM8K solution ending
in `#### 72`: its own final answer is taken. Numbers compare as numbers ("1,000", "$1000.00" and
"1000" agree); anything else compares as whitespace-collapsed text.

answer_format: 1.0 when the completion states exactly one final answer that way and ends with it,
else 0.0: a shaping reward for the form alone, usually weighted below final_answer_match.
"""

from __future__ import annotations

import re

_HASHES = re.compile(r"####\s*([^\n]*)")


def _boxed_contents(text: str) -> list[str]:
    """Contents of every \\boxed{...}, braces balanced."""
    out, start = [], 0
    while (i := text.find("\\boxed{", start)) >= 0:
        depth, j = 1, i + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:
            break  # unclosed: not an answer
        out.append(text[i + len("\\boxed{"):j - 1])
        start = j
    return out


def final_answer(text: str) -> str | None:
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1].strip()
    hashes = _HASHES.findall(text)
    return hashes[-1].strip() if hashes else None


def _normalise(answer: str):
    plain = answer.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(plain)
    except ValueError:
        return " ".join(answer.split())


def final_answer_match(prompt: str, completion: str, example: dict) -> float:
    if "answer" not in example:
        raise KeyError("final_answer_match needs an 'answer' field in each prompt-set line")
    got = final_answer(completion)
    reference = str(example["answer"])
    want = final_answer(reference) or reference.strip()
    return float(got is not None and _normalise(got) == _normalise(want))


def answer_format(prompt: str, completion: str, example: dict) -> float:
    boxed = _boxed_contents(completion)
    hashes = _HASHES.findall(completion)
    if len(boxed) + len(hashes) != 1:
        return 0.0
    tail = completion.rstrip().rstrip(".$")
    ends = tail.endswith("}") if boxed else bool(re.search(r"####[^\n]*$", tail))
    return float(ends)
