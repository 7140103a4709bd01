"""A checkpoint's own tokenizer: tokenizer.json through `tokenizers`, the chat template, the stop ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridmoe.data.tokenizer import CharTokenizer, compile_chat_template, load_tokenizer

HF_TINY = Path(__file__).parent / "fixtures" / "hf_tiny"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(HF_TINY)


def test_fixture_tokenizer_round_trips_text_and_fits_the_model(tok):
    assert tok.vocab_size == json.loads((HF_TINY / "config.json").read_text())["vocab_size"]
    text = "What is 12 plus 3? \\boxed{15}\n#### 15"
    ids = tok.encode(text)
    assert len(ids) < len(text) and tok.decode(ids) == text  # merges, lossless


def test_special_ids_from_the_config_files(tok):
    gen = json.loads((HF_TINY / "generation_config.json").read_text())
    assert tok.eos_id == tok._tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok._tok.token_to_id("<|endoftext|>") and tok.bos_id is None
    assert set(tok.stop_ids) == set(gen["eos_token_id"])


def test_decode_stops_at_every_stop_id(tok):
    ids = tok.encode("1+2=3")
    for stop in tok.stop_ids:
        assert tok.decode(ids + [stop] + tok.encode("junk")) == "1+2=3"


def test_chat_template_renders_chatml_and_encodes_specials_as_one_id(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    text = tok.render_chat(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("1+2=<|im_end|>\n")
    ids = tok.encode(text)
    assert ids.count(tok._tok.token_to_id("<|im_start|>")) == 3 and ids.count(tok.eos_id) == 2


def test_template_from_tokenizer_config_and_sandbox(tmp_path):
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(HF_TINY / name, tmp_path / name)
    cfg = json.loads((HF_TINY / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "é"}]) == '[user]"é"'
    import jinja2
    with pytest.raises(jinja2.exceptions.SecurityError):  # a downloaded template cannot reach Python internals
        compile_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}").render()
    with pytest.raises(jinja2.exceptions.TemplateError, match="only user"):
        compile_chat_template("{{ raise_exception('only user') }}").render()
    tok = load_tokenizer(tmp_path)
    tok.chat_template = "{{ raise_exception('the template refuses: ' + messages[0].role) }}"
    with pytest.raises(ValueError, match=f"chat template of {tmp_path}: TemplateError: the template refuses: user"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_no_pad_token_pads_with_eos_and_a_list_of_templates_takes_the_default(tmp_path):
    """A tokenizer_config without pad_token (Qwen base models): padding is EOS (never id 0, a real
    token). One whose chat_template is a list of named templates: the one named default, wherever it is."""
    shutil.copy(HF_TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((HF_TINY / "tokenizer_config.json").read_text())
    del cfg["pad_token"]
    cfg["chat_template"] = [{"name": "tool_use", "template": "tools:{{ messages[0].content }}"},
                            {"name": "default", "template": "default:{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok.pad_id == tok.eos_id == tok._tok.token_to_id("<|im_end|>") != 0
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "default:hi"


def test_no_template_and_builtin_tokenizer_say_what_to_do(tmp_path):
    shutil.copy(HF_TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="character tokenizer has no chat template"):
        CharTokenizer().render_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("damage, needle", [
    ("tokenizer.json", "tokenizers library cannot load it"),
    ("tokenizer_config.json", "tokenizer_config.json: not valid JSON"),
])
def test_broken_tokenizer_files_are_named(tmp_path, damage, needle):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HF_TINY / name, tmp_path / name)
    (tmp_path / damage).write_text("{broken")
    with pytest.raises(ValueError, match=needle) as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value)
