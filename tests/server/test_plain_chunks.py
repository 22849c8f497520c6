"""A stream's plain chunks (new text and nothing else) are written from a head made once per response
(`plain`): byte for byte what the chunk's model serializes to, in every body where the fast path runs, and
never where a chunk carries more (finish, usage, log-probabilities, token ids, tool calls, reasoning, echo)."""
from __future__ import annotations

import asyncio
import re
import types

import pytest

from appliance.engine.request import RequestOutput, TokenLogprob
from appliance.server import protocol as p
from appliance.server.formatting import ChatFormat, CompletionFormat
from appliance.server.serving import OpenAIServing

TEXTS = [" hello", "", 'a "quoted" \\ back', "tab\there\nline", "\x1b[0m\x7f", "é中😀", "\u2028</script>", " end"]


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def outputs(choices: int, logprobs: bool):
    """Each choice's outputs, interleaved: the texts above, then a stop (its last text with it)."""
    for k, text in enumerate(TEXTS):
        last = k == len(TEXTS) - 1
        for c in range(choices):
            lps = [TokenLogprob(100 + k, -0.5, 1, ((100 + k, -0.5), (7, -1.5)))] if logprobs else None
            yield c, RequestOutput(f"r{c}", [100 + k], text, last, "stop" if last else None, 4, 1, k + 1,
                                   text=None, logprobs=lps, stop_reason="\n" if last else None)


def stream(body, fmt, choices: int, logprobs: bool, fast: bool) -> list[str]:
    fmt.created = 1767225600  # (two formats made apart may differ in their second of creation)
    if not fast:
        fmt.plain = lambda *a: None  # every chunk through its model

    async def run():
        async def gen():
            for item in outputs(choices, logprobs):
                yield item
        me = types.SimpleNamespace(stream_interval=1, force_usage=False)
        return [line async for line in OpenAIServing._sse(me, gen(), choices, fmt, body, 4)]
    return [re.sub(r'"call_[0-9a-f]+"', '"call"', line) for line in asyncio.run(run())]  # (a named call's id: random)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_CASES = [
    ({}, "none", True),
    ({"n": 2}, "none", True),
    ({"stream_options": {"include_usage": True}}, "none", True),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "none", False),
    ({"logprobs": True, "top_logprobs": 1}, "none", False),
    ({"return_token_ids": True}, "none", False),
    ({"tools": [TOOL]}, "hermes", False),
    ({"tools": [TOOL]}, "none", True),
    ({"tools": [TOOL], "tool_choice": "required"}, "hermes", False),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "hermes", False),
]


@pytest.mark.parametrize("extra,parser,fast", CHAT_CASES)
def test_chat_plain_chunks_are_the_models_bytes(extra, parser, fast):
    body = p.ChatCompletionRequest.model_validate({**CHAT, **extra})
    n, lps = body.num_generated, bool(body.logprobs)

    def make():
        return ChatFormat("chatcmpl-\"x\"", "model/é", Tokenizer(), body, parser)
    plain_fmt = make()
    used = []
    real = plain_fmt.plain
    plain_fmt.plain = lambda *a: used.append(real(*a)) or used[-1]
    assert stream(body, plain_fmt, n, lps, fast=True) == stream(body, make(), n, lps, fast=False)
    written = [u for u in used if u is not None]
    # the plain ones: every output with text but the last (which finishes), per choice
    assert len(written) == (n * (len(TEXTS) - 2) if fast else 0)


COMPLETION = {"model": "m", "prompt": "hi", "stream": True}
COMPLETION_CASES = [
    ({}, True),
    ({"n": 2}, True),
    ({"echo": True}, True),
    ({"logprobs": 1}, False),
    ({"return_token_ids": True}, False),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, False),
]


@pytest.mark.parametrize("extra,fast", COMPLETION_CASES)
def test_completion_plain_chunks_are_the_models_bytes(extra, fast):
    body = p.CompletionRequest.model_validate({**COMPLETION, **extra})
    n = body.num_generated

    def make():
        return CompletionFormat("cmpl-1", "m", Tokenizer(), body, [[1, 2]])
    plain_fmt = make()
    used = []
    real = plain_fmt.plain
    plain_fmt.plain = lambda *a: used.append(real(*a)) or used[-1]
    lps = body.logprobs is not None
    assert stream(body, plain_fmt, n, lps, fast=True) == stream(body, make(), n, lps, fast=False)
    written = [u for u in used if u is not None]
    echo_first = n if body.echo else 0  # a choice's first chunk carries the echo
    assert len(written) == (n * (len(TEXTS) - 2) - echo_first if fast else 0)
