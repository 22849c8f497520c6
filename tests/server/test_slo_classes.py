"""`muxd serve --policy mux --slo FILE`: requests pick their SLO class by header or body field; unknown -> 400."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

CHAT = Path(__file__).resolve().parents[2] / "configs" / "slo" / "chat.yaml"


@pytest.fixture(scope="module")
def server(serve):
    return serve("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--policy", "mux", "--slo", str(CHAT))


def complete(server, headers=None, **extra):
    body = {"prompt": "def add(a, b):", "max_tokens": 4, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers or {}, timeout=60)


def test_known_classes_by_header_or_field(server):
    assert complete(server).status_code == 200  # the contract's default class
    assert complete(server, {"X-SLO-Class": "background"}).status_code == 200
    assert complete(server, slo_class="interactive").status_code == 200
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"X-SLO-Class": "interactive"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200


@pytest.mark.parametrize("headers, field", [({"X-SLO-Class": "premium"}, None), ({}, "premium"),
                                            ({"X-SLO-Class": "background"}, "interactive")])
def test_unknown_or_conflicting_class_gets_400(server, headers, field):
    extra = {"slo_class": field} if field else {}
    response = complete(server, headers, **extra)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "slo_class" and error["type"] == "invalid_request_error"
    if field == "premium" or headers.get("X-SLO-Class") == "premium":
        assert "interactive, background" in error["message"]
