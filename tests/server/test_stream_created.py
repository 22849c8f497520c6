"""`created` of a completion or chat stream: when the request began, the same on every chunk (as OpenAI and vLLM),
on a clock that moves a second between any two readings."""
from __future__ import annotations

import itertools
import time

import pytest

from appliance.engine.request import RequestOutput
from appliance.server.formatting import ChatFormat, Choice, CompletionFormat, usage_of
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_chunk_of_a_stream_has_the_same_created(monkeypatch, endpoint):
    seconds = itertools.count(1_800_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(seconds)))
    if endpoint == "chat":
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "n": 2})
        fmt = ChatFormat("id", "m", None, body, "hermes", thinking=False)
    else:
        body = CompletionRequest.model_validate({"prompt": "hi", "n": 2})
        fmt = CompletionFormat("id", "m", None, body, [[1, 2]])
    choices = [Choice(0), Choice(1)]
    chunks = fmt.first(2, None) if endpoint == "chat" else []
    for step in range(4):
        for choice in choices:
            last = step == 3
            out = RequestOutput("r", [5], f" w{step}", last, "length" if last else None, 2, 0, step + 1)
            choice.add(out)
            chunks += fmt.chunk(choice, out, None)
    chunks.append(fmt.usage_chunk(usage_of(choices)))
    whole = fmt.final(choices, usage_of(choices))
    assert len(chunks) >= 9 and {c.created for c in chunks} == {whole.created}
