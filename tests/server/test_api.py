"""The OpenAI-compatible server as a client sees it: a real `muxd serve` process, the openai client, raw HTTP."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from appliance.model_zoo.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def server(serve):
    return serve("--kv-cache-memory", "64MiB", "--max-model-len", "512")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    [card] = client.models.list().data
    return card.id


@pytest.fixture(scope="module")
def tokenizer(served_dir):
    return Tokenizer(served_dir)


def test_health_ready_models(server, model_name):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    body = httpx.get(server.url + "/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == model_name
    assert body["data"][0]["max_model_len"] == 512


def test_streamed_chat_completion_with_usage(client, model_name, tokenizer):
    messages = [{"role": "system", "content": "You answer questions about Python."},
                {"role": "user", "content": "What does json.dumps do?"}]
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finish in (["stop"], ["length"])
    assert usage.prompt_tokens == len(prompt_ids)
    assert 1 <= usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish == ["length"]:
        assert usage.completion_tokens == 24
    # the same request without streaming gives the same greedy text
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == text
    assert whole.usage.completion_tokens == usage.completion_tokens


def test_streamed_completion_with_usage(client, model_name, tokenizer):
    prompt = "def read_file(path):\n"
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, extra_body={
                                           "ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == text and whole.usage.completion_tokens == 16


def test_raw_stream_ends_with_done(server, model_name):
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": model_name, "prompt": "import", "max_tokens": 5, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_cached_prompt_tokens_are_reported(client, model_name):
    prompt = "class Counter(dict):\n    '''Dict subclass for counting hashable items.'''\n" * 6
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_metrics_after_requests(server, client, model_name):
    before = server.metrics()
    out = client.completions.create(model=model_name, prompt="hello", max_tokens=7, extra_body={"ignore_eos": True})
    after = server.metrics()
    assert out.usage.completion_tokens == 7
    assert after["muxd:generation_tokens_total"] - before["muxd:generation_tokens_total"] == 7
    assert after["muxd:prompt_tokens_total"] - before["muxd:prompt_tokens_total"] == out.usage.prompt_tokens
    assert after["muxd:time_to_first_token_seconds_count"] - before["muxd:time_to_first_token_seconds_count"] == 1
    assert after["muxd:inter_token_latency_seconds_count"] - before["muxd:inter_token_latency_seconds_count"] == 6
    assert after["muxd:e2e_request_latency_seconds_count"] - before["muxd:e2e_request_latency_seconds_count"] == 1
    assert after['muxd:request_success_total{finished_reason="length"}'] >= 1
    assert "muxd:cached_prompt_tokens_total" in after
    assert after["muxd:num_requests_running"] == 0 and after["muxd:num_requests_waiting"] == 0
    assert 0 <= after["muxd:kv_cache_usage_perc"] <= 1 and after["muxd:kv_cache_free_pages"] > 0


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    return error


BAD_BODIES = [
    # (endpoint, body, param named in the error)
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("completions", {"model": "gpt-4o", "prompt": "hi"}, "model"),
    ("completions", {"prompt": "word " * 600, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.1}, "temperature"),
    ("completions", {"prompt": "hi", "n": 2}, "n"),
]


@pytest.mark.parametrize("endpoint, body, param", BAD_BODIES)
def test_bad_input_gets_400_with_openai_error_body(server, endpoint, body, param):
    error = error_of(httpx.post(f"{server.url}/v1/{endpoint}", json=body))
    assert error["param"] == param


def test_malformed_json_gets_400(server):
    error = error_of(httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [',
                                headers={"content-type": "application/json"}))
    assert "JSON" in error["message"]


def test_openai_client_raises_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    assert info.value.body["param"] == "temperature"
