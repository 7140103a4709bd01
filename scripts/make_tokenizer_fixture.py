"""Write the tiny tokenizer files of tests/fixtures/hf_tiny with the `tokenizers` library itself.

A real BPE tokenizer.json (Metaspace pre-tokenizer, as sentencepiece-style vocabularies use; ChatML
special tokens as Qwen uses) trained on a small built-in corpus to 256 ids, the vocabulary of the
fixture model; tokenizer_config.json naming the special tokens; chat_template.jinja (ChatML); and
generation_config.json whose eos_token_id lists both stop tokens, as Qwen instruct releases do.
Nothing is downloaded. Run: python scripts/make_tokenizer_fixture.py [OUT_DIR]
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 256
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def corpus() -> list[str]:
    lines = [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)]
    lines += [f"What is {a} plus {b}? The answer is \\boxed{{{a + b}}}. #### {a + b}" for a in range(12) for b in range(7)]
    lines += ["system", "user", "assistant", "You are a helpful assistant.", "Think step by step.",
              "The quick brown fox jumps over the lazy dog.", string.ascii_letters, string.punctuation]
    return lines


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    alphabet = list(string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")) + ["\u2581"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    return tok


def main(out: Path) -> None:
    tok = build()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "model_max_length": 32768}, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
         "pad_token_id": tok.token_to_id("<|endoftext|>"), "do_sample": True, "temperature": 0.7, "top_p": 0.8},
        indent=2) + "\n")
    print(f"wrote {out}: {tok.get_vocab_size()} ids")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent.parent / "tests" / "fixtures" / "hf_tiny")
