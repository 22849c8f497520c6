"""A streamed response's host cost a token in muxd's server: OpenAIServing._sse over a stand-in stream of 20,000
one-token outputs (chat and completions, a body without extras), the best of five runs.
Run from the repository root: PYTHONPATH=. python docs/data/streaming-2026-12-02/sse_cost.py"""
import asyncio
import time
import types

from appliance.engine.request import RequestOutput
from appliance.server import protocol as p
from appliance.server.formatting import ChatFormat, CompletionFormat
from appliance.server.serving import OpenAIServing

N = 20000


async def outputs():
    for i in range(N):
        yield 0, RequestOutput("r", [1000 + i % 50], " word", False, None, 10, 0, i + 1)


async def run(body, fmt) -> float:
    me = types.SimpleNamespace(stream_interval=1, force_usage=False)
    start = time.perf_counter()
    async for _ in OpenAIServing._sse(me, outputs(), 1, fmt, body, 10):
        pass
    return (time.perf_counter() - start) / N


chat = p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                               "stream": True})
completion = p.CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True})
tokenizer = types.SimpleNamespace()  # (unused by a body without log-probabilities or token ids)
for name, body, make in (("chat", chat, lambda: ChatFormat("chatcmpl-1", "m", tokenizer, chat, "none")),
                         ("completion", completion,
                          lambda: CompletionFormat("cmpl-1", "m", tokenizer, completion, [[1, 2]]))):
    best = min(asyncio.run(run(body, make())) for _ in range(5))
    print(f"{name}: {best * 1e6:.2f} us a token")
