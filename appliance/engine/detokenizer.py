"""Incremental detokenization of one request's output and stop-string matching.

Text is released only when it no longer ends in an incomplete UTF-8 sequence, and while stop strings are set the last
(longest stop - 1) characters are held back so a client never sees the start of a stop string it should not see.
A token costs the same at any output length: the text handed out is kept as pieces (joined once, at the end), and stop
strings are looked for in the text not handed out yet, which holds every place a new match can begin.
Each token's text comes from the `tokenizers` library's DecodeStream where it has one (0.21 and later: the same
prefix/read-offset algorithm in Rust; 1.4 against 2.1 us a token here), else from the same algorithm in Python, which
also takes over from a token the stream fails on: both keep the same offsets.
"""
from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None

from appliance.model_zoo.tokenizer import Tokenizer

_CONTEXT = 5  # prompt tokens decoded along with the output so leading spaces/merges come out right


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        """include_stop: a matched stop string stays in the text (cut after it); skip_special_tokens: special
        tokens are left out of the text (as vLLM's defaults)."""
        self.tok = tokenizer
        self.include_stop, self.skip_special = include_stop, skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop = stop
        self.matched: str | None = None  # the stop string that ended the text
        self.hold = max((len(s) for s in stop), default=1) - 1
        self._sent: list[str] = []  # the text handed out, piece by piece
        self._held = ""  # the text not handed out yet
        self._stream = self._start_stream()

    @property
    def text(self) -> str:
        """The whole text so far (cut before a matched stop string)."""
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        return (self._sent[0] if self._sent else "") + self._held

    def _start_stream(self):
        """A DecodeStream that has read the prompt's context tokens (their text dropped), the offsets set where it
        stands; None without one, or where the context ends inside a character (the stream would hold those bytes
        back and hand them out with the first output; the Python path drops them)."""
        if DecodeStream is None:
            return None
        stream = DecodeStream(skip_special_tokens=self.skip_special)
        offsets = (0, 0)
        try:
            for n, token in enumerate(self.ids, 1):
                if stream.step(self.tok.raw, token) is not None:
                    offsets = (offsets[1], n)
        except Exception:  # noqa: BLE001 - the library raises plain Exceptions; the Python path serves instead
            return None
        if offsets[1] != len(self.ids) and self.tok.decode(self.ids[offsets[1]:], self.skip_special):
            return None  # (held back but showing nothing, as a skipped special token, is no loss)
        self.prefix_offset, self.read_offset = offsets
        return stream

    def push(self, token_id: int, visible: bool = True) -> bool:
        """Add one generated token; returns True when the output now contains a stop string (text cut before it)."""
        if not visible:
            return False
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self.tok.raw, token_id)
            except Exception:  # noqa: BLE001 - (e.g. a text that no longer starts with its prefix): Python from here
                self._stream = None
            else:
                return piece is not None and self._release(piece)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        return self._release(full[len(prefix):])

    def _release(self, piece: str) -> bool:
        """Append the text of the tokens read since the last release and move the offsets past them; whether a
        stop string now ends the text."""
        start = len(self._held)
        self._held += piece
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(start)

    def _check_stop(self, new_from: int) -> bool:
        """Whether a stop string ends in the text not handed out yet after its position `new_from` (the first new
        character): a match that takes a new character begins at most `hold` characters before it, which `delta`
        never hands out. The earliest match cuts the text."""
        if not self.stop:
            return False
        begin, held, hit = max(0, new_from - self.hold), self._held, None
        for stop in self.stop:
            at = held.find(stop, begin)
            if at >= 0 and (hit is None or (at, stop) < hit):
                hit = (at, stop)
        if hit is None:
            return False
        at, stop = hit
        self._held = held[:at + len(stop) if self.include_stop else at]
        self.matched = stop
        return True

    def flush(self) -> None:
        """At the end: release bytes still waiting for a continuation (shown as U+FFFD)."""
        if self.read_offset >= len(self.ids):
            return
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        tail = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)[len(prefix):]
        if tail:
            start = len(self._held)
            self._held += tail
            self.read_offset = len(self.ids)
            self._check_stop(start)

    def delta(self, finished: bool) -> str:
        """Text not yet handed out that may be handed out now."""
        held = self._held
        end = len(held) if finished else max(0, len(held) - self.hold)
        if not end:
            return ""
        self._sent.append(held[:end])
        self._held = held[end:]
        return self._sent[-1]
