"""The replay loop with a stand-in target (schedule, relative clock, failures kept as results) and what counts as a
token arrival in an SSE chunk."""
from __future__ import annotations

import asyncio

import pytest

from appliance.bench.client import HttpTarget, _carries_token, replay
from appliance.bench.metrics import RequestTimeline
from appliance.bench.traces import RequestSpec
from appliance.errors import ConfigError


class StubTarget:
    label = "stub"

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def send(self, prompt, spec: RequestSpec, timeline: RequestTimeline) -> None:
        self.sent.append(prompt)
        if prompt == "boom":
            raise RuntimeError("connection reset")
        loop = asyncio.get_running_loop()
        for _ in range(min(spec.output_len, 3)):  # a server that stops after three tokens
            await asyncio.sleep(0.001)
            timeline.token_times.append(loop.time())


def test_replay_keeps_order_clock_and_failures():
    specs = [RequestSpec(0.0, 4, 2), RequestSpec(0.02, 4, 5), RequestSpec(0.04, 4, 1)]
    target = StubTarget()
    loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(replay(specs, ["a", "boom", "c"], target, clock=loop.time))
    finally:
        loop.close()
    assert target.sent == ["a", "boom", "c"]
    a, boom, c = result.timelines
    assert [t.arrival for t in result.timelines] == pytest.approx([0.0, 0.02, 0.04])  # the replay clock: 0 = first
    assert a.sent >= a.arrival and a.token_times[0] > a.arrival and len(a.token_times) == 2
    assert boom.error == "RuntimeError: connection reset" and not boom.success
    assert c.success and result.duration == pytest.approx(c.token_times[-1])
    assert result.short_outputs == 0
    loop = asyncio.new_event_loop()
    try:
        short = loop.run_until_complete(replay([RequestSpec(0.0, 4, 9)], ["x"], StubTarget(), clock=loop.time))
    finally:
        loop.close()
    assert short.short_outputs == 1 and "ignore_eos" in short.notes[0]


@pytest.mark.parametrize("chunk, endpoint, counts", [
    ({"choices": [{"text": " tok", "finish_reason": None}]}, "completions", True),
    ({"choices": [{"text": "", "finish_reason": None}]}, "completions", True),     # text held back, token came
    ({"choices": [], "usage": {"completion_tokens": 3}}, "completions", False),
    ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, "chat", False),  # sent before any token
    ({"choices": [{"delta": {"content": "x"}}]}, "chat", True),
    ({"choices": [{"delta": {"reasoning_content": "hm"}}]}, "chat", True),
    ({"choices": [{"delta": {}, "finish_reason": "length"}]}, "chat", True),
])
def test_what_counts_as_a_token_arrival(chunk, endpoint, counts):
    assert _carries_token(chunk, endpoint) is counts


def test_request_bodies():
    target = HttpTarget("http://127.0.0.1:9/", "m", "chat", extra_body={"top_k": 5})
    body = target.body("hello", 7)
    assert body["messages"] == [{"role": "user", "content": "hello"}] and body["max_completion_tokens"] == 7
    assert body["ignore_eos"] and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["top_k"] == 5 and target.url == "http://127.0.0.1:9/v1/chat/completions"
    with pytest.raises(ConfigError, match="--endpoint chat needs text prompts"):
        target.body([1, 2, 3], 7)
    plain = HttpTarget("http://h:1", "m").body([1, 2, 3], 4)
    assert plain["prompt"] == [1, 2, 3] and plain["max_tokens"] == 4 and plain["temperature"] == 0.0
    asyncio.run(target.aclose())
