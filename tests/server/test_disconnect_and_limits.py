"""Clients that go away free their KV pages at once; a full waiting queue answers 429 with Retry-After."""
from __future__ import annotations

import asyncio
import time

import httpx


def wait_until_idle(server, free_pages: float, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m["muxd:num_requests_running"] == 0 and m["muxd:num_requests_waiting"] == 0
        if idle and m["muxd:kv_cache_free_pages"] == free_pages:
            return m
        assert time.monotonic() < deadline, f"KV pool did not return to {free_pages} free pages: {m}"
        time.sleep(0.1)


def test_twenty_streaming_clients_disconnect_mid_generation(serve):
    server = serve("--kv-cache-memory", "16MiB", "--max-model-len", "1024", "--no-prefix-caching")
    initial = server.metrics()["muxd:kv_cache_free_pages"]
    assert initial > 0

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"def function_{i}(x):", "max_tokens": 900, "ignore_eos": True, "stream": True}
        seen = 0
        async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen >= 3:
                    break  # leaving the block closes the connection mid-generation
        return seen

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(20)))

    assert asyncio.run(main()) == [3] * 20
    m = wait_until_idle(server, initial)
    assert m["muxd:generation_tokens_total"] < 20 * 900  # nobody ran to the end


def test_non_streaming_client_that_leaves_aborts_its_request(serve):
    server = serve("--kv-cache-memory", "16MiB", "--max-model-len", "1024")
    initial = server.metrics()["muxd:kv_cache_free_pages"]
    try:
        httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True},
                   timeout=1.0)
    except httpx.TimeoutException:
        pass
    wait_until_idle(server, initial)


def test_queue_over_its_limit_gets_429_with_retry_after(serve):
    server = serve("--max-num-seqs", "1", "--max-waiting", "1", "--kv-cache-memory", "16MiB")

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "while True:", "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=body)
                                          for _ in range(6)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
