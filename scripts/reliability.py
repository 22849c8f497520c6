"""Reliability checks of a real `muxd serve` process; each returns its figures, and the command line runs them in
full size and writes them (JSON) for docs/RELIABILITY.md. The test suite runs the same functions in small sizes
(tests/server/test_reliability.py and neighbours), so the figures come from the code that CI exercises.

    python scripts/reliability.py all --out docs/reliability-results.json
    python scripts/reliability.py cancel overload     # a subset
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_server import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# one server shape serves the cancellation, overload and KV-exhaustion checks: 4 seats, 8 queue places, 16 KV pages
# of 16 tokens (256 tokens: a single full-length request fills the cache), no prefix cache to hide leaks
LOAD_FLAGS = ["--max-num-seqs", "4", "--max-waiting", "8", "--kv-cache-memory", "512KiB", "--max-model-len", "256",
              "--no-enable-prefix-caching"]
DRAIN_FLAGS = ["--kv-cache-memory", "32MiB", "--shutdown-timeout", "2"]
# requests that leave max_tokens unset get 4 tokens, not the rest of the context: the run checks what the API
# answers, and generating most of 64 tokens for each of its thousands of cases was most of its time
SCHEMATHESIS_FLAGS = ["--max-model-len", "64", "--kv-cache-memory", "16MiB",
                      "--override-generation-config", '{"max_new_tokens": 4}']


# ---- cancelled streams -------------------------------------------------------------------------------------------
async def _cancelled_stream(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    body = {"prompt": f"def function_{rng.randrange(10**6)}(x):", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    if rng.random() < 0.5:  # leave after a random number of events (0: right after the response headers)
        stop_after = rng.randrange(0, 12)
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"status {response.status_code}"
            seen = 0
            async for line in response.aiter_lines():
                if seen >= stop_after:
                    break
                seen += line.startswith("data: {")
        return "events"

    async def run() -> None:  # cancelled at a random time: in the queue, in prefill, or mid-decode
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass

    task = asyncio.ensure_future(run())
    await asyncio.sleep(rng.uniform(0, 0.3))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return "time"


def cancel_streams(server: ServerProcess, n: int, concurrency: int = 8, seed: int = 0) -> dict[str, Any]:
    initial = server.metrics()["muxd:kv_cache_free_pages"]
    rng = random.Random(seed)

    async def main() -> list[str]:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def one(r: random.Random) -> str:
                async with gate:
                    return await _cancelled_stream(client, server.url, r)
            return await asyncio.gather(*(one(random.Random(rng.random())) for _ in range(n)))

    started = time.monotonic()
    kinds = collections.Counter(asyncio.run(main()))
    try:
        final = server.wait_idle(initial)["muxd:kv_cache_free_pages"]
    except AssertionError:
        final = server.metrics()["muxd:kv_cache_free_pages"]
    check = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
    return {"streams": n, "concurrency": concurrency, "left_after_random_event_count": kinds["events"],
            "cancelled_at_random_time": kinds["time"], "refused": n - kinds["events"] - kinds["time"],
            "kv_pages_total_free_before": initial, "leaked_kv_pages": initial - final,
            "serving_after": check.status_code == 200 and check.json()["usage"]["completion_tokens"] == 4,
            "seconds": round(time.monotonic() - started, 1)}


# ---- overload ----------------------------------------------------------------------------------------------------
def overload(server: ServerProcess, clients: int, max_tokens: int = 16) -> dict[str, Any]:
    """`clients` requests at once against 4 seats + 8 queue places."""
    rss = [server.rss_bytes()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            rss.append(server.rss_bytes())

    async def main() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            body = {"prompt": "while True:", "max_tokens": max_tokens, "ignore_eos": True}
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=body)
                                          for _ in range(clients)))

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.monotonic()
    try:
        responses = asyncio.run(main())
    finally:
        done.set()
        sampler.join()
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code in (429, 503)]
    return {"clients": clients, "capacity": "4 running + 8 waiting", "finished": len(ok),
            "finished_with_all_tokens": sum(r.json()["usage"]["completion_tokens"] == max_tokens for r in ok),
            "refused_429": sum(r.status_code == 429 for r in refused),
            "refused_503": sum(r.status_code == 503 for r in refused),
            "refused_with_retry_after": sum("retry-after" in r.headers for r in refused),
            "other_statuses": dict(collections.Counter(r.status_code for r in responses
                                                       if r.status_code not in (200, 429, 503))),
            "rss_before_mib": round(rss[0] / 2**20, 1), "rss_peak_mib": round(max(rss) / 2**20, 1),
            "rss_after_mib": round(server.rss_bytes() / 2**20, 1),
            "seconds": round(time.monotonic() - started, 1)}


# ---- KV exhaustion -----------------------------------------------------------------------------------------------
def kv_exhaustion(server: ServerProcess, requests: int, prompt_tokens: int = 60, max_tokens: int = 16
                  ) -> dict[str, Any]:
    """`requests` at once whose prompts fill the 16-page cache, so that decoding runs out of pages: preemption and
    recompute must not change a single token (greedy rows and seeded sampled rows alike)."""
    bodies = [{"prompt": [10 + (i * 7 + k * 13) % 4000 for k in range(prompt_tokens)], "max_tokens": max_tokens,
               "ignore_eos": True,
               **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": i})}
              for i in range(requests)]
    before = server.metrics().get("muxd:num_preemptions_total", 0)

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=b) for b in bodies))

    started = time.monotonic()
    loaded = asyncio.run(together())
    preemptions = server.metrics().get("muxd:num_preemptions_total", 0) - before
    alone = [httpx.post(server.url + "/v1/completions", json=b, timeout=600) for b in bodies]
    lost = sum(r.status_code != 200 for r in loaded)
    changed = sum(a.status_code != 200 or b.status_code != 200 or
                  a.json()["choices"][0]["text"] != b.json()["choices"][0]["text"] for a, b in zip(loaded, alone))
    return {"requests": requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "preemptions": int(preemptions), "lost": lost,
            "outputs_changed_vs_solo_run": changed, "seconds": round(time.monotonic() - started, 1)}


# ---- SIGTERM drain -----------------------------------------------------------------------------------------------
def _stream(url: str, body: dict, events: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def drain(server: ServerProcess, short: int, endless: int) -> dict[str, Any]:
    """SIGTERM with `short` streams that can finish in time (3 tokens) and `endless` ones that cannot (2000 tokens,
    --shutdown-timeout 2), plus one endless non-streaming request. Stops the server."""
    short_body = {"prompt": "def", "max_tokens": 3, "ignore_eos": True}
    endless_body = {"prompt": "import", "max_tokens": 2000, "ignore_eos": True}
    runs = [(short_body, [], threading.Event()) for _ in range(short)]
    runs += [(endless_body, [], threading.Event()) for _ in range(endless)]
    threads = [threading.Thread(target=_stream, args=(server.url, b, ev, st)) for b, ev, st in runs]
    whole: dict[str, httpx.Response] = {}
    threads.append(threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
        server.url + "/v1/completions", json=endless_body, timeout=300))))
    for t in threads:
        t.start()
    for _, _, st in runs:
        st.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    for _ in range(200):  # the signal is handled between two bytecodes of the server: poll until draining shows
        ready = httpx.get(server.url + "/ready")
        if ready.status_code == 503:
            break
    new = httpx.post(server.url + "/v1/completions", json=short_body)
    health = httpx.get(server.url + "/health")
    for t in threads:
        t.join(120)
    exit_code = server.proc.wait(120)
    log = server.log.read_text()

    def ended_with_error(events: list[str]) -> bool:
        return (len(events) >= 2 and events[-1] == "[DONE]" and
                json.loads(events[-2]).get("error", {}).get("code") == "shutting_down")

    def finished(events: list[str]) -> bool:
        return (len(events) >= 2 and events[-1] == "[DONE]" and
                json.loads(events[-2]).get("choices", [{}])[0].get("finish_reason") == "length")

    w = whole.get("r")
    return {"short_streams_finished": sum(finished(ev) for b, ev, _ in runs if b is short_body),
            "short_streams": short,
            "endless_streams_ended_with_error_event_and_done": sum(ended_with_error(ev) for b, ev, _ in runs
                                                                   if b is endless_body),
            "endless_streams": endless,
            "non_streaming_got_json_503": bool(w is not None and w.status_code == 503 and
                                               w.json()["error"]["code"] == "shutting_down"),
            "ready_during_drain": ready.status_code, "new_request_during_drain": new.status_code,
            "health_during_drain": health.status_code, "exit_code": exit_code,
            "tracebacks_in_log": log.count("Traceback"), "error_lines_in_log": log.count(" ERROR ")}


# ---- big body ----------------------------------------------------------------------------------------------------
def unbounded_tokenizer_model(dst: Path) -> Path:
    """The embedded model with one added token marked lstrip: tokenization is unchanged for ordinary text, but no
    cheap token-count bound exists, so a big prompt is tokenized in full (the slow path this check is about)."""
    from appliance.config import EMBEDDED_MODEL_DIR

    shutil.copytree(EMBEDDED_MODEL_DIR, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    spec["added_tokens"][0]["lstrip"] = True
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


def _health_ms(client: httpx.Client) -> float:
    t = time.perf_counter()
    client.get("/health").raise_for_status()
    return (time.perf_counter() - t) * 1000


def big_body(server: ServerProcess, megabytes: float) -> dict[str, Any]:
    """Post a chat body of `megabytes` and probe /health while it is processed; a stream runs alongside."""
    probe = httpx.Client(base_url=server.url, timeout=60)  # one keep-alive connection: the probe costs no set-up
    baseline = sorted(_health_ms(probe) for _ in range(50))
    content = "def f(x):\n    return x + 1\n" * int(megabytes * 2**20 / 29)
    # serialised up front: encoding 10 MB of JSON here would hold this process's GIL and delay the probe itself
    payload = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()
    result: dict[str, Any] = {}
    stream_events: list[float] = []

    def post() -> None:
        t = time.perf_counter()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=600, content=payload,
                       headers={"content-type": "application/json"})
        result.update(status=r.status_code, code=r.json().get("error", {}).get("code"),
                      seconds=time.perf_counter() - t, start=t, end=time.perf_counter())

    def stream() -> None:
        body = {"prompt": "import", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    stream_events.append(time.perf_counter())
                if "end" in result:
                    break

    streamer = threading.Thread(target=stream)
    streamer.start()
    while not stream_events:
        time.sleep(0.01)
    poster = threading.Thread(target=post)
    poster.start()
    during = []
    while poster.is_alive():
        during.append(_health_ms(probe))
    poster.join()
    probe.close()
    streamer.join()
    inside = [t for t in stream_events if result["start"] < t < result["end"]]
    return {"body_mib": megabytes, "status": result["status"], "error_code": result["code"],
            "request_seconds": round(result["seconds"], 2), "health_probes_during": len(during),
            "health_median_ms_idle": round(baseline[len(baseline) // 2], 1),
            "health_max_ms_during": round(max(during), 1) if during else None,
            "health_extra_delay_ms": round(max(during) - baseline[len(baseline) // 2], 1) if during else None,
            "stream_events_during": len(inside)}


# ---- schemathesis and hypothesis ---------------------------------------------------------------------------------
def schemathesis_run(server: ServerProcess, examples: int, seed: int = 1, max_response_time: float = 60,
                     phases: str = "coverage,fuzzing", mode: str = "all") -> dict[str, Any]:
    """All of schemathesis's checks (positive_data_acceptance replaced as scripts/schemathesis_hooks.py explains);
    `mode`: the cases generated, valid (positive), invalid (negative) or both (all)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "-n", str(examples), "--seed", str(seed),
               "--phases", phases, "--mode", mode, "--max-response-time", str(max_response_time),
               "--request-timeout", "120", "--generation-database", "none", "--no-color", "--report", "json",
               "--report-json-path", str(report)]
        env = {**__import__("os").environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
               "PYTHONPATH": str(ROOT / "scripts")}
        # run in the temporary directory: schemathesis keeps a crash cache in its working directory
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        doc = json.loads(report.read_text()) if report.is_file() else {}
    failures = {f["code"]: f["count"] for f in doc.get("failures", [])}
    return {"exit_code": out.returncode, "examples_per_operation": examples, "phases": phases, "mode": mode,
            "operations_tested": (doc.get("operations") or {}).get("tested"),
            "test_cases": (doc.get("test_cases") or {}).get("generated"), "failures": failures,
            "server_errors_5xx": failures.get("ST101", 0),
            "schema_violations": sum(v for k, v in failures.items() if k != "ST101" and k != "ST112"),
            "over_max_response_time": failures.get("ST112", 0), "errors": doc.get("errors", []),
            "output_tail": out.stdout[-3000:] if out.returncode else ""}


def hypothesis_fuzz(profile: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz_inputs.py",
           f"--hypothesis-profile={profile}", "--hypothesis-show-statistics"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = out.stdout.splitlines()
    cases: dict[str, str] = {}  # property -> "N passing, N failing, and N invalid test cases"
    name = ""
    for line in lines:
        if line.startswith("tests/test_fuzz_inputs.py::"):
            name = line.split("::")[1].rstrip(":")
        elif "passing" in line and "failing" in line and name:
            cases[name] = line.strip(" -")
    return {"exit_code": out.returncode, "profile": profile, "summary": lines[-1] if lines else "", "cases": cases}


# ---- command line ------------------------------------------------------------------------------------------------
def _with_server(flags: list[str], fn: Callable[[ServerProcess], dict], model: str = "embedded") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(["--model", model, *flags], Path(tmp) / "server.log")
        try:
            server.wait_ready()
            return fn(server)
        finally:
            server.stop()


CHECKS: dict[str, Callable[[], dict]] = {
    "schemathesis": lambda: _with_server(SCHEMATHESIS_FLAGS, lambda s: schemathesis_run(s, examples=200)),
    "fuzz": lambda: hypothesis_fuzz("reliability"),
    "cancel": lambda: _with_server(LOAD_FLAGS, lambda s: cancel_streams(s, 1000)),
    "overload": lambda: _with_server(LOAD_FLAGS, lambda s: overload(s, clients=500)),
    "kv": lambda: _with_server(LOAD_FLAGS, lambda s: kv_exhaustion(s, requests=8, prompt_tokens=60, max_tokens=64)),
    "drain": lambda: _with_server(DRAIN_FLAGS, lambda s: drain(s, short=4, endless=8)),
    "big-body": lambda: _with_server(["--max-request-bytes", "64MiB"], lambda s: _repeat(big_body, s, 10, 5)),
    "big-body-full-tokenization": lambda: _big_body_unbounded(10),
}


def _repeat(check: Callable[..., dict], server: ServerProcess, size: float, times: int) -> dict:
    """Run a latency check several times on one server: report every run and the worst."""
    runs = [check(server, size) for _ in range(times)]
    worst = max(runs, key=lambda r: r["health_extra_delay_ms"] or 0)
    return {**worst, "runs": times, "health_extra_delay_ms_each": [r["health_extra_delay_ms"] for r in runs]}


def _big_body_unbounded(megabytes: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = unbounded_tokenizer_model(Path(tmp) / "model")
        return _with_server(["--max-request-bytes", "64MiB"], lambda s: _repeat(big_body, s, megabytes, 3),
                            str(model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checks", nargs="+", choices=["all", *CHECKS])
    parser.add_argument("--out", type=Path, help="merge the figures into this JSON file")
    args = parser.parse_args()
    names = list(CHECKS) if "all" in args.checks else args.checks
    results = json.loads(args.out.read_text()) if args.out and args.out.is_file() else {}
    results["machine"] = f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, Python " \
                         f"{platform.python_version()}, embedded model"
    for name in names:
        print(f"== {name}", flush=True)
        started = time.monotonic()
        figures = CHECKS[name]()
        figures["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        figures["wall_seconds"] = round(time.monotonic() - started, 1)
        results[name] = figures
        print(json.dumps(figures, indent=2), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
