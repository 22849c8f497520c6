"""Reasoning outputs (`--reasoning-parser`, as vLLM's): what a thinking model writes between <think> and </think> is
returned as the message's `reasoning`, apart from its answer (`content`), in whole bodies and in streams alike.

Where the output starts decides the split: inside a think block for deepseek_r1 (R1 thinks first, whether or not it
writes the opening tag), and for qwen3 when the chat template left a block open in the prompt; an output that opens
with <think> thinks in either case. Thinking ends at </think>; an output cut before it is all reasoning. A grammar
(structured output) holds from </think> on (`waits_for_thinking`; serving.py gives it those tokens to wait for),
unless the prompt closed the think block; a tool call that a grammar forces is not split.
"""
from __future__ import annotations

from typing import Any

from appliance.server.tools import partial_suffix

START, END = "<think>", "</think>"


def opens_thinking(prompt: str, parser: str) -> bool:
    """Whether the output begins inside a think block (see the module's docstring)."""
    if parser == "deepseek_r1":
        return True
    return parser == "qwen3" and prompt.rfind(START) > prompt.rfind(END)


def waits_for_thinking(prompt: str, body: Any) -> bool:
    """Whether a grammar of this chat request (with a reasoning parser) lets the output think first and holds from
    </think> on, as vLLM's structured outputs do: unless the prompt closed the think block itself (Qwen3's
    enable_thinking false) or the grammar forces a tool call."""
    forced = body.tool_choice is not None and body.tool_choice.constrains
    return not forced and not prompt.rstrip().endswith(END)


class ReasoningStream:
    """Splits one choice's text deltas into (reasoning, content) deltas, holding back only what may be a tag still
    arriving; `finish()` releases the rest."""

    def __init__(self, thinking: bool) -> None:
        self.state = "start"  # then "reasoning" or "content"
        self.thinking = thinking
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(START):
                    self.pending, self.state = head[len(START):], "reasoning"
                    continue
                if START.startswith(head):  # empty, or the opening tag may be arriving
                    return reasoning, content
                self.state = "reasoning" if self.thinking else "content"
            elif self.state == "reasoning":
                at = self.pending.find(END)
                if at < 0:
                    keep = len(self.pending) - partial_suffix(self.pending, END)
                    reasoning += self.pending[:keep]
                    self.pending = self.pending[keep:]
                    return reasoning, content
                reasoning += self.pending[:at]
                self.pending, self.state = self.pending[at + len(END):], "content"
            else:
                content, self.pending = content + self.pending, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: a tag that never completed is text of the part it stood in."""
        rest, self.pending = self.pending, ""
        if self.state == "start":
            self.state = "reasoning" if self.thinking else "content"
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    stream = ReasoningStream(thinking)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return reasoning + more_reasoning, content + more_content
