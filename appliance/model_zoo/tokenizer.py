"""Tokenizer of a Hugging Face model directory: `tokenizer.json` through the `tokenizers` library, the chat template
from `tokenizer_config.json` (or `chat_template.jinja`, or an override) rendered with jinja2, special ids from
`generation_config.json` / `config.json`, and a cheap lower bound on a text's token count.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from appliance.errors import ConfigError, ModelLoadError, RequestError


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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox HF templates expect; a syntax error is a ConfigError."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson  # as transformers renders templates: no HTML escaping, Unicode kept
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"chat template: syntax error on line {exc.lineno}: {exc.message}") from exc


_TEXT_KEEPING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"}


def _keeps_all_text(pre: dict[str, Any] | None) -> bool:
    """True when a pre-tokenizer drops no character (Whitespace, BERT and 'Removed' splits drop some)."""
    if pre is None or pre.get("type") in _TEXT_KEEPING:
        return True
    if pre.get("type") in ("Split", "Punctuation"):
        return pre.get("behavior") != "Removed"
    if pre.get("type") == "Sequence":
        return all(_keeps_all_text(p) for p in pre.get("pretokenizers", []))
    return False


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
        self.max_bytes_per_token = self._max_bytes_per_token(json.loads(self._tok.to_str()))

    def _max_bytes_per_token(self, spec: dict[str, Any]) -> int | None:
        """The most UTF-8 bytes of (normalized) text one token can stand for, where such a bound exists: a BPE model
        that never fuses runs of unknown characters into one token, a pre-tokenizer that drops nothing, no added
        token that swallows whitespace. Vocabulary strings are never shorter than the bytes they cover (byte-level and byte-fallback
        spellings are longer), so their longest UTF-8 length bounds it."""
        model = spec.get("model") or {}
        added = spec.get("added_tokens") or []
        fused_unknowns = model.get("fuse_unk") and not model.get("byte_fallback")  # byte fallback leaves no unk
        if model.get("type") != "BPE" or fused_unknowns or not _keeps_all_text(spec.get("pre_tokenizer")):
            return None
        if any(t.get("lstrip") or t.get("rstrip") for t in added):
            return None
        longest = max((len(piece.encode()) for piece in model.get("vocab", {})), default=1)
        for token in added:
            longest = max(longest, len(self._normalize(token["content"]).encode()))
        return max(longest, 4)  # an unknown character becomes one unk token and spans up to 4 bytes

    @property
    def raw(self) -> HFTokenizer:
        """The `tokenizers` object (for libraries that read the vocabulary, such as the grammar compiler)."""
        return self._tok

    def _normalize(self, text: str) -> str:
        normalizer = self._tok.normalizer
        return normalizer.normalize_str(text) if normalizer is not None else text

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) computed without tokenizing (0 when no bound is known). It lets a text
        far over the context be refused in microseconds instead of seconds of BPE."""
        if self.max_bytes_per_token is None:
            return 0
        normalized = self._normalize(text)
        size = len(normalized) if normalized.isascii() else len(normalized.encode("utf-8", "surrogatepass"))
        return -(-size // self.max_bytes_per_token)

    def set_chat_template(self, source: str) -> None:
        """Use `source` instead of the model's own template (`--chat-template`); compiled now, so errors show now."""
        self._template = compile_chat_template(source)
        self.chat_template = source

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
        # The batch API releases the GIL while it works; `encode` holds it, which stalls every other thread (the
        # server's event loop included) for seconds on a multi-megabyte text. The fast variant skips offsets.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if self.chat_template is None:
            raise RequestError("this model has no chat template (tokenizer_config.json lacks 'chat_template'); "
                               "use /v1/completions", "messages")
        if self._template is None:
            try:
                self._template = compile_chat_template(self.chat_template)
            except ConfigError as exc:
                raise RequestError(f"this model's {exc}", "messages") from exc
        kwargs.setdefault("tools", None)  # as transformers passes it: templates test `tools is not none`
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template is code from the model directory: any error is the
            # request's (a message shape the template does not handle), never the server's
            raise RequestError(f"chat template failed to render: {type(exc).__name__}: {exc}", "messages") from exc
