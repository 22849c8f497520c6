"""An OpenAI-compatible stand-in whose latency grows with load: one request is served at a time (FIFO), each taking
`service_s` before its first token, so its capacity is exactly 1 / service_s requests per second. It also serves
GET /debug/timeline (Chrome-trace spans of the work it did), like a server that exposes its SM partitions.

It runs in its own process (`python fake_server.py SERVICE_S PORT`), so the client under test does not share a
GIL with it; `FakeServer` starts and stops it.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from appliance.bench.launcher import free_port

MODEL = "fake-model"


def make_app(service_s: float) -> FastAPI:
    app = FastAPI()
    state = {"busy_until": 0.0, "spans": []}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}

    @app.get("/debug/timeline")
    async def timeline():
        return {"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 1,
                                 "args": {"name": "prefill partition"}}, *state["spans"]]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        now = time.perf_counter()
        start = max(now, state["busy_until"])
        state["busy_until"] = start + service_s
        state["spans"].append({"ph": "X", "name": "prefill", "pid": 0, "tid": 1, "ts": start * 1e6,
                               "dur": service_s * 1e6})
        return StreamingResponse(stream(body["max_tokens"], state["busy_until"] - now),
                                 media_type="text/event-stream")

    async def stream(max_tokens: int, wait: float):
        await asyncio.sleep(wait)
        for i in range(max_tokens):
            choice = {"text": " tok", "finish_reason": "length" if i == max_tokens - 1 else None}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": 8, "completion_tokens": max_tokens, "total_tokens": 8 + max_tokens}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return app


class FakeServer:
    def __init__(self, service_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, __file__, str(service_s), str(self.port)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "FakeServer":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v1/models", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError("fake server did not start")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(make_app(float(sys.argv[1])), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
