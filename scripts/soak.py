"""Soak test of a real `muxd serve` process: mixed traffic for a fixed time (streams, streams cancelled at random
points, whole responses, chat, requests with the features that keep state per request (several choices,
log-probabilities, stop strings, penalties, grammars, tool calls, the Responses API), malformed requests, bursts over
capacity) while a probe request measures latency once a second; then resident memory, open file descriptors and free
KV pages are compared with their values before the traffic, and the probe's p99 latency per window shows whether it
drifted. Every loop is bounded in count and time and sends traffic only to the server it started on 127.0.0.1.

    python scripts/soak.py --minutes 30 --out docs/soak-results.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import ServerProcess  # noqa: E402

# 4 seats, 8 queue places, 16 KV pages of 16 tokens: bursts meet 429, long requests meet preemption
SOAK_FLAGS = ["--max-num-seqs", "4", "--max-waiting", "8", "--kv-cache-memory", "512KiB", "--max-model-len", "256",
              "--body-timeout", "5", "--header-timeout", "5"]
PROBE = {"prompt": "def probe(x):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
MALFORMED: list[tuple[str, bytes]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "5"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "colour": "red"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": ["s"] * 100}).encode()),
    ("/v1/completions", json.dumps({"prompt": [10**9]}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode()),
]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def snapshot(server: ServerProcess, settle: bool = False) -> dict[str, float]:
    """Memory, descriptors (counted before this snapshot's own /metrics connection; with `settle`, the fewest seen
    over a second, as the server closes its side of connections just closed by clients), the KV pool, and (with
    `settle`) the events the executor's timeline holds: it keeps the latest 20,000, so resident memory grows while it
    fills."""
    fds = open_fds(server.proc.pid)
    for _ in range(10 if settle else 0):
        time.sleep(0.1)
        fds = min(fds, open_fds(server.proc.pid))
    m = server.metrics()
    return {"rss_mib": round(server.rss_bytes() / 2**20, 1), "open_fds": fds,
            "kv_free_pages": m["muxd:kv_cache_free_pages"], "running": m["muxd:num_requests_running"],
            "waiting": m["muxd:num_requests_waiting"],
            "load_avg_1m": float(Path("/proc/loadavg").read_text().split()[0]),
            **({"timeline_events": len(httpx.get(server.url + "/debug/timeline", timeout=60).json()["traceEvents"])}
               if settle else {})}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, cancel_after: int | None) -> int:
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code
        events = 0
        async for line in response.aiter_lines():
            events += line.startswith("data: ")
            if cancel_after is not None and events >= cancel_after:
                break  # the client leaves mid-stream
        return 200


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}, "depth": {"type": "integer"}}, "required": ["name"]}}}


def _featured(rng: random.Random, text: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    """A request with a random pick of the features that keep state per request on the host (several choices,
    log-probabilities, stop strings, penalties and bad words, grammars, tool calls, prompt log-probabilities (not
    streamed, as vLLM refuses them streamed), echo, the Responses API): (path, body)."""
    extra: dict[str, Any] = {}
    if rng.random() < 0.3:
        extra["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        extra.update(stop=rng.choice([["\n"], ["def", ":"], ["x"]]))
    if rng.random() < 0.3:
        extra.update(rng.choice([{"presence_penalty": 1.0}, {"repetition_penalty": 1.2},
                                 {"bad_words": ["return"]}, {"min_tokens": 4}, {"seed": rng.randrange(100)}]))
    route = rng.choice(["chat", "chat", "completion", "responses"])
    if route == "responses":
        return "/v1/responses", {"input": text, "max_output_tokens": max_tokens,
                                 **({"tools": [{"type": "function", **TOOL["function"]}]} if rng.random() < 0.5
                                    else {})}
    if route == "completion":
        extra.update(rng.choice([{"logprobs": rng.randint(0, 3)}, {"echo": True},
                                 {} if stream else {"prompt_logprobs": 1},
                                 {"structured_outputs": {"regex": "[a-z]{2,12}"}}, {}]))
        return "/v1/completions", {"prompt": text, "max_tokens": max_tokens, **extra}
    extra.update(rng.choice([
        {"logprobs": True, "top_logprobs": rng.randint(0, 5)},
        {"tools": [TOOL], "tool_choice": rng.choice(["auto", "required",
                                                      {"type": "function", "function": {"name": "lookup"}}])},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TOOL["function"][
            "parameters"]}}},
        {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, {}]))
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                                    **extra}


async def _one(client: httpx.AsyncClient, base: str, rng: random.Random) -> tuple[str, int]:
    """One request of a random kind; returns (kind, status)."""
    kind = rng.choice(["stream", "stream", "cancel", "whole", "chat", "malformed", "featured", "featured"])
    text = f"def function_{rng.randrange(10**6)}(x):"
    body = {"prompt": text, "max_tokens": rng.randint(8, 48), "ignore_eos": True, "temperature": rng.random()}
    if kind == "featured":  # whole, streamed, or left mid-stream
        how = rng.choice(["whole", "stream", "cancel"])
        path, featured = _featured(rng, text, body["max_tokens"], how != "whole")
        if how == "whole":
            return kind, (await client.post(base + path, json=featured)).status_code
        return kind, await _stream(client, base + path, featured, rng.randint(0, 12) if how == "cancel" else None)
    if kind == "malformed":
        path, raw = rng.choice(MALFORMED)
        r = await client.post(base + path, content=raw, headers={"content-type": "application/json"})
        return kind, r.status_code
    if kind == "chat":
        r = await client.post(base + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": text}], "max_tokens": body["max_tokens"]})
        return kind, r.status_code
    if kind == "whole":
        return kind, (await client.post(base + "/v1/completions", json=body)).status_code
    cancel = rng.randint(0, 12) if kind == "cancel" else None
    return kind, await _stream(client, base + "/v1/completions", body, cancel)


async def _traffic(base: str, until: float, seed: int, concurrency: int, burst_every_s: float, burst_size: int,
                   statuses: collections.Counter, probes: list[tuple[float, float, int]]) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency + burst_size + 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker(wseed: int) -> None:
            wrng = random.Random(wseed)
            while time.monotonic() < until:
                kind, status = await _one(client, base, wrng)
                statuses[(kind, status)] += 1

        async def bursts() -> None:
            while time.monotonic() + burst_every_s < until:
                await asyncio.sleep(burst_every_s)
                body = {"prompt": "while True:", "max_tokens": 16, "ignore_eos": True}
                done = await asyncio.gather(*(client.post(base + "/v1/completions", json=body)
                                              for _ in range(burst_size)))
                for r in done:
                    statuses[("burst", r.status_code)] += 1

        async def probe() -> None:
            async with httpx.AsyncClient(timeout=120) as own:  # its own connection: never queued behind the rest
                while time.monotonic() < until:
                    started = time.monotonic()
                    r = await own.post(base + "/v1/completions", json=PROBE)
                    probes.append((started, time.monotonic() - started, r.status_code))
                    await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

        await asyncio.gather(*(worker(rng.randrange(2**32)) for _ in range(concurrency)), bursts(), probe())


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def soak(server: ServerProcess, seconds: float, windows: int = 6, seed: int = 0, concurrency: int = 4,
         burst_every_s: float = 30.0, burst_size: int = 40, sample_every_s: float = 30.0) -> dict[str, Any]:
    """Run the traffic for `seconds` against a ready server; figures before, during and after."""
    for _ in range(8):  # warm-up: the allocator's pools and the first compiled paths, before the baseline
        httpx.post(server.url + "/v1/completions", json=PROBE, timeout=120).raise_for_status()
    baseline = server.wait_idle(server.metrics()["muxd:kv_cache_free_pages"])["muxd:kv_cache_free_pages"]
    before = snapshot(server, settle=True)
    statuses: collections.Counter = collections.Counter()
    probes: list[tuple[float, float, int]] = []
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    until = started + seconds

    async def main() -> None:
        async def sample() -> None:
            while time.monotonic() < until:
                await asyncio.sleep(min(sample_every_s, max(0.0, until - time.monotonic())))
                samples.append({"t_s": round(time.monotonic() - started), **await asyncio.to_thread(snapshot, server)})

        await asyncio.gather(_traffic(server.url, until, seed, concurrency, burst_every_s, burst_size, statuses,
                                      probes), sample())

    asyncio.run(main())
    ended = time.monotonic()
    server.wait_idle(baseline)
    deadline = time.monotonic() + 30  # the server closes its side of the client's connections as they close
    while open_fds(server.proc.pid) > before["open_fds"] and time.monotonic() < deadline:
        time.sleep(0.2)
    after = snapshot(server, settle=True)
    span = (ended - started) / windows
    per_window = []
    for w in range(windows):
        lat = [d for t, d, s in probes if started + w * span <= t < started + (w + 1) * span and s == 200]
        per_window.append({"window": w + 1, "probes": len(lat), "p50_ms": round(_p(lat, 0.5) * 1000, 1),
                           "p99_ms": round(_p(lat, 0.99) * 1000, 1)})
    by_status = collections.Counter()
    for (kind, status), n in statuses.items():
        by_status[status] += n
    return {
        "seconds": round(ended - started), "requests": sum(statuses.values()) + len(probes),
        "by_kind_and_status": {f"{k} {s}": n for (k, s), n in sorted(statuses.items())},
        "by_status": dict(sorted(by_status.items())), "server_errors_5xx": sum(n for s, n in by_status.items()
                                                                             if s >= 500),
        "probe_statuses": dict(sorted(collections.Counter(s for _, _, s in probes).items())),
        "probe_windows": per_window,
        "before": before, "after": after, "peak_rss_mib": max([before["rss_mib"], *(s["rss_mib"] for s in samples)]),
        "peak_open_fds": max([before["open_fds"], *(s["open_fds"] for s in samples)]),
        "rss_growth_mib": round(after["rss_mib"] - before["rss_mib"], 1),
        "leaked_fds": after["open_fds"] - before["open_fds"],
        "leaked_kv_pages": before["kv_free_pages"] - after["kv_free_pages"], "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--out", type=Path, help="write the figures (JSON) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(["--model", "embedded", *SOAK_FLAGS], Path(tmp) / "server.log")
        try:
            server.wait_ready()
            figures = soak(server, args.minutes * 60)
        finally:
            server.stop()
        log = (Path(tmp) / "server.log").read_text()
    figures.update(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), flags=" ".join(SOAK_FLAGS),
                   machine=f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
                   tracebacks_in_log=log.count("Traceback"))
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
