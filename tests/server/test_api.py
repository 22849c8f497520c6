"""The OpenAI-compatible server as a client sees it: a real `muxd serve` process, the openai client, raw HTTP."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from appliance.model_zoo.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def server(shared_serve):
    return shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512")




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


def test_scoring_a_prompt_counts_no_generated_token(server, model_name):
    """echo with max_tokens 0 samples a token that the response drops: the counters count what it returns."""
    body = {"model": model_name, "prompt": "hello there", "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2}
    before = server.metrics()
    whole = httpx.post(server.url + "/v1/completions", json=body).json()
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as stream:
        assert list(stream.iter_lines())[-2:] == ["data: [DONE]", ""]
    after = server.metrics()
    assert whole["usage"]["completion_tokens"] == 0 and whole["choices"][0]["text"] == "hello there"
    for name in ("muxd:generation_tokens_total", 'vllm:generation_tokens_total{engine="0"}'):
        assert after[name] == before[name]
    assert after["muxd:e2e_request_latency_seconds_count"] - before["muxd:e2e_request_latency_seconds_count"] == 4


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    return error


CHAT = [{"role": "user", "content": "hi"}]
BAD_BODIES = [
    # (endpoint, body, param named in the error)
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),       # no silent coercion
    ("completions", {"prompt": "hi", "max_tokens": 5.5}, "max_tokens"),      # 5.0 is the integer 5 in JSON
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": [[False]]}, "prompt"),                         # a bool is not a token id
    ("completions", {"prompt": [True, 5]}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": ["a", ""]}, "prompt"),                       # not prompt.0, "should be an integer"
    ("completions", {"prompt": [1, 2], "max_tokens": 1, "seed": "7"}, "seed"),
    ("completions", {"prompt": "hi", "seed": 2**64}, "seed"),                 # would be seed 0 (a 64-bit key)
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    ("completions", {"prompt": "word " * 600, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),  # 0 needs echo
    ("completions", {"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 100000}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "temperature": -0.1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "hi", "stop": ""}, "stop"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True, "chunk_usage": True}},
     "stream_options.chunk_usage"),
    ("completions", {"prompt": "hi", "top_k": 2**63}, "top_k"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),  # not streaming
    # unknown fields and options muxd does not implement are refused, naming the field
    ("completions", {"prompt": "hi", "temprature": 0.5}, "temprature"),
    ("chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat/completions", {"messages": CHAT, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ("chat/completions", {"messages": CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("chat/completions", {"messages": CHAT, "reasoning_effort": "low",
                          "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ("chat/completions", {"messages": CHAT, "metadata": {"k": 1}}, "metadata.k"),
    ("chat/completions", {"messages": CHAT, "store": "no"}, "store"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 1000}, "n"),
    ("completions", {"prompt": "hi", "best_of": 0}, "best_of"),
    ("completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),  # fewer than n (vLLM refuses it too)
    ("completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 10}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias.5"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("completions", {"prompt": "hi", "min_tokens": 4, "max_tokens": 3}, "min_tokens"),
    ("completions", {"prompt": "hi", "min_tokens": 17}, "min_tokens"),  # beyond the default max_tokens, 16
    ("chat/completions", {"messages": CHAT, "min_tokens": 9, "max_completion_tokens": 8}, "min_tokens"),
    ("chat/completions", {"messages": CHAT, "min_tokens": 600}, "min_tokens"),  # more than the 512-token context leaves
    ("chat/completions", {"messages": CHAT, "logprobs": "yes"}, "logprobs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ("chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"messages": CHAT, "tool_choice": "sometimes"}, "tool_choice"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"messages": CHAT, "n": True}, "n"),
    ("chat/completions", {"messages": CHAT, "slo_class": "platinum"}, "slo_class"),  # not a class of the contract
    ("chat/completions", {"messages": CHAT, "response_format": {"type": {}}}, "response_format"),  # was a 500
    ("completions", {"prompt": "hi", "response_format": {"type": ["json_object"]}}, "response_format"),
]


@pytest.mark.parametrize("endpoint, body, param", BAD_BODIES)
def test_bad_input_gets_400_with_openai_error_body(server, endpoint, body, param):
    # (the first JSON schema of a process loads xgrammar and its view of the vocabulary: seconds on a busy CPU)
    error = error_of(httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=120))
    assert error["param"] == param


def test_an_unusable_schema_is_named_without_the_compilers_source_location(server):
    schema = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    error = error_of(httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}))
    assert error["code"] == "invalid_json_schema"
    assert error["message"].endswith('constrained decoding: Unsupported type "nonsense"'), error["message"]


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "hi", "top_p": -Infinity}', "top_p"),
])
def test_non_finite_numbers_are_refused(server, raw, param):
    error = error_of(httpx.post(server.url + "/v1/completions", content=raw,
                                headers={"content-type": "application/json"}))
    assert error["param"] == param and "finite" in error["message"]


def test_fields_clients_send_at_their_defaults_are_accepted(server, model_name):
    common = {"model": model_name, "max_tokens": 2, "n": 1, "user": "u-1", "presence_penalty": 0,
              "frequency_penalty": 0.0, "temperature": None, "top_p": 1, "seed": None, "stop": None,
              "logit_bias": {}, "stream": False, "slo_class": "default"}
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        **common, "messages": [{"role": "system", "content": "Be brief.", "name": "rules"},
                               {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                               {"role": "assistant", "content": "hello", "refusal": None},
                               {"role": "user", "content": "again"}],
        "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}, "tools": [],
        "tool_choice": "none", "parallel_tool_calls": True, "max_completion_tokens": 2}, timeout=60)
    assert chat.status_code == 200, chat.text
    text = httpx.post(server.url + "/v1/completions", json={**common, "prompt": "hi", "echo": False, "best_of": 1,
                                                             "logprobs": None, "suffix": None}, timeout=60)
    assert text.status_code == 200, text.text
    streamed = httpx.post(server.url + "/v1/completions", json={
        **common, "prompt": [[5, 6, 7]], "stream": True, "stream_options": {"include_usage": True}}, timeout=60)
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


def test_unknown_model_is_404_model_not_found(server):
    response = httpx.post(server.url + "/v1/completions", json={"model": "gpt-4o", "prompt": "hi"})
    assert response.status_code == 404
    assert response.json()["error"] == {"message": response.json()["error"]["message"],
                                        "type": "invalid_request_error", "param": "model",
                                        "code": "model_not_found"}
    assert "gpt-4o" in response.json()["error"]["message"]


def test_an_unserved_path_or_method_is_named_in_the_error(server):
    missing = httpx.post(server.url + "/v1/embeddings", json={"model": "x", "input": "hi"})
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "not_found" and error["type"] == "invalid_request_error"
    assert "POST /v1/embeddings" in error["message"] and "/v1/chat/completions" in error["message"]
    wrong = httpx.get(server.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    error = wrong.json()["error"]
    assert error["code"] == "method_not_allowed" and "GET /v1/chat/completions" in error["message"]
    assert "POST" in error["message"]


def test_a_model_is_retrieved_as_models_lists_it_and_an_unknown_one_is_404(server, client, model_name):
    [listed] = httpx.get(server.url + "/v1/models").json()["data"]
    response = httpx.get(f"{server.url}/v1/models/{model_name}")
    assert response.status_code == 200 and response.json() == listed
    assert client.models.retrieve(model_name).model_dump(exclude_unset=True) == listed
    for unknown in ("gpt-4o", "org/some-model"):
        response = httpx.get(f"{server.url}/v1/models/{unknown}")
        assert response.status_code == 404
        error = response.json()["error"]
        assert error == {**error, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        assert unknown in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_malformed_json_gets_400(server):
    error = error_of(httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [',
                                headers={"content-type": "application/json"}))
    assert "JSON" in error["message"]


def test_openai_client_raises_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    assert info.value.body["param"] == "temperature"
