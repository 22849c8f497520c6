"""Incremental detokenization of one request's output and stop-string matching.

Text is released only when it no longer ends in an incomplete UTF-8 sequence, and while stop strings are set the last
(longest stop - 1) characters are held back so a client never sees the start of a stop string it should not see.
"""
from __future__ import annotations

from appliance.model_zoo.tokenizer import Tokenizer

_CONTEXT = 5  # prompt tokens decoded along with the output so leading spaces/merges come out right


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, token_id: int, visible: bool = True) -> bool:
        """Add one generated token; returns True when the output now contains a stop string (text cut before it)."""
        if not visible:
            return False
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        start = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(start)

    def _check_stop(self, new_from: int) -> bool:
        if not self.stop:
            return False
        begin = max(0, new_from - self.hold)
        hits = [i for i in (self.text.find(s, begin) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True

    def flush(self) -> None:
        """At the end: release bytes still waiting for a continuation (shown as U+FFFD)."""
        if self.read_offset >= len(self.ids):
            return
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        tail = self.tok.decode(self.ids[self.prefix_offset:])[len(prefix):]
        if tail:
            start = len(self.text)
            self.text += tail
            self.read_offset = len(self.ids)
            self._check_stop(start)

    def delta(self, finished: bool) -> str:
        """Text not yet handed out that may be handed out now."""
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out
