"""Tokenizers: a fixed character-level one for the built-in tasks, and a checkpoint's own
`tokenizer.json` (through the Hugging Face `tokenizers` library) with its chat template and stop tokens.

Both speak the same small interface (`Tokenizer`): `encode(str) -> list[int]` without special
tokens, `decode(ids) -> str` that stops at the first stop token, the special ids the trainer needs
to build sequences (`[BOS] prompt completion [EOS] [PAD]...`), and `render_chat(messages)`.

A checkpoint folder contributes: tokenizer.json (the vocabulary and pre-/post-processing),
tokenizer_config.json (eos/pad/bos token names, and the chat template in older releases),
chat_template.jinja (the chat template in newer releases) and generation_config.json (the ids that
end a generation: `eos_token_id`, one id or a list).
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

    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


class CharTokenizer:
    """One id per character of a fixed alphabet; ids 0, 1, 2 are PAD, BOS, EOS.

    The vocabulary (~100 ids) fits the `tiny` model's 256 rows; rows past `vocab_size` are simply
    never produced by encode (a policy that samples one decodes it as nothing, see `decode`).
    """

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    stop_ids = (EOS_ID,)

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

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise ValueError("the built-in character tokenizer has no chat template: `messages` need a checkpoint's "
                         "tokenizer (recipe=hf:DIR or --init-hf DIR with tokenizer.json and a chat template)")

    render_chat_marked = render_chat


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` interface."""

    def __init__(self, hf_tokenizer, *, eos_token: str, pad_token: str | None, bos_token: str | None,
                 stop_ids: Iterable[int] = (), chat_template: str | None = None, where: str = "tokenizer.json"):
        self._tok = hf_tokenizer
        self.where = where
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._require_id(eos_token, "eos_token")
        # No pad token is common (Qwen base models); padding is always masked, so EOS serves.
        self.pad_id = self._require_id(pad_token, "pad_token") if pad_token else self.eos_id
        self.bos_id = self._require_id(bos_token, "bos_token") if bos_token else None
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in stop_ids)]))
        self._special = {"eos_token": eos_token, "bos_token": bos_token or "", "pad_token": pad_token or ""}
        self.chat_template = chat_template
        self._compiled = None

    def _require_id(self, token: str, what: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.where}: {what} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to (not including) the first stop token; special tokens dropped."""
        kept = []
        for i in ids:
            i = int(i)
            if i in self.stop_ids:
                break
            kept.append(i)
        return self._tok.decode(kept, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The checkpoint's chat template applied to `messages` ([{"role", "content"}, ...])."""
        return self._render(messages, add_generation_prompt, mark_generation=False)

    def render_chat_marked(self, messages: list[dict]) -> str:
        """The conversation rendered with each `{% generation %}` block of the template wrapped in
        data/chat.py's markers (none when the template has no such blocks)."""
        return self._render(messages, False, mark_generation=True)

    def _render(self, messages, add_generation_prompt: bool, mark_generation: bool) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.where}: the checkpoint has no chat template (no chat_template in "
                             "tokenizer_config.json, no chat_template.jinja): give `prompt`/`text` fields instead "
                             "of `messages`, or add the model's chat_template.jinja to the folder")
        import jinja2
        try:
            if self._compiled is None:
                self._compiled = compile_chat_template(self.chat_template)
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{MARK_GENERATION: mark_generation}, **self._special)
        except jinja2.exceptions.TemplateError as e:  # a syntax error, or the template's raise_exception
            raise ValueError(f"the chat template of {Path(self.where).parent}: {type(e).__name__}: {e}") from None


MARK_GENERATION = "_hybridmoe_mark_generation"  # the render variable that turns the generation markers on


def _generation_extension():
    """`{% generation %} ... {% endgeneration %}`: the part of an assistant turn that the model
    writes. Rendered as its body; with MARK_GENERATION set, wrapped in data/chat.py's markers."""
    import jinja2.ext
    from jinja2 import nodes

    from hybridmoe.data.chat import GENERATION_CLOSE, GENERATION_OPEN

    class GenerationBlocks(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            mark = nodes.Name(MARK_GENERATION, "load")
            return nodes.CallBlock(self.call_method("_block", [mark]), [], [], body).set_lineno(lineno)

        def _block(self, mark, caller):
            return GENERATION_OPEN + caller() + GENERATION_CLOSE if mark is True else caller()

    return GenerationBlocks


def compile_chat_template(source: str):
    """A Jinja2 template in the sandbox (a template is data from a download: it may not reach Python
    internals), with what chat templates expect: trim_blocks/lstrip_blocks, a `tojson` filter that
    keeps non-ASCII text, `raise_exception(message)` and `{% generation %}` blocks."""
    import json as _json

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _generation_extension()])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: _json.dumps(x, indent=indent,
                                                                                   ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


# Tried in order when tokenizer_config.json does not name an EOS token.
_EOS_CANDIDATES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>")


def _special_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # older configs store {"content": "<|...|>", ...}
        value = value.get("content")
    return value or None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); restore it from the model's release") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _generation_stop_ids(path: Path) -> list[int]:
    eos = _read_json(path).get("eos_token_id")
    if eos is None:
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def load_tokenizer(path_or_dir: str | Path | None = None) -> Tokenizer:
    """None: the built-in character tokenizer. A directory (a checkpoint) or a tokenizer.json file:
    that Hugging Face tokenizer, with EOS/PAD/BOS from tokenizer_config.json, the chat template from
    chat_template.jinja or tokenizer_config.json, and the stop ids from generation_config.json
    beside it. Raises FileNotFoundError / ValueError naming the file that is missing or broken."""
    if path_or_dir is None:
        return CharTokenizer()
    path = Path(path_or_dir)
    json_path = path / "tokenizer.json" if path.is_dir() else path
    if not json_path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {json_path}")
    try:
        import tokenizers  # a pinned dependency; checked so a broken install says what to do
    except ImportError:
        raise ImportError(
            f"loading {json_path} needs the Hugging Face `tokenizers` package: "
            "pip install tokenizers==0.23.3"
        ) from None

    folder = json_path.parent
    config = _read_json(folder / "tokenizer_config.json")
    try:
        hf = tokenizers.Tokenizer.from_file(str(json_path))
    except Exception as e:  # noqa: BLE001 -- the Rust library raises a bare Exception
        raise ValueError(f"{json_path}: the tokenizers library cannot load it ({e}); "
                         "restore tokenizer.json from the model's release") from None
    eos = _special_token(config, "eos_token")
    if eos is None:
        eos = next((t for t in _EOS_CANDIDATES if hf.token_to_id(t) is not None), None)
    if eos is None:
        raise ValueError(
            f"{json_path}: no eos_token in tokenizer_config.json and none of {_EOS_CANDIDATES} in the vocabulary"
        )
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return HFTokenizer(hf, eos_token=eos, pad_token=_special_token(config, "pad_token"),
                       bos_token=_special_token(config, "bos_token"),
                       stop_ids=_generation_stop_ids(folder / "generation_config.json"),
                       chat_template=template, where=str(json_path))
