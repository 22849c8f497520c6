"""Tokenizer directory handling: tokenizer.json, chat templates in their three spellings, special ids."""
from __future__ import annotations

import json
import shutil

import pytest

from appliance.errors import ModelLoadError, RequestError
from appliance.model_zoo.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_encode_decode_and_chat_template(text_checkpoint):
    tok = Tokenizer(text_checkpoint)
    assert tok.decode(tok.encode("import os\nprint(1)")) == "import os\nprint(1)"
    assert tok.apply_chat_template(MESSAGES) == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nhi<|end|>\n" \
                                                "<|assistant|>\n"
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("<|assistant|>\n")
    assert tok.eos_token_ids == {1} and tok.bos_token_id == 0
    # special tokens are single ids and are skipped when decoding
    ids = tok.encode("<|user|>\nhi<|end|>", add_special_tokens=False)
    assert ids[0] == tok._tok.token_to_id("<|user|>") and tok.decode(ids) == "\nhi"


def test_named_template_list_and_jinja_file(text_checkpoint, tmp_path):
    d = shutil.copytree(text_checkpoint, tmp_path / "named")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                            {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(d).apply_chat_template(MESSAGES) == "[Be brief.][hi]"
    (d / "chat_template.jinja").write_text("{{ messages | length }} messages")
    assert Tokenizer(d).apply_chat_template(MESSAGES) == "2 messages"


def test_template_errors_are_request_errors(text_checkpoint, tmp_path):
    d = shutil.copytree(text_checkpoint, tmp_path / "strict")
    (d / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}")
    with pytest.raises(RequestError, match="System role not supported"):
        Tokenizer(d).apply_chat_template(MESSAGES)
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(RequestError, match="no chat template"):
        Tokenizer(d).apply_chat_template(MESSAGES)


def test_eos_falls_back_to_config_then_tokenizer_config(text_checkpoint, tmp_path):
    d = shutil.copytree(text_checkpoint, tmp_path / "eos")
    (d / "generation_config.json").unlink()
    raw = json.loads((d / "config.json").read_text())
    raw["eos_token_id"] = [1, 3]
    (d / "config.json").write_text(json.dumps(raw))
    assert Tokenizer(d).eos_token_ids == {1, 3}
    del raw["eos_token_id"]
    (d / "config.json").write_text(json.dumps(raw))
    assert Tokenizer(d).eos_token_ids == {Tokenizer(d)._tok.token_to_id("<|end|>")}


def test_missing_or_broken_tokenizer_json(text_checkpoint, tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer(tmp_path)
