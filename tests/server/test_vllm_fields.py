"""Request fields and routes vLLM clients use, in process on the embedded model: at their defaults the fields are
accepted, those muxd implements do what vLLM's do (add_special_tokens, documents, request_id and X-Request-Id,
stop_reason, return_token_ids, stream_options, guided_grammar, allowed_token_ids, bad_words, cache_salt, SageMaker's
/ping and /invocations, and the server flags --enable-request-id-headers and --enable-force-include-usage), and the
rest are refused by name with the reason; vLLM's per-request token histograms count what they served."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from appliance.config import Config
from appliance.server.api import create_app
from appliance.server.protocol import ChatCompletionRequest
from in_process import ready_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
TEXT = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
DEFAULTS = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "spaces_between_special_tokens": True,
            "kv_transfer_params": None, "logits_processors": [], "vllm_xargs": {}, "structural_tag": None,
            "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": None}


@pytest.fixture(scope="module")
def client():
    with ready_app(Config.flat(kv_cache_memory="16MiB", max_model_len=256, enable_request_id_headers=True)) as client:
        yield client


def usage(response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_vllm_defaults_are_accepted(client):
    usage(client.post("/v1/completions", json={**TEXT, **DEFAULTS, "add_special_tokens": True}))
    usage(client.post("/v1/chat/completions", json={**CHAT, **DEFAULTS, "add_special_tokens": False, "echo": False,
                                                    "documents": None, "chat_template": None}))


def test_add_special_tokens_adds_the_bos_or_leaves_it_out(client):
    with_bos = usage(client.post("/v1/completions", json=TEXT))
    assert usage(client.post("/v1/completions", json={**TEXT, "add_special_tokens": False})) == with_bos - 1
    chat = usage(client.post("/v1/chat/completions", json=CHAT))  # the template writes its own BOS
    assert usage(client.post("/v1/chat/completions", json={**CHAT, "add_special_tokens": True})) == chat + 1


def test_documents_reach_the_template(client):
    ids = client.post("/tokenize", json={"messages": CHAT["messages"]}).json()["count"]
    # the embedded template ignores documents (as vLLM, a template that does not read them leaves the prompt as is)
    assert usage(client.post("/v1/chat/completions", json={**CHAT, "documents": [{"title": "a", "text": "b"}]})) \
        == ids
    body = ChatCompletionRequest.model_validate({**CHAT, "documents": [{"text": "b"}], "reasoning_effort": "low"})
    assert body.template_variables() == {"documents": [{"text": "b"}], "reasoning_effort": "low"}
    clash = client.post("/v1/chat/completions", json={**CHAT, "documents": [{"text": "b"}],
                                                      "chat_template_kwargs": {"documents": []}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "documents"


def test_response_ids_come_from_request_id_or_the_header(client):
    plain = client.post("/v1/completions", json=TEXT)
    assert plain.json()["id"].startswith("cmpl-") and plain.headers["x-request-id"]
    assert client.post("/v1/completions", json={**TEXT, "request_id": "abc"}).json()["id"] == "cmpl-abc"
    both = client.post("/v1/chat/completions", json={**CHAT, "request_id": "abc"}, headers={"X-Request-Id": "h-1"})
    assert both.json()["id"] == "chatcmpl-h-1" and both.headers["x-request-id"] == "h-1"
    # two requests of one client id run side by side: the engine's ids stay its own
    again = client.post("/v1/completions", json={**TEXT, "request_id": "abc", "n": 2})
    assert again.json()["id"] == "cmpl-abc" and len(again.json()["choices"]) == 2
    # /v1/responses: the id as given (as vLLM), its output items named after it
    response = {"input": "hi", "max_output_tokens": 2, "temperature": 0}
    assert client.post("/v1/responses", json=response).json()["id"].startswith("resp-")
    given = client.post("/v1/responses", json={**response, "request_id": "resp_abc"}).json()
    assert given["id"] == "resp_abc" and given["output"][-1]["id"] == "msg_resp_abc"
    headed = client.post("/v1/responses", json={**response, "request_id": "abc"}, headers={"X-Request-Id": "h-2"})
    assert headed.json()["id"] == "h-2" and headed.headers["x-request-id"] == "h-2"
    with client.stream("POST", "/v1/responses", json={**response, "stream": True, "request_id": "s-1"}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert {e["response"]["id"] for e in events if "response" in e} == {"s-1"}


@pytest.mark.parametrize("path, field, value, words", [
    ("/v1/completions", "kv_transfer_params", {"do_remote_decode": True}, "KV transfer"),
    ("/v1/chat/completions", "logits_processors", ["my.Processor"], "custom logits processors"),
    ("/v1/chat/completions", "vllm_xargs", {"k": 1}, "custom logits processors"),
    ("/v1/completions", "guided_decoding_backend", "outlines", "run on xgrammar"),
    ("/v1/chat/completions", "guided_whitespace_pattern", "[ ]?", "xgrammar's whitespace"),
])
def test_what_muxd_does_not_implement_is_refused_by_name(client, path, field, value, words):
    body = {**(CHAT if "chat" in path else TEXT), field: value}
    refused = client.post(path, json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and f"{field}=" in error["message"] and words in error["message"]


def test_stop_reason_names_the_stop_token_or_string_that_ended_a_choice(client):
    greedy = {"prompt": "The", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
              "return_tokens_as_token_ids": True}
    free = client.post("/v1/completions", json=greedy).json()["choices"][0]
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    token = int(free["logprobs"]["tokens"][2].removeprefix("token_id:"))
    by_token = client.post("/v1/completions", json={**greedy, "stop_token_ids": [token]}).json()["choices"][0]
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", token)
    chat = {"messages": [{"role": "user", "content": "The"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    stop = text[len(text) // 2:][:2]  # two characters from the middle of the greedy answer
    by_string = client.post("/v1/chat/completions", json={**chat, "stop": [stop]}).json()["choices"][0]
    assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", stop)
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stop": [stop], "stream": True}) as stream:
        last = [line for line in stream.iter_lines() if line.startswith("data: {")][-1]
    assert '"finish_reason":"stop"' in last and f'"stop_reason":{json.dumps(stop)}' in last


def test_return_token_ids_gives_the_prompt_and_output_tokens(client):
    body = {"prompt": "The", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    prompt = client.post("/tokenize", json={"prompt": "The"}).json()["tokens"]
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 6
    assert client.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    plain = client.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert plain.get("token_ids") is None and plain.get("prompt_token_ids") is None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks][:2] == [prompt, None]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == choice["token_ids"]
    chat = {"messages": [{"role": "user", "content": "The"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    prompt = client.post("/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
    whole = client.post("/v1/chat/completions", json=chat).json()
    assert whole["prompt_token_ids"] == prompt and len(whole["choices"][0]["token_ids"]) == 6
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == prompt and all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == whole["choices"][0]["token_ids"]


def test_sagemaker_routes_as_vllm_serves_them(client):
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
    chat = client.post("/invocations", json=CHAT)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = client.post("/invocations", json=TEXT)
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    with client.stream("POST", "/invocations", json={**CHAT, "stream": True}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert list(stream.iter_lines())[-2:] == ["data: [DONE]", ""]
    neither = client.post("/invocations", json={"input": "hi"})
    assert neither.status_code == 400 and "a body with messages" in neither.json()["error"]["message"]
    invalid = client.post("/invocations", json={**TEXT, "max_tokens": "5"})
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "max_tokens"
    assert client.post("/invocations", content=b"{").status_code == 400


def test_invocations_is_behind_the_api_key():
    cfg = Config.flat(api_key="sk-1", kv_cache_memory="16MiB", max_model_len=64)
    with TestClient(create_app(cfg)) as client:
        refused = client.post("/invocations", json=TEXT)
        assert refused.status_code == 401


def test_guided_grammar_constrains_the_output_to_an_ebnf_grammar(client):
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    for field in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        for seed in range(3):
            out = client.post("/v1/completions", json={**TEXT, "max_tokens": 8, "temperature": 1.0, "seed": seed,
                                                       **field})
            assert out.status_code == 200, out.text
            text = out.json()["choices"][0]["text"]
            assert text in ("yes", "no") or (text[:6] == "maybe " and text[6:].isdigit() and len(text) == 7), text
    broken = client.post("/v1/chat/completions", json={**CHAT, "guided_grammar": "root ::= ("})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "guided_grammar"
    assert "the grammar cannot be used for constrained decoding" in broken.json()["error"]["message"]
    assert broken.json()["error"]["code"] == "invalid_grammar"
    both = client.post("/v1/completions", json={**TEXT, "guided_grammar": grammar, "guided_regex": "a"})
    assert both.status_code == 400 and both.json()["error"]["code"] == "conflicting_fields"


def test_force_include_usage_ends_every_stream_with_its_usage():
    with ready_app(Config.flat(kv_cache_memory="16MiB", max_model_len=64, enable_force_include_usage=True)) as client:
        with client.stream("POST", "/v1/completions", json={**TEXT, "max_tokens": 3, "stream": True}) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_allowed_token_ids_keep_sampling_among_them(client):
    body = {**TEXT, "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True, "return_token_ids": True}
    for allowed in ([7, 42, 99], [13]):
        out = client.post("/v1/completions", json={**body, "allowed_token_ids": allowed}).json()["choices"][0]
        assert len(out["token_ids"]) == 12 and set(out["token_ids"]) <= set(allowed)
    chat = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5, "allowed_token_ids": [7, 42],
                                                     "ignore_eos": True, "return_token_ids": True}).json()
    assert set(chat["choices"][0]["token_ids"]) <= {7, 42}
    outside = client.post("/v1/completions", json={**TEXT, "allowed_token_ids": [1, 10 ** 6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "allowed_token_ids.1"
    both = client.post("/v1/completions", json={**TEXT, "allowed_token_ids": [7], "guided_regex": "a+"})
    assert both.status_code == 400 and both.json()["error"]["code"] == "conflicting_fields"
    ends = client.post("/v1/completions", json={**TEXT, "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [7],
                                                "allowed_token_ids": [7]})
    assert ends.status_code == 400 and "no token is left to sample" in ends.json()["error"]["message"]


def test_bad_words_never_appear_in_greedy_output(client):
    body = {"prompt": "The", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    greedy = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

    def text(ids: list[int]) -> str:
        return client.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    def ids(text: str) -> list[int]:
        return client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    # a word of one token, as is and after a space: neither spelling is generated (in chat either)
    word = next(w for t in greedy for w in [text([t]).strip()]
                if w.isalpha() and text([t]) in (w, " " + w) and len(ids(w)) == 1)
    banned = {ids(w)[0] for w in (word, " " + word) if len(ids(w)) == 1}
    first = next(k for k, t in enumerate(greedy) if t in banned)
    out = client.post("/v1/completions", json={**body, "bad_words": [word]}).json()["choices"][0]["token_ids"]
    assert not banned & set(out) and out[:first] == greedy[:first]
    chat = client.post("/v1/chat/completions", json={**CHAT, "bad_words": [word]})
    assert chat.status_code == 200, chat.text
    # a word of two tokens: the first is still generated, the second never after it
    pair = next(greedy[k:k + 2] for k in range(len(greedy) - 1) if ids(text(greedy[k:k + 2]).lstrip()) ==
                greedy[k:k + 2])
    out = client.post("/v1/completions", json={**body, "bad_words": [text(pair)]}).json()["choices"][0]["token_ids"]
    at = next(k for k in range(len(greedy) - 1) if greedy[k:k + 2] == pair)
    assert out[:at + 1] == greedy[:at + 1] and out[at + 1] != pair[1]
    assert all(out[k:k + 2] != pair for k in range(len(out) - 1))
    for words, param, message in (([" "], "bad_words", "only whitespace"), (["x" * 129], "bad_words.0",
                                  "at most 128 characters"), (["x"] * 129, "bad_words", "at most 128 items")):
        refused = client.post("/v1/completions", json={**TEXT, "bad_words": words})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        assert message in refused.json()["error"]["message"]


def test_cache_salt_shares_cached_pages_only_within_the_salt(client):
    def cached(**extra) -> int:
        body = {"prompt": "a story about the sea and the ships " * 8, "max_tokens": 1, **extra}
        out = client.post("/v1/completions", json=body)
        assert out.status_code == 200, out.text
        return out.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()  # the plain prompt is in the cache now
    assert cached() > 0
    assert cached(cache_salt="tenant-a") == 0  # a salted request does not find the unsalted pages
    assert cached(cache_salt="tenant-a") > 0  # ... but its own salt's
    assert cached(cache_salt="tenant-b") == 0
    empty = client.post("/v1/completions", json={**TEXT, "cache_salt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"


def _stream(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as stream:
        assert stream.status_code == 200
        return [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path,body", [("/v1/completions", TEXT), ("/v1/chat/completions", CHAT)])
def test_stream_options_without_include_usage_include_it_as_vllm(client, path, body):
    """vLLM's stream_options default include_usage to true, and continuous_usage_stats count only with it."""
    body = {**body, "max_tokens": 3, "ignore_eos": True, "stream": True}
    for options in ({}, {"continuous_usage_stats": True}):
        chunks = _stream(client, path, {**body, "stream_options": options})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(("usage" in c) == bool(options) for c in chunks[:-1])
    off = _stream(client, path, {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert off[-1]["choices"] and all("usage" not in c for c in off)


def test_per_request_token_histograms_as_vllm(client):
    """vllm:request_prompt_tokens and vllm:request_generation_tokens (dashboards' length heatmaps): one observation
    a finished choice, on vLLM's 1-2-5 edges up to the context length (256 here)."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, dict[str, float]]:
        families = text_string_to_metric_families(client.get("/metrics").text)
        return {f.name: {s.name + s.labels.get("le", ""): s.value for s in f.samples} for f in families
                if f.name.startswith("vllm:request_") and f.name.endswith(("_tokens", "_params_n"))}

    before = samples()
    prompt = usage(client.post("/v1/completions", json={**TEXT, "max_tokens": 3, "ignore_eos": True, "n": 2}))
    after = samples()
    # a choice each: prompt, generated, max_tokens as sent, prompt tokens computed (the second choice's prompt is
    # cached but for its last page's tokens, so only the count is checked); a prompt each: its longest choice
    per_choice = {"prompt_tokens": prompt, "generation_tokens": 3, "params_max_tokens": 3,
                  "prefill_kv_computed_tokens": None}
    for short, value in [*per_choice.items(), ("max_num_generation_tokens", 3)]:
        name = "vllm:request_" + short
        edges = [float(k[len(name) + 7:]) for k in after[name] if k.startswith(name + "_bucket")]
        assert edges == [1, 2, 5, 10, 20, 50, 100, 200, float("inf")]
        grew = {k: after[name][k] - before.get(name, {}).get(k, 0.0) for k in after[name]}
        count = 2 if short in per_choice else 1
        assert grew[name + "_count"] == count and (value is None or grew[name + "_sum"] == count * value), name
    n = after["vllm:request_params_n"]
    assert n["vllm:request_params_n_bucket2.0"] - before["vllm:request_params_n"].get(
        "vllm:request_params_n_bucket2.0", 0.0) == 1 and n["vllm:request_params_n_bucket1.0"] == \
        before["vllm:request_params_n"].get("vllm:request_params_n_bucket1.0", 0.0)


@pytest.mark.parametrize("effort", ["none", "xhigh"])
def test_reasoning_effort_takes_openai_s_and_vllm_s_values(client, effort):
    """OpenAI's and vLLM's reasoning_effort include none and xhigh; the value reaches the template as sent."""
    body = ChatCompletionRequest.model_validate({**CHAT, "reasoning_effort": effort})
    assert body.template_variables() == {"reasoning_effort": effort}
    usage(client.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": effort}))
    answer = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 16,
                                                 "reasoning": {"effort": effort}})
    assert answer.status_code == 200, answer.text


def test_request_phase_histograms_split_each_request_as_vllm(client):
    """vLLM's per-request phases: waiting, prefill and decode (which add up to inference, admission to last token),
    and the mean time per output token, one observation a finished choice."""
    from prometheus_client.parser import text_string_to_metric_families

    names = [f"vllm:request_{p}_time_seconds" for p in ("queue", "prefill", "decode", "inference")] \
        + ["vllm:request_time_per_output_token_seconds"]

    def totals() -> dict[str, tuple[float, float]]:
        found = {f.name: {s.name: s.value for s in f.samples} for f in
                 text_string_to_metric_families(client.get("/metrics").text) if f.name in names}
        return {n: (found[n][n + "_count"], found[n][n + "_sum"]) for n in names}

    before = totals()
    usage(client.post("/v1/completions", json={**TEXT, "max_tokens": 4, "ignore_eos": True, "n": 2}))
    after = totals()
    grew = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in names}
    assert all(count == 2 and seconds >= 0 for count, seconds in grew.values()), grew
    queue, prefill, decode, inference, tpot = (grew[n][1] for n in names)
    assert prefill + decode == pytest.approx(inference, rel=1e-6, abs=1e-9)
    assert tpot == pytest.approx(decode / 3, rel=1e-6, abs=1e-9) and decode > 0


def test_iteration_tokens_count_each_steps_prompts_and_generated_tokens(client):
    """vllm:iteration_tokens_total: one observation a step that produced tokens, of the tokens it generated and the
    prompts whose prefill it finished, so a request adds its prompt and its output to the sum."""
    from prometheus_client.parser import text_string_to_metric_families

    def total() -> tuple[float, float]:
        [family] = [f for f in text_string_to_metric_families(client.get("/metrics").text)
                    if f.name == "vllm:iteration_tokens_total"]
        found = {s.name: s.value for s in family.samples}
        return found["vllm:iteration_tokens_total_count"], found["vllm:iteration_tokens_total_sum"]

    (count0, sum0) = total()
    prompt = usage(client.post("/v1/completions", json={**TEXT, "max_tokens": 5, "ignore_eos": True}))
    count1, sum1 = total()
    assert sum1 - sum0 == prompt + 5
    assert 1 <= count1 - count0 <= 5  # a step each token at most (the first comes with the prefill)


def test_vllms_request_log_names_prompts_params_and_outputs(caplog):
    """--enable-log-requests / --enable-log-outputs as vLLM's, each line cut to --max-log-len."""
    import logging

    cfg = Config.flat(kv_cache_memory="16MiB", max_model_len=256, enable_log_requests=True, enable_log_outputs=True,
                      max_log_len=6)
    with ready_app(cfg) as quiet_client, caplog.at_level(logging.INFO, logger="appliance.server.serving"):
        _ok(quiet_client, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "n": 2,
                                                "ignore_eos": True})
        _ok(quiet_client, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3, "use_beam_search": True})
        ids = quiet_client.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    received = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    generated = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Generated response")]
    assert len(ids) > 6 and len(received) == 2
    assert all(f"prompt_token_ids: {ids[:6]}" in m and "max_tokens=3" in m for m in received)
    assert len(generated) == 3 and all("num_output_tokens: 3" in m for m in generated)
    with ready_app(Config.flat(kv_cache_memory="16MiB", max_model_len=256)) as plain, \
            caplog.at_level(logging.INFO, logger="appliance.server.serving"):
        caplog.clear()
        _ok(plain, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2})
    assert not [r for r in caplog.records if "Received request" in r.getMessage()]


def test_stream_interval_gathers_tokens_into_fewer_chunks():
    """As vLLM's --stream-interval N: a choice's first token comes at once, then a chunk every N tokens, its last
    ones when it ends; the text and tokens are those of an unstreamed request."""
    body = {"prompt": "hello there", "max_tokens": 11, "temperature": 0, "ignore_eos": True, "logprobs": 0, "n": 2}
    with ready_app(Config.flat(kv_cache_memory="16MiB", max_model_len=256, stream_interval=3)) as client:
        whole = _ok(client, "/v1/completions", body)["choices"]
        sizes: dict[int, list[int]] = {0: [], 1: []}
        texts = {0: "", 1: ""}
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    if choice["logprobs"] and choice["logprobs"]["tokens"]:
                        sizes[choice["index"]].append(len(choice["logprobs"]["tokens"]))
                    texts[choice["index"]] += choice["text"]
    assert sizes == {0: [1, 3, 3, 3, 1], 1: [1, 3, 3, 3, 1]}
    assert [texts[0], texts[1]] == [c["text"] for c in sorted(whole, key=lambda c: c["index"])]


def _ok(client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()
