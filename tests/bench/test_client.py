"""The replay loop with a stand-in target (schedule, relative clock, failures kept as results) and what counts as a
token arrival in an SSE chunk."""
from __future__ import annotations

import asyncio

import pytest

from appliance.bench.client import HttpTarget, InProcessTarget, _carries_token, replay
from appliance.errors import ConfigError
from appliance.workload.metrics import RequestTimeline
from appliance.workload.traces import RequestSpec


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
    assert result.notes == ["1 request failed: RuntimeError: connection reset"]  # why, without --save-detailed
    loop = asyncio.new_event_loop()
    try:
        short = loop.run_until_complete(replay([RequestSpec(0.0, 4, 9)], ["x"], StubTarget(), clock=loop.time))
    finally:
        loop.close()
    assert short.short_outputs == 1 and "ignore_eos" in short.notes[0]


class TimedTarget:
    """Answers every request with three tokens 20 ms apart and records when each request was sent."""

    label = "timed"

    def __init__(self) -> None:
        self.sent_at: list[float] = []

    async def send(self, prompt, spec: RequestSpec, timeline: RequestTimeline) -> None:
        loop = asyncio.get_running_loop()
        self.sent_at.append(loop.time())
        for _ in range(3):
            await asyncio.sleep(0.02)
            timeline.token_times.append(loop.time())


def test_max_idle_cuts_only_idle_waits_and_reports_on_the_trace_clock():
    # 0 and 0.01 overlap; 0.3 arrives while nothing is in flight (cut); 0.31 overlaps it; 0.33 arrives while
    # 0.31 is still answering (no cut before it)
    specs = [RequestSpec(a, 4, 3) for a in (0.0, 0.01, 3.0, 3.01, 3.03)]
    target = TimedTarget()
    loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(replay(specs, list("abcde"), target, clock=loop.time, max_idle=0.05))
    finally:
        loop.close()
    sent = [t - target.sent_at[0] for t in target.sent_at]
    assert sent[2] < 1.0  # the 3 s schedule moved earlier: 0.06 s of work, then at most 0.05 s idle
    assert sent[2] >= 0.06 + 0.05 - 0.01  # ... and it waited out the work and the allowed idle time
    assert sent[3] - sent[2] == pytest.approx(0.01, abs=0.015) and sent[4] - sent[2] == pytest.approx(0.03, abs=0.015)
    # on the trace's clock: arrivals as scheduled, latencies as measured, the duration as if the idle time passed
    assert [t.arrival for t in result.timelines] == pytest.approx([0.0, 0.01, 3.0, 3.01, 3.03], abs=1e-9)
    for t in result.timelines:
        assert t.token_times[0] - t.arrival == pytest.approx(0.02, abs=0.015)
    assert result.duration == pytest.approx(max(t.token_times[-1] for t in result.timelines)) and result.duration > 3
    skipped = float(result.notes[-1].split(":")[1].split("s of idle")[0])
    assert "--max-idle 0.05" in result.notes[-1] and skipped == pytest.approx(3.0 - 0.06 - 0.05, abs=0.5)


def test_max_idle_never_cuts_while_a_request_is_in_flight():
    class Slow(TimedTarget):
        async def send(self, prompt, spec, timeline):
            self.sent_at.append(asyncio.get_running_loop().time())
            await asyncio.sleep(0.3 if prompt == "long" else 0.01)
            timeline.token_times.append(asyncio.get_running_loop().time())

    target = Slow()
    loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(replay([RequestSpec(0.0, 4, 1), RequestSpec(0.2, 4, 1)], ["long", "x"],
                                                target, clock=loop.time, max_idle=0.0))
    finally:
        loop.close()
    assert target.sent_at[1] - target.sent_at[0] == pytest.approx(0.2, abs=0.03)
    assert not any("max-idle" in n for n in result.notes)
    with pytest.raises(ConfigError, match="--max-idle"):
        asyncio.run(replay([RequestSpec(0.0, 4, 1)], ["x"], target, max_idle=-1.0))


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


class RecordingEngine:
    """An AsyncEngine stand-in: records each request's sampling and streams one output of every token at once."""

    def __init__(self) -> None:
        self.params = []

    def make_request(self, prompt, params, request_id=None):
        self.params.append(params)
        return params

    async def stream(self, params):
        yield type("Out", (), {"new_token_ids": [7] * params.max_tokens, "num_output_tokens": params.max_tokens,
                               "num_prompt_tokens": 4})()


def test_in_process_requests_sample_as_a_server_would_fill_them_in():
    """A served model's recommended sampling (--generation-config, --override-generation-config) fills in what an
    in-process request leaves unset, as the server does for the HTTP bench's requests; the bench's own temperature
    and sampling flags win."""
    engine = RecordingEngine()
    defaults = {"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05, "top_k": 20, "max_tokens": 99}
    target = InProcessTarget(engine, temperature=0.0, sampling={"top_p": 0.5}, defaults=defaults)
    timeline = RequestTimeline(index=0, arrival=0.0)
    asyncio.run(target.send([1, 2, 3, 4], RequestSpec(0.0, 4, 3), timeline))
    (params,) = engine.params
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.0, 0.5, 20, 1.05)
    assert params.max_tokens == 3 and len(timeline.token_times) == 3  # the workload's output length, not a default
    plain = InProcessTarget(engine)  # no defaults: neutral sampling, as before
    asyncio.run(plain.send([1], RequestSpec(0.0, 1, 1), RequestTimeline(index=1, arrival=0.0)))
    assert engine.params[-1].repetition_penalty == 1.0 and engine.params[-1].top_p == 1.0
