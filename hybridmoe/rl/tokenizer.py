"""Tokenizers for RL: a fixed character-level one for the built-in tasks, and a wrapper around a
Hugging Face `tokenizer.json` when a checkpoint brings its own.

Both speak the same small interface (`Tokenizer`): `encode(str) -> list[int]` without special
tokens, `decode(ids) -> str` that stops at the first EOS, and the special ids the trainer needs to
build sequences (`[BOS] prompt completion [EOS] [PAD]...`).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
_NUM_SPECIAL = 3

# Everything the built-in tasks write, plus enough punctuation for stated-format prompts. The order
# is part of the vocabulary: changing it changes every id a checkpoint was trained on.
_CHARS = (
    string.digits
    + "+-*="
    + " "
    + string.ascii_lowercase
    + string.ascii_uppercase
    + ":.,?!()[]<>#/'\"_\n"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the RL trainer needs from a tokenizer. `bos_id` is None when the vocabulary has none
    (Qwen checkpoints start sequences without a BOS)."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class CharTokenizer:
    """One id per character of a fixed alphabet; ids 0, 1, 2 are PAD, BOS, EOS.

    The vocabulary (~100 ids) fits the `tiny` model's 256 rows; rows past `vocab_size` are simply
    never produced by encode (a policy that samples one decodes it as nothing, see `decode`).
    """

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self) -> None:
        self._id_of = {ch: _NUM_SPECIAL + i for i, ch in enumerate(_CHARS)}
        self._char_of = {i: ch for ch, i in self._id_of.items()}
        self.vocab_size = _NUM_SPECIAL + len(_CHARS)

    @property
    def alphabet(self) -> str:
        return _CHARS

    def encode(self, text: str) -> list[int]:
        try:
            return [self._id_of[ch] for ch in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in the character tokenizer's alphabet {_CHARS!r}"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to (not including) the first EOS. PAD, BOS and ids outside the alphabet (a policy
        over a 256-row head can sample them) decode to nothing rather than raising mid-run."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            out.append(self._char_of.get(i, ""))
        return "".join(out)


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` interface."""

    def __init__(self, hf_tokenizer, *, eos_token: str, pad_token: str | None, bos_token: str | None):
        self._tok = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._require_id(eos_token, "eos_token")
        # No pad token is common (Qwen base models); padding is always masked, so EOS serves.
        self.pad_id = self._require_id(pad_token, "pad_token") if pad_token else self.eos_id
        self.bos_id = self._require_id(bos_token, "bos_token") if bos_token else None

    def _require_id(self, token: str, what: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{what} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        kept = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            kept.append(i)
        return self._tok.decode(kept, skip_special_tokens=True)


# Tried in order when tokenizer_config.json does not name an EOS token.
_EOS_CANDIDATES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>")


def _special_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # older configs store {"content": "<|...|>", ...}
        value = value.get("content")
    return value or None


def load_tokenizer(path_or_dir: str | Path | None = None) -> Tokenizer:
    """None: the built-in character tokenizer. A directory (a checkpoint) or a tokenizer.json file:
    that Hugging Face tokenizer, with EOS/PAD/BOS taken from tokenizer_config.json beside it when
    present."""
    if path_or_dir is None:
        return CharTokenizer()
    path = Path(path_or_dir)
    json_path = path / "tokenizer.json" if path.is_dir() else path
    if not json_path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {json_path}")
    try:
        import tokenizers  # optional: only checkpoints with their own vocabulary need it
    except ImportError:
        raise ImportError(
            f"loading {json_path} needs the Hugging Face `tokenizers` package: "
            "pip install tokenizers==0.23.3"
        ) from None

    config_path = json_path.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    hf = tokenizers.Tokenizer.from_file(str(json_path))
    eos = _special_token(config, "eos_token")
    if eos is None:
        eos = next((t for t in _EOS_CANDIDATES if hf.token_to_id(t) is not None), None)
    if eos is None:
        raise ValueError(
            f"{json_path}: no eos_token in {config_path.name} and none of {_EOS_CANDIDATES} in the vocabulary"
        )
    return HFTokenizer(hf, eos_token=eos, pad_token=_special_token(config, "pad_token"),
                       bos_token=_special_token(config, "bos_token"))
