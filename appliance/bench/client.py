"""The replay client: sends each request at its scheduled arrival and times every token, against an
OpenAI-compatible server (async httpx, SSE streaming, /v1/completions or /v1/chat/completions) or an engine in this
process. Latencies count from the scheduled arrival, so a client that falls behind shows up as lag, not as speed.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Protocol, Sequence

import httpx

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import SamplingParams
from appliance.errors import ApplianceError, ConfigError
from appliance.workload.metrics import RequestTimeline
from appliance.workload.traces import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BACKENDS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}  # vLLM's --backend: the endpoint
LEAD_S = 0.05  # the replay clock starts this long after set-up, so the first sends are not late by construction


class Target(Protocol):
    """Where requests go. `send` fills the timeline's token_times (clock readings), output and prompt token counts;
    it raises or sets timeline.error on failure."""

    label: str

    async def send(self, prompt: str | list[int], spec: RequestSpec, timeline: RequestTimeline) -> None:
        ...


@dataclass
class ReplayResult:
    """Timelines on the replay clock (0 = scheduled arrival of the first request), the wall-clock start, duration
    (first scheduled arrival -> last token) and requests whose output came back shorter than asked."""

    label: str
    timelines: list[RequestTimeline]
    duration: float
    started_at: str
    short_outputs: int = 0
    notes: list[str] = field(default_factory=list)


# ---- HTTP target --------------------------------------------------------------------------------------------------
class HttpTarget:
    """Any OpenAI-compatible server; streams with usage so output tokens are counted by the server."""

    def __init__(self, base_url: str, model: str, endpoint: str = "completions", temperature: float = 0.0,
                 extra_body: dict[str, Any] | None = None, label: str | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if endpoint not in ENDPOINTS:
            raise ConfigError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + ENDPOINTS[endpoint]
        self.model, self.endpoint, self.temperature = model, endpoint, temperature
        self.extra_body = dict(extra_body or {})
        self.label = label or self.base_url
        self.clock = clock
        # no pool limit: an open-loop replay must not queue requests inside the client
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None, pool=None),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    def body(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                                "ignore_eos": True, "temperature": self.temperature}
        if self.endpoint == "chat":
            if not isinstance(prompt, str):
                raise ConfigError("--endpoint chat needs text prompts; pass --tokenizer (token-id prompts only go "
                                  "to /v1/completions)")
            body.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=max_tokens)
        else:
            body.update(prompt=prompt, max_tokens=max_tokens)
        body.update(self.extra_body)
        return body

    async def send(self, prompt: str | list[int], spec: RequestSpec, timeline: RequestTimeline) -> None:
        done = False
        async with self.client.stream("POST", self.url, json=self.body(prompt, spec.output_len)) as resp:
            if resp.status_code != 200:
                timeline.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                return
            async with contextlib.aclosing(resp.aiter_lines()) as lines:
                async for line in lines:
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = self.clock()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        timeline.error = f"stream error: {_error_message(data.encode())}"
                        return
                    if _carries_token(chunk, self.endpoint):
                        timeline.token_times.append(now)
                    usage = chunk.get("usage")
                    if usage:
                        timeline.output_tokens = usage.get("completion_tokens", timeline.output_tokens)
                        timeline.prompt_tokens = usage.get("prompt_tokens", timeline.prompt_tokens)
        if not done:
            timeline.error = "the stream ended before data: [DONE]"

    async def aclose(self) -> None:
        await self.client.aclose()


def _carries_token(chunk: dict[str, Any], endpoint: str) -> bool:
    """Every chunk with a choice marks a token arrival (vLLM's client counts the same way, so a token whose text is
    still held back arrives with the next chunk), except a chat chunk that only announces the assistant role: servers
    may send it before any token exists."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    if endpoint == "chat" and c.get("finish_reason") is None:
        delta = c.get("delta") or {}
        if "role" in delta and not (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")):
            return False
    return True


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:500]
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")[:500]


async def probe_server(base_url: str, model: str | None = None, timeout: float = 10.0,
                       prefer: str | None = None) -> tuple[str, int | None]:
    """(served model name, its max_model_len if the server says) from GET /v1/models: `model` where given, else
    `prefer` where the server lists it (vLLM's bench sends its --model), else the first listed."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            resp = await client.get(url)
    except httpx.HTTPError as exc:
        raise ApplianceError(f"cannot reach {url}: {exc!r}; is the server up?") from exc
    if resp.status_code != 200:
        raise ApplianceError(f"GET {url} answered HTTP {resp.status_code}: {_error_message(resp.content)}")
    cards = resp.json().get("data") or []
    if model is None:
        if not cards:
            raise ApplianceError(f"GET {url} lists no model; pass --served-model-name")
        card = next((c for c in cards if prefer is not None and c.get("id") == prefer), cards[0])
    else:
        card = next((c for c in cards if c.get("id") == model), {"id": model})
    max_len = card.get("max_model_len")
    return card["id"], max_len if isinstance(max_len, int) else None


# ---- in-process target --------------------------------------------------------------------------------------------
class InProcessTarget:
    """An AsyncEngine in this process (no HTTP): every engine output is one token arrival. A request of the workload
    is named `trace-<index>` in the engine (so a step log's request ids name the workload's requests)."""

    def __init__(self, engine: Any, temperature: float = 0.0, label: str = "in-process",
                 clock: Callable[[], float] = time.perf_counter, sampling: dict[str, Any] | None = None,
                 defaults: dict[str, float | int] | None = None) -> None:
        self.engine, self.temperature, self.label, self.clock = engine, temperature, label, clock
        # top_p, top_k, min_p where given, else what a server's --generation-config would fill in for a request
        # that leaves them unset (as the HTTP targets' requests do; temperature is always sent)
        unset = {k: v for k, v in (defaults or {}).items() if k in ("top_p", "top_k", "min_p", "repetition_penalty")}
        self.sampling = {**unset, **(sampling or {})}

    async def send(self, prompt: str | list[int], spec: RequestSpec, timeline: RequestTimeline) -> None:

        params = SamplingParams(max_tokens=spec.output_len, temperature=self.temperature, ignore_eos=True,
                                **self.sampling)
        request = self.engine.make_request(prompt, params, f"trace-{timeline.index}" if timeline.index >= 0 else None)
        async for out in self.engine.stream(request):
            now = self.clock()
            timeline.token_times.extend([now] * len(out.new_token_ids))
            timeline.output_tokens = out.num_output_tokens
            timeline.prompt_tokens = out.num_prompt_tokens


# ---- the replay loop ----------------------------------------------------------------------------------------------
async def replay(specs: Sequence[RequestSpec], prompts: Sequence[str | list[int]], target: Target,
                 max_concurrency: int | None = None, request_timeout: float | None = None,
                 on_done: Callable[[RequestTimeline], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, max_idle: float | None = None) -> ReplayResult:
    """Send specs[i] with prompts[i] at its arrival (open loop), wait for every request, return the timelines.

    With max_concurrency, a request waits for a free slot and its latencies count from when it is sent (the trace's
    arrival times no longer hold there); otherwise they count from the scheduled arrival.

    With max_idle, a wait for the next arrival while no request is in flight lasts at most max_idle seconds: the
    schedule moves earlier by the rest. No request spans such a cut, so every latency is what it would have been;
    the timelines come back on the trace's clock, as if the idle time had passed.
    """
    if len(specs) != len(prompts):
        raise ValueError("one prompt per spec")
    if max_idle is not None and max_idle < 0:
        raise ConfigError(f"--max-idle must be >= 0 seconds, got {max_idle:g}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    started_at = datetime.now().astimezone().isoformat(timespec="seconds")
    t0 = clock() + LEAD_S
    cut = 0.0                # seconds of idle schedule skipped so far
    cuts: list[float] = []   # per request: `cut` when it was sent
    in_flight = 0
    idle = asyncio.Event()
    idle.set()

    async def one(i: int, spec: RequestSpec) -> RequestTimeline:
        nonlocal in_flight
        timeline = RequestTimeline(arrival=t0 + spec.arrival - cuts[i], prompt_tokens=spec.prompt_len, index=i)
        if slots is not None:
            await slots.acquire()
        try:
            timeline.sent = clock()
            if slots is not None:
                timeline.arrival = timeline.sent
            await asyncio.wait_for(target.send(prompts[i], spec, timeline), request_timeout)
        except asyncio.TimeoutError:
            timeline.error = f"no complete answer within --request-timeout {request_timeout:g} s"
        except Exception as exc:  # noqa: BLE001 - one failed request is a result, not the end of the replay
            timeline.error = f"{type(exc).__name__}: {exc}"
        finally:
            if slots is not None:
                slots.release()
            in_flight -= 1
            if not in_flight:
                idle.set()
        if timeline.error is None and not timeline.token_times:
            timeline.error = "no token arrived"
        if on_done is not None:
            on_done(timeline)
        return timeline

    async def wait_until(due: float, may_cut: bool) -> None:
        nonlocal cut
        while (delay := due - cut - clock()) > 0:
            if max_idle is None or not may_cut:
                await asyncio.sleep(delay)
            elif idle.is_set():
                if delay > max_idle:
                    cut += delay - max_idle
                await asyncio.sleep(min(delay, max_idle))
            else:  # requests in flight: wait for the arrival, or for the last of them to finish
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(idle.wait(), delay)
                continue
            return

    tasks = []
    wall0 = clock()
    for i, spec in enumerate(specs):
        await wait_until(t0 + spec.arrival, may_cut=i > 0)  # the lead before the first is not the trace's
        cuts.append(cut)
        in_flight += 1
        idle.clear()
        tasks.append(asyncio.create_task(one(i, spec)))
    timelines = list(await asyncio.gather(*tasks))
    wall = clock() - wall0
    short = sum(1 for t, s in zip(timelines, specs) if t.success and t.num_output_tokens < s.output_len)
    for t, c in zip(timelines, cuts):  # the replay clock: 0 = scheduled arrival of the first request
        t.arrival += c - t0
        t.sent = t.sent + c - t0 if t.sent is not None else None
        t.token_times = [x + c - t0 for x in t.token_times]
    end = max((t.token_times[-1] for t in timelines if t.token_times), default=0.0)
    notes = [note] if (note := _failures_note(timelines)) else []
    if short:
        notes.append(f"{short} requests got fewer output tokens than asked: the server may not honour ignore_eos")
    if cut > 0:
        notes.append(f"--max-idle {max_idle:g}: {cut:.0f} s of idle time (no request in flight) were skipped; the "
                     f"replay took {wall:.0f} s of wall time; no request spanned a skip, and times are on the "
                     "trace's clock")
    return ReplayResult(getattr(target, "label", "target"), timelines, max(0.0, end), started_at, short, notes)


def _failures_note(timelines: Sequence[RequestTimeline], most: int = 3) -> str | None:
    """How many requests failed and why (the commonest errors first), so a failed count explains itself."""
    errors = Counter(t.error or "no token arrived" for t in timelines if not t.success)
    if not errors:
        return None
    n = sum(errors.values())
    if len(errors) == 1:
        return f"{n} request{'s' if n > 1 else ''} failed: {next(iter(errors))}"
    shown = errors.most_common(most)
    rest = n - sum(k for _, k in shown)
    return (f"{n} requests failed: " + "; ".join(f"{k} x {error}" for error, k in shown)
            + (f"; {rest} more with other errors" if rest else ""))


def client_lag_note(summary: dict[str, Any], threshold_ms: float = 10.0) -> str | None:
    """A warning when the client sent requests late (latencies include the lag, so results stay honest)."""
    lag = summary.get("max_client_lag_ms", 0.0)
    if lag is None or math.isnan(lag) or lag <= threshold_ms:
        return None
    return (f"the client fell behind the schedule (client lag mean {summary['mean_client_lag_ms']:.1f} ms, "
            f"max {lag:.1f} ms); latencies include it")


def replay_in_process(engine: Any, specs: Sequence[RequestSpec], prompts: Sequence[str | list[int]],
                      max_idle: float | None = None, defaults: dict[str, float | int] | None = None) -> ReplayResult:
    """Replay on an Engine in this process: an AsyncEngine runs it for the replay's length, then stops. `defaults`:
    the sampling a served model's generation config recommends (`ModelConfig.sampling_defaults`)."""

    async def go() -> ReplayResult:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            return await replay(specs, prompts, InProcessTarget(aengine, defaults=defaults), max_idle=max_idle)
        finally:
            aengine.shutdown()

    return asyncio.run(go())
