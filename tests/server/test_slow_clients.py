"""Slow clients against a real server: a connection that trickles its headers is closed after --header-timeout; bodies
that trickle never take seats (real clients are served meanwhile) and get 408 after --body-timeout; a burst far over
--max-num-seqs + --max-waiting has exactly that many admitted while the first ones run; vLLM's h11 limits on a
request's headers (their count, their bytes)."""
from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest


@pytest.fixture(scope="module")
def server(serve):
    return serve("--kv-cache-memory", "16MiB", "--max-model-len", "256", "--max-num-seqs", "2", "--max-waiting",
                 "2", "--header-timeout", "1", "--body-timeout", "2", "--h11-max-header-count", "40",
                 "--h11-max-incomplete-event-size", "65536")


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it is still open after `seconds`."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        return None
    return data


def test_headers_that_trickle_are_cut_off(server):
    fresh = connect(server)  # sends nothing at all
    partial = connect(server)
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    assert closed_within(fresh, 30) == b""
    assert closed_within(partial, 30) == b""
    assert httpx.get(server.url + "/health").status_code == 200


def test_bodies_that_trickle_hold_no_seat_and_get_408(server):
    slow = []
    for _ in range(8):  # twice the seats: before, these filled them and real clients got 429
        sock = connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        slow.append(sock)
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
    for sock in slow:
        answer = closed_within(sock, 60)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"--body-timeout" in answer
    assert server.metrics()["muxd:num_requests_running"] == 0


def test_a_burst_admits_every_seat_and_queue_place(server):
    """24 requests at once against 2 seats + 2 queue places: 4 are admitted (before, the waiting queue's limit
    counted requests about to start, and only 2-3 were) and the rest get 429."""
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=24)) as client:
            body = {"prompt": "while True:", "max_tokens": 32, "ignore_eos": True}
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=body)
                                          for _ in range(24)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    admitted = statuses.count(200)
    # a request that finishes before the burst is over frees its place for a later one: at least 4, never fewer
    assert admitted >= 4 and set(statuses) <= {200, 429}, statuses
    assert all(r.json()["usage"]["completion_tokens"] == 32 for r in responses if r.status_code == 200)


def exchange(server, head: bytes, pause: bool = False) -> bytes:
    """Send a request's head (`pause`: all but its last two bytes first, the rest 0.5 s later) and return what the
    server answered before closing or within 30 s."""
    sock = connect(server)
    if pause:
        sock.sendall(head[:-2])
        time.sleep(0.5)
        try:
            sock.sendall(head[-2:])
        except OSError:  # (closed already)
            pass
    else:
        sock.sendall(head)
    sock.settimeout(30)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and b"connection: close" not in data.lower():
                break
    except socket.timeout:
        pass
    sock.close()
    return data


def test_h11_limits_refuse_too_many_headers_with_431_and_too_many_bytes_with_400(server):
    def head(count: int, size: int = 8) -> bytes:
        extra = b"".join(b"X-%d: %s\r\n" % (i, b"v" * size) for i in range(count))
        return b"GET /health HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n"

    assert exchange(server, head(39)).startswith(b"HTTP/1.1 200")  # 40 headers with Host
    refused = exchange(server, head(40))
    assert refused.startswith(b"HTTP/1.1 431"), refused
    assert b"the request has 41 headers; this server takes at most 40" in refused
    assert "refused a request of 41 headers (--h11-max-header-count 40)" in server.log.read_text()
    # h11 limits what it buffers of a head still incomplete: 30 KiB (over h11's default 16 KiB) is within
    # --h11-max-incomplete-event-size 64 KiB, 70 KiB is not
    assert exchange(server, head(30, 1024), pause=True).startswith(b"HTTP/1.1 200")
    assert exchange(server, head(35, 2048), pause=True).startswith(b"HTTP/1.1 400")
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # and the server serves on
