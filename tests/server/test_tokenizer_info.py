"""vLLM's /tokenizer_info, in process: with --enable-tokenizer-info-endpoint it answers tokenizer_config.json's fields
(vocabulary file paths left out, a token spelled {"content": ...} as its text), tokenizer_class and the chat template
served; without the flag the route does not exist, as vLLM's."""
from __future__ import annotations

import json
import shutil

import pytest

from appliance.config import EMBEDDED_MODEL_DIR, Config
from appliance.model_zoo.tokenizer import Tokenizer
from in_process import ready_app


def test_the_route_answers_the_tokenizer_config_with_the_flag_and_is_absent_without():
    cfg = Config.flat(kv_cache_memory="16MiB", max_model_len=128, enable_tokenizer_info_endpoint=True)
    with ready_app(cfg) as client:
        answer = client.get("/tokenizer_info")
        assert answer.status_code == 200, answer.text
        info = answer.json()
        saved = json.loads((EMBEDDED_MODEL_DIR / "tokenizer_config.json").read_text())
        assert info["tokenizer_class"] == saved["tokenizer_class"]
        assert info["chat_template"] == saved["chat_template"]
        assert info["eos_token"] == saved["eos_token"] and info["model_max_length"] == saved["model_max_length"]
        assert info["added_tokens_decoder"] == {i: t["content"] for i, t in saved["added_tokens_decoder"].items()}
        assert "/tokenizer_info" in client.get("/openapi.json").json()["paths"]
    with ready_app(Config.flat(kv_cache_memory="16MiB", max_model_len=128)) as client:
        assert client.get("/tokenizer_info").status_code == 404
        assert "/tokenizer_info" not in client.get("/openapi.json").json()["paths"]


@pytest.fixture
def model_copy(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL_DIR, path)
    return path


def test_paths_are_left_out_tokens_become_text_and_the_served_template_replaces_the_saved_one(model_copy):
    config_path = model_copy / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    saved.update(vocab_file="/somewhere/vocab.json", merges_file="/somewhere/merges.txt",
                 eos_token={"content": "<|end|>", "lstrip": False, "special": True},
                 extra_special_tokens=[{"content": "<|user|>", "special": True}, "<|system|>"])
    del saved["tokenizer_class"]
    config_path.write_text(json.dumps(saved))
    info = Tokenizer(model_copy, chat_template="{{ messages[0]['content'] }}").info()
    assert "vocab_file" not in info and "merges_file" not in info
    assert info["eos_token"] == "<|end|>" and info["extra_special_tokens"] == ["<|user|>", "<|system|>"]
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"  # (what transformers builds from tokenizer.json)
    assert info["chat_template"] == "{{ messages[0]['content'] }}"
    json.dumps(info)  # all of it JSON


def test_a_model_without_a_template_answers_none(model_copy):
    config_path = model_copy / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    del saved["chat_template"]
    config_path.write_text(json.dumps(saved))
    for extra in model_copy.glob("chat_template*"):
        extra.unlink()
    assert "chat_template" not in Tokenizer(model_copy).info()
