"""Tokenizer of a Hugging Face model directory: `tokenizer.json` through the `tokenizers` library, the chat template
from `tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2, and special ids from
`generation_config.json` / `config.json`.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from appliance.errors import ModelLoadError, RequestError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise RequestError(f"chat template: {message}", "messages")


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found (muxd reads tokenizers in the tokenizer.json format)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise ModelLoadError(f"{path}: cannot be read by the tokenizers library: {exc}") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = self._find_template(model_dir, config)
        eos = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
        if eos is None and self.eos_token is not None:
            eos = self._tok.token_to_id(self.eos_token)
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        self.bos_token_id: int | None = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None

    @staticmethod
    def _find_template(model_dir: Path, config: dict[str, Any]) -> str | None:
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if self.chat_template is None:
            raise RequestError("this model has no chat template (tokenizer_config.json lacks 'chat_template'); "
                               "use /v1/completions", "messages")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template failed to render: {exc}", "messages") from exc
