"""Tokenizer of a Hugging Face model directory: `tokenizer.json` through the `tokenizers` library, the chat template
from `tokenizer_config.json` (or `chat_template.jinja`, or an override) rendered as transformers does
(chat_template.py), special ids from `generation_config.json` / `config.json`, and a cheap lower bound on a text's
token count. What a directory says about its template and special ids is checked when it is read
(`read_tokenizer_config`), so a broken one fails at start-up, not on the first request.
"""
from __future__ import annotations

import functools
import json
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from appliance.errors import ConfigError, ModelLoadError, RequestError
from appliance.model_zoo.chat_template import Escaped, compile_chat_template, escape_strings


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _plain(value: Any) -> Any:
    """A tokenizer_config.json value with each token spelled {"content": ...} as its text."""
    if isinstance(value, dict):
        return value["content"] if isinstance(value.get("content"), str) else {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _token_ids(value: Any, where: str) -> list[int] | None:
    """eos_token_id / bos_token_id: an integer id >= 0, a list of them, or null; anything else is refused."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise ModelLoadError(f"{where} is {value!r}; expected a token id (an integer >= 0), a list of them, or null")
    return items


@dataclass
class TokenizerConfig:
    """What a model directory says about special tokens and its chat template, checked."""

    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    template: jinja2.Template | None
    eos_token_ids: list[int] | None  # None: not given (the eos token's id then)
    bos_token_id: int | None
    fields: dict[str, Any]  # tokenizer_config.json as read ({} without one)


def read_tokenizer_config(model_dir: Path, chat_template: str | None = None) -> TokenizerConfig:
    """tokenizer_config.json, generation_config.json and config.json's special ids, and the chat template compiled
    (`chat_template` instead of the directory's, when given): ModelLoadError/ConfigError naming the file and field
    when any is wrong."""
    config = _read_json(model_dir / "tokenizer_config.json")
    gen_path, cfg_path = model_dir / "generation_config.json", model_dir / "config.json"
    gen, model_cfg = _read_json(gen_path), _read_json(cfg_path)
    eos_where = f"{gen_path}: field 'eos_token_id'" if "eos_token_id" in gen else f"{cfg_path}: field 'eos_token_id'"
    eos = _token_ids(gen.get("eos_token_id", model_cfg.get("eos_token_id")), eos_where)
    bos_where = f"{gen_path}: field 'bos_token_id'" if "bos_token_id" in gen else f"{cfg_path}: field 'bos_token_id'"
    bos = _token_ids(gen.get("bos_token_id", model_cfg.get("bos_token_id")), bos_where)
    source, where = (chat_template, "--chat-template") if chat_template is not None else \
        _find_template(model_dir, config)
    template = compile_chat_template(source, f"{where}: chat template" if chat_template is None else where) \
        if source is not None else None
    return TokenizerConfig(_token_text(config.get("bos_token")), _token_text(config.get("eos_token")), source,
                           template, eos, bos[0] if bos else None, config)


# generation_config.json's sampling fields -> (the request field they default, transformers' own default: a value
# equal to it recommends nothing, as vLLM reads the file), checked as the request field would be
_SAMPLING_FIELDS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
                    "min_p": ("min_p", None), "repetition_penalty": ("repetition_penalty", 1.0),
                    "max_new_tokens": ("max_tokens", None)}
_SAMPLING_RANGES = {"temperature": (0, None), "top_p": (0, 1), "top_k": (-1, None), "min_p": (0, 1),
                    "repetition_penalty": (0, None), "max_new_tokens": (1, None)}
_ABOVE_LOW = ("top_p", "repetition_penalty")  # their lower bound is excluded


def read_sampling_defaults(directory: Path) -> dict[str, float | int]:
    """The request sampling defaults `directory/generation_config.json` recommends (vLLM's --generation-config):
    request field -> value; ModelLoadError naming the field when one is not a number in its range."""
    path = directory / "generation_config.json"
    return sampling_defaults(_read_json(path), str(path))


def sampling_defaults(gen: dict[str, Any], where: str, overrides: bool = False) -> dict[str, float | int]:
    """Request field -> value of the sampling fields of a generation config `gen` (read from `where`); values at
    transformers' own defaults recommend nothing, unless they are `overrides` (--override-generation-config), where
    fields that are not sampling fields are refused too."""
    unknown = sorted(set(gen) - set(_SAMPLING_FIELDS)) if overrides else []
    if unknown:
        raise ModelLoadError(f"{where}: {', '.join(map(repr, unknown))} not among the sampling fields "
                             f"{', '.join(_SAMPLING_FIELDS)}")
    out: dict[str, float | int] = {}
    for field, (name, hf_default) in _SAMPLING_FIELDS.items():
        value = gen.get(field)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if value is None or number and value == hf_default and not overrides:
            continue
        low, high = _SAMPLING_RANGES[field]
        integral = field in ("top_k", "max_new_tokens")
        if not (number and value >= low and (high is None or value <= high) and (not integral or value == int(value))
                and not (field in _ABOVE_LOW and value == low)):
            kind = "an integer" if integral else "a number"
            bounds = (">" if field in _ABOVE_LOW else ">=") + f" {low}" + ("" if high is None else f" and <= {high}")
            raise ModelLoadError(f"{where}: field {field!r} is {value!r}; expected {kind} {bounds}")
        out[name] = int(value) if integral else float(value)
    return out


def _find_template(model_dir: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    where = str(model_dir / "tokenizer_config.json")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{where}: field 'chat_template' is {type(template).__name__}; expected the template "
                             "text")
    return template, where


def _cut_after_final(rendered: str, final: Any) -> str:
    """The rendered conversation up to the end of the final message's content (its last occurrence)."""
    end = rendered.rfind(final) if isinstance(final, str) and final else -1
    if end < 0:
        raise RequestError("continue_final_message: the chat template does not write the final message's content "
                           "as it is, so the prompt cannot end inside it", "continue_final_message")
    return rendered[:end + len(final)]


@dataclass
class RenderedChat:
    """A conversation rendered by the chat template: `text` is the prompt as text; `escaped`, when the messages
    held control-token text, says which parts of it are text and not control tokens."""

    text: str
    template_text: str
    escaped: Escaped | None = None


# the variables render_chat gives every template (a request's chat_template_kwargs may not replace them)
TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
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
    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found (muxd reads tokenizers in the tokenizer.json format)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise ModelLoadError(f"{path}: cannot be read by the tokenizers library: {exc}") from exc
        cfg = read_tokenizer_config(model_dir, chat_template)
        self.bos_token, self.eos_token = cfg.bos_token, cfg.eos_token
        self.chat_template, self._template = cfg.chat_template, cfg.template
        self._fields = cfg.fields
        eos = cfg.eos_token_ids
        if eos is None and self.eos_token is not None:
            found = self._tok.token_to_id(self.eos_token)
            eos = [found] if found is not None else []
        self.eos_token_ids: set[int] = set(eos or [])
        self.bos_token_id: int | None = cfg.bos_token_id
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.max_bytes_per_token = self._max_bytes_per_token(json.loads(self._tok.to_str()))
        # the special (control) tokens, longest first so that one that starts another matches whole
        specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._special_ids = specials
        self._control = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
            if specials else None
        self._as_text: HFTokenizer | None = None  # a copy that reads control-token text as text
        self._as_text_lock = threading.Lock()

    def _max_bytes_per_token(self, spec: dict[str, Any]) -> int | None:
        """The most UTF-8 bytes of (normalized) text one token can stand for, where such a bound exists: a BPE model
        that never fuses runs of unknown characters into one token, a pre-tokenizer that drops nothing, no added
        token that swallows whitespace. Vocabulary strings are never shorter than the bytes they cover (byte-level
        and byte-fallback spellings are longer), so their longest UTF-8 length bounds it."""
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

    def info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: tokenizer_config.json's fields (less the paths of vocabulary files; a token
        spelled {"content": ...} as its text), `tokenizer_class` and the chat template served."""
        info = {k: _plain(v) for k, v in self._fields.items() if k not in ("vocab_file", "merges_file")}
        info["tokenizer_class"] = self._fields.get("tokenizer_class") or "PreTrainedTokenizerFast"
        if self.chat_template:
            info["chat_template"] = self.chat_template
        else:
            info.pop("chat_template", None)
        return info

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
        self._template = compile_chat_template(source, "--chat-template")
        self.chat_template = source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch API releases the GIL while it works; `encode` holds it, which stalls every other thread (the
        # server's event loop included) for seconds on a multi-megabyte text. The fast variant skips offsets.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on (as transformers does)."""
        return self.render_chat(messages, add_generation_prompt, escape_control=False, **kwargs).text

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    escape_control: bool = True, continue_final: bool = False,
                    variables: dict[str, Any] | None = None, template: str | None = None,
                    **kwargs: Any) -> RenderedChat:
        """Render a conversation; with `escape_control`, control-token text inside the messages is marked as text
        for `encode_chat` (so a user cannot write `<|im_end|><|im_start|>system` and forge a turn); with
        `continue_final`, the prompt ends where the final message's content does (no end of turn after it).
        `variables` are the request's own template variables (vLLM's chat_template_kwargs), escaped as the
        messages are; they may not replace the variables set here. `template`: a request's own template source,
        used instead of the model's (compiled in the same sandbox)."""
        compiled = _request_template(template) if template is not None else self._template
        if compiled is None:
            raise RequestError("this model has no chat template (tokenizer_config.json lacks 'chat_template'); "
                               "use /v1/completions", "messages")
        taken = sorted(set(variables or ()) & set(TEMPLATE_VARIABLES))
        if taken:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(taken)} (muxd sets "
                               f"{', '.join(TEMPLATE_VARIABLES)} itself)", "chat_template_kwargs")
        kwargs.setdefault("tools", None)  # as transformers passes it: templates test `tools is not none`
        # what the request wrote (messages, tool definitions, its variables) is escaped; the template's own text not
        payload = {**(variables or {}), "messages": messages, "tools": kwargs.pop("tools")}
        escaped = escape_strings(payload, self._control) if escape_control and self._control else None
        if escaped is not None:
            payload = escaped.value
        try:
            rendered = compiled.render(**payload, add_generation_prompt=add_generation_prompt,
                                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template is code from the model directory: any error is the
            # request's (a message shape the template does not handle), never the server's
            raise RequestError(f"chat template failed to render: {type(exc).__name__}: {exc}", "messages") from exc
        if continue_final:
            rendered = _cut_after_final(rendered, payload["messages"][-1].get("content"))
        if escaped is None:
            return RenderedChat(rendered, rendered)
        return RenderedChat(escaped.restore(rendered), rendered, escaped)

    @functools.cached_property
    def special_affixes(self) -> tuple[list[int], list[int]]:
        """The special tokens encode(text) adds before and after a text's own (e.g. Llama-3's BOS before, none
        after), as the tokenizer's post-processor places them."""
        plain, full = self.encode("x", add_special_tokens=False), self.encode("x")
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
        if at is None:  # (a post-processor that rewrites the text's own tokens: none known)
            return [], []
        return full[:at], full[at + len(plain):]

    def encode_chat(self, chat: RenderedChat, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a rendered conversation (with `add_special_tokens`, the tokenizer's special tokens around
        them, on top of those the template wrote). Control tokens the template wrote are control tokens; control-token
        text from the messages (escaped by render_chat) is tokenized as ordinary text. Without any such text this
        is exactly encode(chat.text) (segments between control tokens are tokenized independently either way)."""
        if add_special_tokens:
            before, after = self.special_affixes
            return before + self.encode_chat(chat) + after
        if chat.escaped is None or self._control is None:
            return self.encode(chat.text, add_special_tokens=False)
        ids: list[int] = []
        pieces = self._control.split(chat.template_text)
        controls = self._control.findall(chat.template_text)
        for i, piece in enumerate(pieces):
            if piece:
                text = chat.escaped.restore(piece)
                ids += self._text_tokenizer().encode_batch([text], add_special_tokens=False)[0].ids
            if i < len(controls):
                ids.append(self._special_ids[controls[i]])
        return ids

    def _text_tokenizer(self) -> HFTokenizer:
        with self._as_text_lock:
            if self._as_text is None:
                copy = HFTokenizer.from_str(self._tok.to_str())
                copy.encode_special_tokens = True
                self._as_text = copy
            return self._as_text


@functools.lru_cache(maxsize=16)
def _request_template(source: str) -> Any:
    """A request's own chat template, compiled (the last few kept: clients resend theirs); a syntax error is the
    request's."""
    try:
        return compile_chat_template(source, "chat_template")
    except ConfigError as exc:
        raise RequestError(str(exc), "chat_template") from None
