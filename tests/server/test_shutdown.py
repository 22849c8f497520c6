"""SIGTERM drains a real `muxd serve` process: new work gets 503 and /ready 503, a request that can finish within
--shutdown-timeout finishes, the rest end with an error (an SSE error event then [DONE], or a JSON 503), the log
holds no traceback, and the process exits 0; also while the model is still loading."""
from __future__ import annotations

import json
import signal
import threading

import httpx
from live_server import ServerProcess


def stream_events(url: str, body: dict, events: list, first: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()


def test_sigterm_drains_then_exits_zero(request, tmp_path):
    log = tmp_path / "server.log"
    server = ServerProcess(["--model", request.config.getoption("--serve-model"), "--kv-cache-memory", "32MiB",
                            "--shutdown-timeout", "2"], log)
    try:
        server.wait_ready()
        endless = {"prompt": "import", "max_tokens": 2000, "ignore_eos": True}  # minutes of work on a CPU
        short = {"prompt": "def", "max_tokens": 3, "ignore_eos": True}
        long_events, short_events, whole = [], [], {}
        long_started, short_started = threading.Event(), threading.Event()
        threads = [
            threading.Thread(target=stream_events, args=(server.url, endless, long_events, long_started)),
            threading.Thread(target=stream_events, args=(server.url, short, short_events, short_started)),
            threading.Thread(target=lambda: whole.setdefault("response", httpx.post(
                server.url + "/v1/completions", json=endless, timeout=120))),
        ]
        for t in threads:
            t.start()
        assert long_started.wait(60) and short_started.wait(60)
        server.proc.send_signal(signal.SIGTERM)

        def refused() -> httpx.Response:
            for _ in range(100):  # the signal is handled between two bytecodes: poll until draining shows
                r = httpx.get(server.url + "/ready")
                if r.status_code == 503:
                    return r
            raise AssertionError("/ready never turned 503 after SIGTERM")

        ready = refused()
        assert ready.json()["error"]["code"] == "shutting_down" and ready.headers["retry-after"]
        new = httpx.post(server.url + "/v1/completions", json=short)
        assert new.status_code == 503 and new.json()["error"]["code"] == "shutting_down"
        assert httpx.get(server.url + "/health").status_code == 200
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()

    # the short stream finished normally
    assert short_events[-1] == "[DONE]" and json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    # the endless one was ended: an error event, then [DONE]
    assert long_events[-1] == "[DONE]"
    error = json.loads(long_events[-2])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
    assert all("choices" in json.loads(e) for e in long_events[:-2])
    # the non-streaming one got a JSON 503
    assert whole["response"].status_code == 503 and whole["response"].json()["error"]["code"] == "shutting_down"
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text
    assert "shutdown timeout: ended" in text


def test_sigterm_while_the_model_loads_exits_zero(request, tmp_path):
    """A signal after the server answers but before the model is up (a pod deleted during start-up): exit 0 at once.
    Letting the interpreter finalise under the load thread aborted in C++ (exit 134)."""
    log = tmp_path / "server.log"
    # 300 layers of dummy weights: the model loads for seconds after the HTTP server answers (the embedded model's
    # 4 layers take a few tenths of a second, which a loaded machine can spend between the answer and the signal)
    server = ServerProcess(["--model", request.config.getoption("--serve-model"), "--kv-cache-memory", "32MiB",
                            "--load-format", "dummy", "--hf-overrides", '{"num_hidden_layers": 300}'], log)
    try:
        ready = server.first_answer()
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "loading"
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    text = log.read_text()
    assert "stopped while the model was loading" in text
    assert "terminate called" not in text and "Traceback" not in text
