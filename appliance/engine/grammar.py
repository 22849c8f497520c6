"""Structured output: a request's grammar (any JSON, a JSON Schema, a regular expression, a grammar, a structural tag)
follows its output (from the end of a think block, when the request waits for one), and the token masks that keep
sampling inside the grammar.

The masks of a batch's constrained rows are filled on the host by xgrammar's threads right after the forward was
launched (the device is busy meanwhile) and applied on the device in one kernel. Compiled grammars are cached by
xgrammar; the vocabulary description is built once per tokenizer. xgrammar is imported on first use only.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

from appliance.errors import RequestError
from appliance.model_zoo.tokenizer import Tokenizer

UNUSABLE_SCHEMA = "invalid_json_schema"  # the error code of a schema the grammar compiler cannot express
UNUSABLE_GRAMMAR = "invalid_grammar"  # the same for a regular expression or an EBNF grammar


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must be: `json_object` (any JSON object), `json_schema` (`schema`, JSON text), `regex` or
    `ebnf` (`schema`, the expression or grammar), `structural_tag` (`schema`, the tag as JSON text), and the field of
    the request it came from (for error messages)."""

    kind: str
    schema: str = ""
    param: str = "response_format"
    after: tuple[int, ...] = ()  # token ids the output must write before the grammar applies (the end of thinking)


class Matcher:
    """One request's position in its grammar; with `after`, the output is free until it has written those tokens
    (a reasoning model's </think>), and follows the grammar from there."""

    def __init__(self, matcher: Any, after: tuple[int, ...] = ()) -> None:
        self._m = matcher
        self._after = list(after)
        self._recent: list[int] = []  # the output's last tokens while waiting for `after`

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (then nothing changed)."""
        if self._after:
            self._recent = (self._recent + [token])[-len(self._after):]
            if self._recent == self._after:
                self._after = []
            return True
        return bool(self._m.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The output is complete (the grammar accepted a stop token)."""
        return not self._after and bool(self._m.is_terminated())

    @property
    def constraining(self) -> bool:
        """The next token is masked by the grammar (not waiting, not complete)."""
        return not self._after and not self._m.is_terminated()


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer and model vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], threads: int = 4) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.threads = threads
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:  # the server prepares requests on several threads
            if self._compiler is None:
                import xgrammar as xgr  # defers xgrammar (and its start-up cost) to the first constrained request

                raw = self.tokenizer.raw
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(raw.to_str())
                pieces = raw.get_vocab(with_added_tokens=True)
                vocab = [""] * (max(pieces.values(), default=-1) + 1)
                for piece, index in pieces.items():
                    vocab[index] = piece
                info = xgr.TokenizerInfo(vocab, xgr.VocabType(meta["vocab_type"]), vocab_size=self.vocab_size,
                                         stop_token_ids=self.stop_token_ids, add_prefix_space=meta["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
            return self._compiler

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for the spec; RequestError naming the field when the schema cannot be compiled."""
        import xgrammar as xgr  # defers xgrammar to the first constrained request

        compiler = self._get()
        try:
            if spec.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.schema)
            elif spec.kind == "ebnf":
                compiled = compiler.compile_grammar(spec.schema)
            elif spec.kind == "structural_tag":
                compiled = _structural_tag(compiler, xgr, spec.schema)
            else:
                compiled = compiler.compile_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises plain errors for schemas it cannot express
            what = {"regex": "the regular expression", "ebnf": "the choices" if spec.param.endswith("choice")
                    else "the grammar", "structural_tag": "the structural tag"}.get(spec.kind, "the JSON schema")
            code = UNUSABLE_SCHEMA if spec.kind.startswith("json") else UNUSABLE_GRAMMAR
            raise RequestError(f"{spec.param}: {what} cannot be used for constrained decoding: "
                               f"{compiler_message(exc)}", spec.param, code) from None
        return Matcher(xgr.GrammarMatcher(compiled), spec.after)


def _structural_tag(compiler: Any, xgr: Any, text: str) -> Any:
    """A structural tag compiled: xgrammar's form as it is; the older form (structures of begin, JSON schema, end,
    and the triggers that open them) through xgrammar's call for it, as vLLM compiles it."""
    tag = json.loads(text)
    if "structures" not in tag:
        return compiler.compile_structural_tag(text)
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, tag["triggers"])


def compiler_message(exc: Exception) -> str:
    """What the grammar compiler says is wrong, without the time and source location it prefixes its C++ errors
    with ("[06:49:12] /project/cpp/json_schema_converter.cc:4944: Unsupported type ...")."""
    return _SOURCE_PREFIX.sub("", str(exc).strip())[:300]


_SOURCE_PREFIX = re.compile(r"^(\[[\d:.]+\]\s*)?\S+\.(cc|cpp|h):\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
_batch_matcher: Any = None
_apply_backend = "auto"
_bitmasks: dict[tuple, torch.Tensor] = {}  # (device, bitmask words) -> the reused host bitmask
_copies: dict[tuple, Any] = {}  # the same key -> the CUDA event after the buffer's latest copy to the device
log = logging.getLogger("muxd.engine")


def apply_masks(logits: torch.Tensor, matchers: list[Matcher], rows: list[int]) -> None:
    """Keep each constrained row of `logits` [B, V] to the tokens its grammar allows next (in place): the matchers
    fill their rows of a host bitmask reused from step to step (pinned on CUDA), copied to the device once, and
    xgrammar's kernel masks those rows where they are (no gather and scatter of the logits)."""
    import xgrammar as xgr  # defers xgrammar (only constrained requests get here)

    global _batch_matcher, _apply_backend
    key, bitmask = _host_bitmask(logits)
    if len(matchers) == 1:
        matchers[0]._m.fill_next_token_bitmask(bitmask, rows[0])
    else:  # xgrammar's threads fill the rows at once
        if _batch_matcher is None:
            _batch_matcher = xgr.BatchGrammarMatcher()
        _batch_matcher.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, indices=list(rows))
    if logits.device.type == "cuda":
        copied = bitmask.to(logits.device, non_blocking=True)
        done = _copies[key] = torch.cuda.Event()
        done.record()  # the next fill waits for this copy (the buffer is reused)
        bitmask = copied
    indices = None if len(rows) == logits.shape[0] else list(rows)
    try:
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices, backend=_apply_backend)
    except Exception:  # noqa: BLE001 - a kernel xgrammar cannot build here (no compiler, old triton): plain torch
        if _apply_backend == "torch_native":
            raise
        log.warning("xgrammar's %s mask kernel failed on %s; applying masks with torch", _apply_backend,
                    logits.device)
        _apply_backend = "torch_native"
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices, backend=_apply_backend)


def _host_bitmask(logits: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """The key and host bitmask for a batch of `logits` (only the rows the matchers fill are read): one buffer per
    (device, vocabulary), grown to the largest batch seen, pinned for CUDA and reused once its last copy is done."""
    rows, words = logits.shape[0], (logits.shape[-1] + 31) // 32
    key = (logits.device, words)
    buf = _bitmasks.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=logits.device.type == "cuda")
        _bitmasks[key] = buf
    elif key in _copies:
        _copies.pop(key).synchronize()
    return key, buf[:rows]


def schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as a JSON object, as text; RequestError naming `param` otherwise."""
    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    return json.dumps(schema)
