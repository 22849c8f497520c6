"""A server started with the flags a vLLM user reaches for (API key from MUXD_API_KEY, body cap, chat template,
block size), and the faults a new user found: lone surrogates on a keep-alive connection, oversized bodies, a
10 MB chat body."""
from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from appliance.model_zoo.tokenizer import Tokenizer

KEY = "sk-muxd-test-key"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(serve):
    return serve("--kv-cache-memory", "32MiB", "--max-model-len", "256", "--max-request-bytes", "1MiB",
                 "--block-size", "8", "--chat-template", TEMPLATE, "--max-num-batched-tokens", "64",
                 env={"MUXD_API_KEY": KEY})


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_every_v1_route_needs_the_key_and_probes_stay_open(server):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
        assert error(httpx.request(method, server.url + path, json={}), 401)["code"] == "invalid_api_key"
        wrong = httpx.request(method, server.url + path, json={}, headers={"Authorization": "Bearer sk-wrong"})
        assert error(wrong, 401)["code"] == "invalid_api_key"
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    [card] = good.models.list().data
    assert good.completions.create(model=card.id, prompt="x", max_tokens=2).usage
    assert good.models.retrieve(card.id) == card
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    for ask in (bad.models.list, lambda: bad.models.retrieve(card.id), lambda: bad.models.retrieve("gpt-4o")):
        with pytest.raises(openai.AuthenticationError):
            ask()


def test_openapi_declares_the_bearer_scheme(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


def raw_exchange(sock: socket.socket, port: int, body: bytes) -> tuple[int, dict]:
    """One HTTP/1.1 request on an open keep-alive socket; returns (status, JSON body)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    header, rest = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(
        b"content-length"))
    while len(rest) < length:
        rest += sock.recv(65536)
    assert b"connection: close" not in header.lower()
    return int(header.split()[1]), json.loads(rest)


def test_lone_surrogate_is_a_clean_400_and_the_connection_stays_usable(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        status, body = raw_exchange(sock, server.port, b'{"prompt": "abc \\ud800 def", "max_tokens": 2}')
        assert status == 400 and body["error"]["param"] == "prompt" and "surrogate" in body["error"]["message"]
        status, body = raw_exchange(sock, server.port, b'{"prompt": "abc def", "max_tokens": 2}')
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        status, body = raw_exchange(sock, server.port, b'{"prompt": "x", "stop": ["\\udfff"]}')
        assert status == 400 and body["error"]["param"] == "stop.0"
    chat = httpx.post(server.url + "/v1/chat/completions", headers={**AUTH, "content-type": "application/json"},
                      content=json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}).encode())
    assert error(chat, 400)["param"] == "messages.0.content.0.text"


def test_body_that_is_not_a_json_object_says_what_to_send(server):
    form = httpx.post(server.url + "/v1/completions", headers=AUTH, content=b'{"prompt": "x"}')  # no content type
    assert "application/json" in error(form, 400)["message"]
    assert "JSON object" in error(httpx.post(server.url + "/v1/completions", headers=AUTH, json=[1, 2]),
                                  400)["message"]


def test_body_over_max_request_bytes_is_413_then_the_server_goes_on(server):
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    assert error(httpx.post(server.url + "/v1/completions", headers={**AUTH, "content-type": "application/json"},
                            content=big), 413)["code"] == "request_too_large"

    def chunked():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    assert error(httpx.post(server.url + "/v1/completions", headers={**AUTH, "content-type": "application/json"},
                            content=chunked()), 413)["code"] == "request_too_large"
    ok = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200


def test_prompt_far_over_the_context_is_refused_before_tokenizing(server):
    body = {"messages": [{"role": "user", "content": "word " * 200_000}]}  # 1 MB: fits the body cap, not the context
    response = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json=body, timeout=60)
    assert error(response, 400)["code"] == "context_length_exceeded"
    assert "at least" in response.json()["error"]["message"]


def test_chat_template_flag_replaces_the_models_template(server, served_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    out = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={"messages": messages, "max_tokens": 1})
    rendered = "".join(f"[{m['role']}] {m['content']}\n" for m in messages)
    expected = Tokenizer(served_dir).encode(rendered, add_special_tokens=False)
    assert out.json()["usage"]["prompt_tokens"] == len(expected)


def test_block_size_sets_the_kv_page_size(server):
    body = {"prompt": list(range(100, 130)), "max_tokens": 1}  # 30 tokens: three full pages of 8
    httpx.post(server.url + "/v1/completions", headers=AUTH, json=body)
    again = httpx.post(server.url + "/v1/completions", headers=AUTH, json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 24  # 16 with pages of 16
