"""The reliability checks of scripts/reliability.py in small sizes, against one real server with 4 seats, 8 queue
places and 16 KV pages (docs/RELIABILITY.md has the full-size figures)."""
from __future__ import annotations

import json
import socket
import time

import pytest
import reliability


@pytest.fixture(scope="module")
def server(serve):
    return serve(*reliability.LOAD_FLAGS)


def test_hundred_streams_cancelled_at_random_points_leak_no_page(server):
    figures = reliability.cancel_streams(server, n=100, seed=1)
    # a client that leaves frees its seat a moment later, so a new one may still find the server busy (429)
    assert figures["left_after_random_event_count"] > 20 and figures["cancelled_at_random_time"] > 20
    assert figures["leaked_kv_pages"] == 0
    assert figures["serving_after"]


def test_non_streaming_client_that_leaves_aborts_its_request(server):
    before = server.metrics()
    finished = 'muxd:request_success_total{finished_reason="length"}'
    initial, done = before["muxd:kv_cache_free_pages"], before.get(finished, 0)
    body = json.dumps({"prompt": "x", "max_tokens": 250, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        while server.metrics()["muxd:num_requests_running"] == 0:
            time.sleep(0.01)
    # the socket is closed while the request runs: the server must abort it and free its pages
    m = server.wait_idle(initial)
    assert m.get(finished, 0) == done  # it never ran to its end


def test_overload_admitted_requests_finish_the_rest_get_429_with_retry_after(server):
    figures = reliability.overload(server, clients=40)
    assert figures["other_statuses"] == {}
    assert 4 <= figures["finished"] < 40 and figures["finished"] + figures["refused_429"] == 40
    assert figures["finished_with_all_tokens"] == figures["finished"]
    assert figures["refused_with_retry_after"] == figures["refused_429"] + figures["refused_503"]


def test_kv_exhaustion_preempts_and_recomputes_without_changing_outputs(server):
    figures = reliability.kv_exhaustion(server, requests=4, prompt_tokens=60, max_tokens=12)
    assert figures["preemptions"] > 0, "the cache never ran out; the test lost its point"
    assert figures["lost"] == 0 and figures["outputs_changed_vs_solo_run"] == 0
