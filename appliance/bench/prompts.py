"""Prompts for RequestSpecs: text of an exact token count under the served model's tokenizer, or token ids when
there is no tokenizer (dummy-weight models). Mooncake hash ids map to fixed token blocks, so requests that share a
hash-id prefix share that prompt prefix and the server's prefix cache is exercised as in production.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np

from appliance.errors import ConfigError
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.workload.traces import RequestSpec

log = logging.getLogger("muxd.bench")
_WORD = re.compile(r"^ [a-z]{2,}$")
_MIN_WORDS = 64
_FIRST_ID = 16  # token-id prompts skip the lowest ids, where vocabularies keep their special tokens


class PromptSynth:
    """prompt(spec, index) -> what to send: the recorded text, synthesised text, or token ids.

    Text is built from "word" tokens (a space and letters, each its own token and re-encoding to itself), so the
    concatenation tokenizes to exactly the tokens drawn; the count includes the special tokens the server adds
    (e.g. BOS), so the server sees exactly spec.prompt_len tokens. Drawing is seeded per request (or per hash id) and
    per `salt`: replays of one workload with different salts share no prefix, so a server's prefix cache does not
    carry over from one replay to the next (a capacity sweep salts each point).
    """

    def __init__(self, tokenizer: Tokenizer | None = None, vocab_size: int | None = None, seed: int = 0) -> None:
        if tokenizer is None and not vocab_size:
            raise ConfigError("token-id prompts need the model's vocabulary size; pass --tokenizer or --model with a "
                              "config.json")
        self.seed = seed
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or 0
        self._blocks: dict[tuple[int, int, int], list[int]] = {}
        self._words: list[int] = []
        self._text: dict[int, str] = {}
        self.num_special = 0
        self.inexact = 0  # text prompts whose length could not be made exact (their real length is reported)
        if tokenizer is not None:
            self._words, self._text = _word_tokens(tokenizer)
            if len(self._words) < _MIN_WORDS:
                raise ConfigError(f"the tokenizer has only {len(self._words)} single-token words; cannot synthesise "
                                  "text prompts of exact length (omit --tokenizer to send token ids)")
            probe = "hello world"
            self.num_special = len(tokenizer.encode(probe)) - len(tokenizer.encode(probe, add_special_tokens=False))

    @classmethod
    def from_model_dir(cls, path: str | Path, seed: int = 0) -> "PromptSynth":
        """A model directory: its tokenizer.json if any (text prompts), else config.json's vocab_size (token ids)."""
        path = Path(path)
        if (path / "tokenizer.json").is_file():
            return cls(Tokenizer(path), seed=seed)
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"{path}: neither tokenizer.json nor config.json found; pass a Hugging Face model "
                              "directory as --tokenizer")
        vocab = json.loads(config.read_text()).get("vocab_size")
        if not isinstance(vocab, int) or vocab <= _FIRST_ID:
            raise ConfigError(f"{config}: vocab_size must be an integer > {_FIRST_ID}, got {vocab!r}")
        return cls(None, vocab_size=vocab, seed=seed)

    @property
    def uses_text(self) -> bool:
        return self.tokenizer is not None

    def prompt(self, spec: RequestSpec, index: int, salt: int = 0) -> str | list[int]:
        if spec.prompt is not None:
            return spec.prompt
        body = max(1, spec.prompt_len - self.num_special) if self.uses_text else spec.prompt_len
        ids = self._body(spec, index, body, salt)
        if not self.uses_text:
            return ids
        return self._exact_text(ids, spec.prompt_len)

    def token_ids(self, spec: RequestSpec, index: int, salt: int = 0) -> list[int]:
        """The prompt's tokens as the server will see them (special tokens included)."""
        prompt = self.prompt(spec, index, salt)
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise ConfigError("a recorded text prompt needs --tokenizer to be turned into token ids")
        return self.tokenizer.encode(prompt)

    # ---- internals ------------------------------------------------------------------------------------------------
    def _body(self, spec: RequestSpec, index: int, length: int, salt: int) -> list[int]:
        if not spec.hash_ids:
            return self._draw(np.random.default_rng((self.seed, salt, 1, index)), length)
        ids: list[int] = []
        for h in spec.hash_ids:
            block = self._blocks.get((salt, h, spec.block_size))  # (workloads of other block sizes apart)
            if block is None:
                rng = np.random.default_rng((self.seed, salt, 0, h))
                block = self._blocks[(salt, h, spec.block_size)] = self._draw(rng, spec.block_size)
            ids.extend(block)
            if len(ids) >= length:
                break
        if len(ids) < length:  # a prompt longer than its blocks (clipped specs never are): pad deterministically
            ids.extend(self._draw(np.random.default_rng((self.seed, salt, 1, index)), length - len(ids)))
        return ids[:length]

    def _draw(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.uses_text:
            return [self._words[i] for i in rng.integers(0, len(self._words), size=n)]
        return rng.integers(_FIRST_ID, self.vocab_size, size=n).tolist()

    def _exact_text(self, ids: list[int], target: int) -> str:
        text = "".join(self._text[t] for t in ids)
        n = len(self.tokenizer.encode(text))
        for _ in range(8):  # word tokens nearly always re-encode one to one; trim or pad the tail when they do not
            if n == target:
                return text
            if n > target and len(ids) > 1:
                ids = ids[:-max(1, min(n - target, len(ids) - 1))]
            else:
                ids = ids + ids[: target - n] if n < target else ids
            text = "".join(self._text[t] for t in ids)
            n = len(self.tokenizer.encode(text))
        if n != target:
            self.inexact += 1
        return text


def _word_tokens(tokenizer: Tokenizer) -> tuple[list[int], dict[int, str]]:
    """Token ids whose text is ' ' + lowercase letters and that encode back to themselves alone."""
    words, text = [], {}
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.decode([token_id], skip_special_tokens=True)
        if not _WORD.match(piece):
            continue
        if tokenizer.encode(piece, add_special_tokens=False) == [token_id]:
            words.append(token_id)
            text[token_id] = piece
    return words, text
