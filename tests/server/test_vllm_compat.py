"""What vLLM users' clients and dashboards rely on, against a real `muxd serve`: vLLM's metric names, usage on every
chunk, /tokenize, /detokenize, /version, a batch of prompts in one completions request."""
from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.model_zoo.tokenizer import Tokenizer
from appliance.server.metrics import VLLM_ITL_BUCKETS, VLLM_TTFT_BUCKETS
from appliance.server.reasoning import split


@pytest.fixture(scope="module")
def server(shared_serve):
    return shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512")




@pytest.fixture(scope="module")
def tokenizer(served_dir):
    return Tokenizer(served_dir)


def _vllm_samples(server) -> dict[str, list]:
    text = httpx.get(server.url + "/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def test_vllm_metric_names_labels_and_buckets(server, client, model_name):
    out = client.completions.create(model=model_name, prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
    families = _vllm_samples(server)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:num_preemptions",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:e2e_request_latency_seconds",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        assert name in families, name
        assert all(s.labels["model_name"] == model_name and s.labels["engine"] == "0" for s in families[name])
    edges = {name: [float(s.labels["le"]) for s in families[name] if s.name.endswith("_bucket")]
             for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds")}
    assert edges["vllm:time_to_first_token_seconds"] == [*VLLM_TTFT_BUCKETS, float("inf")]
    assert edges["vllm:inter_token_latency_seconds"] == [*VLLM_ITL_BUCKETS, float("inf")]
    names = {s.name for samples in families.values() for s in samples}
    assert {"vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"} <= names
    queries = sum(s.value for s in families["vllm:prefix_cache_queries"] if s.name.endswith("_total"))
    assert queries >= out.usage.prompt_tokens
    waiting = [s.value for s in families["vllm:num_requests_waiting"]]
    assert waiting == [0.0]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_usage_on_every_chunk(client, model_name, endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "chat":
        stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, stream=True, stream_options=options,
                                                extra_body={"ignore_eos": True})
    else:
        stream = client.completions.create(model=model_name, prompt="hi", max_tokens=6, stream=True,
                                           stream_options=options, extra_body={"ignore_eos": True})
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in content)
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in content)
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_continuous_usage_counts_each_chunk_s_own_prompt_and_choice(server, model_name, tokenizer):
    """As vLLM: a chunk's usage is its prompt's tokens and what its choice has generated so far; the last chunk
    counts every prompt and choice."""
    prompts = ["hi", "a longer prompt of more tokens"]
    body = {"model": model_name, "prompt": prompts, "n": 2, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    lengths = [len(tokenizer.encode(text)) for text in prompts]
    counts: dict[int, list[int]] = {}
    for e in [e for e in events if e["choices"]]:
        index = e["choices"][0]["index"]
        counts.setdefault(index, []).append(e["usage"]["completion_tokens"])
        assert e["usage"]["prompt_tokens"] == lengths[index // 2]
    assert sorted(counts) == [0, 1, 2, 3]
    assert all(c == sorted(c) and c[-1] == 4 for c in counts.values())
    assert events[-1]["usage"]["prompt_tokens"] == sum(lengths) and events[-1]["usage"]["completion_tokens"] == 16


def test_continuous_usage_false_is_accepted(server, model_name):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": False}}
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    assert events and all("usage" not in e for e in events)


def test_tokenize_detokenize_version(server, model_name):
    from appliance import __version__
    from appliance.config import EMBEDDED_MODEL_DIR
    from appliance.model_zoo.tokenizer import Tokenizer

    tok = Tokenizer(EMBEDDED_MODEL_DIR)
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    body = httpx.post(server.url + "/tokenize", json={"model": model_name, "prompt": "def main():",
                                                       "return_token_strs": True}).json()
    assert body["tokens"] == tok.encode("def main():") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    text = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert text == {"prompt": tok.decode(body["tokens"], skip_special_tokens=False)}
    assert text["prompt"].endswith("def main():")
    # special tokens are kept, as vLLM keeps them: a chat template's markers come back as written
    marked = httpx.post(server.url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert marked == rendered
    for path, bad, param in (("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [10**6]}, "tokens.0"),
                             ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model")):
        response = httpx.post(server.url + path, json=bad)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param


def test_token_strs_are_the_vocabulary_pieces(server, tokenizer):
    """As vLLM (the tokenizer's convert_ids_to_tokens): each token's piece as the vocabulary spells it, so a token
    of part of a character is not a replacement character."""
    body = httpx.post(server.url + "/tokenize", json={"prompt": "hello world\n\u00e9",
                                                       "return_token_strs": True}).json()
    assert body["token_strs"] == [tokenizer.raw.id_to_token(t) for t in body["tokens"]]
    assert "\ufffd" not in "".join(body["token_strs"])


def test_n_choices_with_seeds_streamed_and_not(client, model_name):
    kw = dict(model=model_name, prompt="import os\n" * 8, max_tokens=8, temperature=1.0, seed=11, n=3,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # each choice its own seed stream
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens > 8
    assert whole.usage.prompt_tokens_details.cached_tokens > 0  # choices after the first reuse its prefill
    streamed = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    parts = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for c in chunk.choices:
            parts[c.index] += c.text
    assert [parts[i] for i in range(3)] == texts  # seeded: the same texts
    single = client.completions.create(**{**kw, "n": 1, "seed": 12})
    assert single.choices[0].text == texts[1]  # choice i samples with seed + i


def test_chat_logprobs_and_top_logprobs(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top one was taken
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    streamed = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0, logprobs=True, stream=True,
                                              extra_body={"ignore_eos": True})
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content])


def test_completion_logprobs_with_echo(client, model_name):
    out = client.completions.create(model=model_name, prompt="def main():", max_tokens=3, temperature=0, logprobs=2,
                                    echo=True, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith("def main():")
    n = out.usage.prompt_tokens + 3
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 3 and lp.tokens[i] in t for i, t in enumerate(lp.top_logprobs) if i)  # token + top 2
    assert lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(model=model_name, prompt="def main():", max_tokens=3, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[-3:], abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token(client, model_name, stream):
    """As OpenAI and vLLM: each top_logprobs entry is the sampled token and the `logprobs` likeliest (up to
    logprobs + 1 entries), so logprobs=0 still names the sampled token."""
    for k in (0, 1):
        out = client.completions.create(model=model_name, prompt="def main():", max_tokens=8, temperature=2.0,
                                        seed=5, logprobs=k, stream=stream, extra_body={"ignore_eos": True})
        lps = [c.choices[0].logprobs for c in out if c.choices] if stream else [out.choices[0].logprobs]
        entries = [(t, v, top) for lp in lps for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]
        assert len(entries) == 8
        for token, value, top in entries:
            assert top[token] == pytest.approx(value) and 1 <= len(top) <= k + 1
        if k == 0:
            assert all(len(top) == 1 for _, _, top in entries)


def test_echo_with_max_tokens_zero_returns_the_scored_prompt_alone(server, model_name, tokenizer):
    """Echo without generation (as vLLM): each choice of each prompt is its prompt, with the prompt tokens'
    log-probabilities, finish_reason length, no completion token in text, logprobs or usage, and no KV page kept."""
    free = server.metrics()["muxd:kv_cache_free_pages"]
    prompts = ["def main():", "import os\nimport sys"]
    ids = [tokenizer.encode(x) for x in prompts]
    body = dict(model=model_name, prompt=prompts, echo=True, logprobs=1, max_tokens=0, n=2)
    out = _post(server, "completions", {**body, "return_tokens_as_token_ids": True})
    scored = [_post(server, "completions", dict(model=model_name, prompt=x, echo=True, logprobs=1, max_tokens=1,
                                                 temperature=0))["choices"][0]["logprobs"] for x in prompts]
    assert out["usage"] == {**out["usage"], "prompt_tokens": sum(map(len, ids)), "completion_tokens": 0,
                            "total_tokens": sum(map(len, ids))}
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for c in out["choices"]:
        p = c["index"] // 2
        lp = c["logprobs"]
        assert c["text"] == prompts[p] and c["finish_reason"] == "length"
        assert [int(t.removeprefix("token_id:")) for t in lp["tokens"]] == ids[p]  # the prompt's ids, and no more
        assert lp["token_logprobs"] == pytest.approx(scored[p]["token_logprobs"][:len(ids[p])], abs=1e-5)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"] == scored[p]["text_offset"][:len(ids[p])]
    chunks = [json.loads(line[6:]) for line in httpx.post(
        f"{server.url}/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120).text.splitlines() if line.startswith("data: {")]
    for i in range(4):
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == i]
        assert "".join(c["text"] for c in mine) == prompts[i // 2]
        assert [t for c in mine if c.get("logprobs") for t in c["logprobs"]["tokens"]] == \
            [tokenizer.decode([t], skip_special_tokens=False) for t in ids[i // 2]]
        assert [c.get("finish_reason") for c in mine if c.get("finish_reason")] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 0
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(map(len, ids))
    server.wait_idle(free)


def test_penalties_bias_and_min_tokens_through_the_api(client, model_name):
    forced = client.completions.create(model=model_name, prompt="x", max_tokens=4, logit_bias={"65": 100},
                                       temperature=0.8, seed=1)
    assert forced.usage.completion_tokens == 4
    text = client.completions.create(model=model_name, prompt="x", max_tokens=4, logit_bias={"65": 100},
                                     temperature=0).choices[0].text
    assert text == forced.choices[0].text
    short = client.completions.create(model=model_name, prompt="x", max_tokens=30, temperature=0,
                                      logit_bias={"2": 100}, extra_body={"min_tokens": 3})
    assert short.usage.completion_tokens == 4 and short.choices[0].finish_reason == "stop"
    penalised = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=8, presence_penalty=1.5,
        frequency_penalty=1.0, extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "ignore_eos": True})
    assert penalised.usage.completion_tokens == 8


def test_best_of_returns_the_likeliest(client, model_name):
    kw = dict(model=model_name, prompt="import", max_tokens=6, temperature=1.0, seed=3, logprobs=0,
              extra_body={"ignore_eos": True})
    candidates = client.completions.create(**kw, n=4)
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in candidates.choices}
    best = client.completions.create(**kw, n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == sorted(totals, key=totals.get, reverse=True)[:2]
    assert best.usage.completion_tokens == 24  # every candidate was generated
    streamed = client.completions.create(**kw, n=2, best_of=4, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in best.choices]


def test_a_batch_of_prompts_answers_each_as_its_own_request(client, model_name, tokenizer):
    """Prompt p's choices are indices p * n ... (as vLLM and OpenAI number them); each prompt is answered as it is
    alone (greedy), with its own echo; usage counts every prompt once."""
    prompts = ["def main():", "import os", "class Point:"]
    kw = dict(model=model_name, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=q, echo=True, logprobs=1, **kw) for q in prompts]
    batch = client.completions.create(prompt=prompts, n=2, echo=True, logprobs=1, **kw)
    assert sorted(c.index for c in batch.choices) == list(range(6))
    for c in batch.choices:
        single = alone[c.index // 2].choices[0]
        assert c.text == single.text and c.text.startswith(prompts[c.index // 2])
        assert c.logprobs.tokens == single.logprobs.tokens
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 5
    ids = [tokenizer.encode(q) for q in prompts]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in sorted(by_ids.choices, key=lambda c: c.index)] == \
        [a.choices[0].text[len(q):] for a, q in zip(alone, prompts)]
    streamed = client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                         **kw)
    texts, usage = {}, None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text[len(prompts[c.index // 2]):] for c in batch.choices}
    assert usage.prompt_tokens == batch.usage.prompt_tokens and usage.completion_tokens == 30
    long = ["batch_a = 1\n" * 8, "batch_b = [2]\n" * 6]  # a full 16-token page or more each, not sent before
    shared = client.completions.create(prompt=long, n=2, **kw)
    full_pages = sum(a.usage.prompt_tokens // 16 * 16 for a in
                     (client.completions.create(prompt=q, **kw) for q in long))
    assert shared.usage.prompt_tokens_details.cached_tokens >= full_pages > 0  # each prompt prefilled once


def test_a_batch_of_prompts_with_best_of_ranks_each_prompt_apart(client, model_name):
    kw = dict(model=model_name, max_tokens=4, temperature=1.0, seed=5, logprobs=0, extra_body={"ignore_eos": True})
    prompts = ["import", "def"]
    best = client.completions.create(prompt=prompts, n=1, best_of=3, **kw)
    assert sorted(c.index for c in best.choices) == [0, 1]
    for c in best.choices:
        alone = client.completions.create(prompt=prompts[c.index], n=1, best_of=3, **kw)
        assert c.text == alone.choices[0].text
    assert best.usage.completion_tokens == 2 * 3 * 4


def test_a_batch_too_large_is_refused_naming_the_prompt(server, model_name):
    for body in ({"prompt": ["x"] * 257}, {"prompt": ["x"] * 20, "n": 64}, {"prompt": [[1], [2], "x"]}):
        response = httpx.post(server.url + "/v1/completions", json={"model": model_name, **body}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt", response.text


def test_continue_final_message_continues_the_last_message(client, server, model_name, tokenizer):
    """With continue_final_message (and add_generation_prompt false, as vLLM asks), the prompt ends inside the final
    message: the model continues it, exactly as a completion of the conversation cut after that text."""
    messages = [{"role": "user", "content": "What does len do?"}, {"role": "assistant", "content": "It returns"}]
    kw = dict(model=model_name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(messages=messages, **{**kw, "extra_body": {
        "ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    cut = rendered[:rendered.rfind("It returns") + len("It returns")]
    assert cut != rendered  # the template closes the turn; the request's prompt does not
    alone = client.completions.create(prompt=tokenizer.encode(cut, add_special_tokens=False), **kw)
    assert out.choices[0].message.content == alone.choices[0].text
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                        "continue_final_message": True}).json()["tokens"]
    assert tokens == tokenizer.encode(cut, add_special_tokens=False)
    for extra in ({"continue_final_message": True},  # add_generation_prompt defaults to true
                  {"continue_final_message": True, "add_generation_prompt": False,
                   "messages": [*messages[:1], {"role": "assistant", "content": ""}]}):
        body = {"model": model_name, "messages": messages, **extra}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


def test_chat_echo_opens_the_answer_with_the_last_assistant_message(client, model_name):
    """As vLLM's chat echo: the final assistant message, then its continuation (streamed: the message in a chunk of
    its own after the role); a last message of another role echoes nothing."""
    messages = [{"role": "user", "content": "What does len do?"}, {"role": "assistant", "content": "It returns"}]
    kw = dict(model=model_name, messages=messages, max_tokens=6, temperature=0, n=2)
    extra = {"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**kw, extra_body=extra)
    echoed = client.chat.completions.create(**kw, extra_body={**extra, "echo": True})
    assert [c.message.content for c in echoed.choices] == ["It returns" + c.message.content for c in plain.choices]
    assert echoed.usage == plain.usage
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={**extra, "echo": True}))
    for i in range(2):
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].index == i]
        assert deltas[:2] == ["", "It returns"] and "".join(deltas) == echoed.choices[i].message.content
    asked = client.chat.completions.create(model=model_name, messages=messages[:1], max_tokens=4, temperature=0,
                                           extra_body={"echo": True, "ignore_eos": True})
    same = client.chat.completions.create(model=model_name, messages=messages[:1], max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert asked.choices[0].message.content == same.choices[0].message.content


TOOLS_TEMPLATE = ("{% for t in tools or [] %}<tool>{{ t['function']['name'] }}: {{ t['function']['description'] }}"
                  "</tool>{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("exclude", [False, True])
def test_tool_choice_none_renders_the_tools_unless_told_not_to(shared_serve, model_name, exclude):
    """As OpenAI and vLLM: with tool_choice "none" the chat template still gets the tools (the output is not read as
    calls); vLLM's --exclude-tools-when-tool-choice-none leaves them out."""
    server = shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--chat-template", TOOLS_TEMPLATE,
                          *(["--exclude-tools-when-tool-choice-none"] if exclude else []))
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object", "properties": {}}}}]

    def prompt_tokens(**extra) -> int:
        body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert not response.json()["choices"][0]["message"]["tool_calls"]
        return response.json()["usage"]["prompt_tokens"]

    plain, auto, none = prompt_tokens(), prompt_tokens(tools=tools), prompt_tokens(tools=tools, tool_choice="none")
    assert auto > plain and none == (plain if exclude else auto)
    counted = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "tools": tools}, timeout=60).json()["count"]
    assert counted == auto  # /tokenize renders the tools as a chat request does (vLLM's field)


def test_a_requests_own_chat_template_needs_the_trust_flag(shared_serve, server, model_name, tokenizer):
    """As vLLM's: a request's chat_template (or chat_template_kwargs.chat_template) is refused by name unless the
    server was started with --trust-request-chat-template; then it renders the prompt instead of the model's."""
    own = "{% for m in messages %}[{{ m['role'] }}] {{ ((m['content'] ~ ' ') * 3) | upper }}\n{% endfor %}"
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1}
    for extra in ({"chat_template": own}, {"chat_template_kwargs": {"chat_template": own}}):
        refused = httpx.post(server.url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template", refused.text
        assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    trusted = shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--trust-request-chat-template")
    expected = tokenizer.encode("[user] " + "HI THERE " * 3 + "\n", add_special_tokens=False)
    for extra in ({"chat_template": own}, {"chat_template_kwargs": {"chat_template": own}}):
        response = httpx.post(trusted.url + "/v1/chat/completions", json={**body, **extra, "return_token_ids": True},
                              timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["prompt_token_ids"] == expected
    plain = httpx.post(trusted.url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=60)
    assert plain.json()["prompt_token_ids"] != expected  # (the model's own template otherwise)
    broken = httpx.post(trusted.url + "/v1/chat/completions", json={**body, "chat_template": "{% for %}"}, timeout=60)
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template", broken.text
    tokenize = {"messages": body["messages"], "add_generation_prompt": False, "chat_template": own}
    refused = httpx.post(server.url + "/tokenize", json=tokenize, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template", refused.text
    assert httpx.post(trusted.url + "/tokenize", json=tokenize, timeout=60).json()["tokens"] == expected


THINKING = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}<|assistant|>\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
            "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_openai_bookkeeping_fields_are_accepted(shared_serve, model_name):
    """vLLM's chat_template_kwargs (Qwen3's {"enable_thinking": false}) and OpenAI's reasoning_effort are variables
    of the chat template, in chat requests and /tokenize alike; OpenAI's store, metadata, service_tier,
    prompt_cache_key and safety_identifier are accepted and change nothing."""
    server = shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--chat-template", THINKING)
    messages = [{"role": "user", "content": "hi"}]

    def prompt_tokens(**extra) -> tuple[int, list[int]]:
        body = {"model": model_name, "messages": messages, "max_tokens": 1, **extra}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, **{
            k: v for k, v in extra.items() if k == "chat_template_kwargs"}}).json()["tokens"]
        return response.json()["usage"]["prompt_tokens"], tokens

    plain, plain_tokens = prompt_tokens()
    assert plain == len(plain_tokens)
    off, off_tokens = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert off == len(off_tokens) > plain and off_tokens[:plain] == plain_tokens
    effort, _ = prompt_tokens(reasoning_effort="low")
    assert effort > plain
    assert prompt_tokens(chat_template_kwargs={"reasoning_effort": "low"})[0] == effort
    bookkeeping = {"store": False, "metadata": {"team": "search"}, "service_tier": "auto",
                   "prompt_cache_key": "user-7", "safety_identifier": "hash-1"}
    assert prompt_tokens(**bookkeeping)[0] == plain


@pytest.fixture(scope="module")
def defaults_server(shared_serve, tmp_path_factory):
    """A server of default template variables and a generation config (the tests of each set what the other's
    default stands in for: max_tokens, or no template variable)."""
    where = tmp_path_factory.mktemp("generation")
    (where / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    return shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--chat-template", THINKING,
                        "--default-chat-template-kwargs", '{"enable_thinking": false}', "--generation-config",
                        str(where))


def test_default_chat_template_kwargs_apply_where_a_request_sets_none(defaults_server, model_name):
    """--default-chat-template-kwargs (vLLM's): every chat request and /tokenize gets those template variables; a
    request's own chat_template_kwargs replace them name by name."""
    server = defaults_server
    messages = [{"role": "user", "content": "hi"}]

    def prompt(**extra) -> tuple[int, int]:
        body = {"model": model_name, "messages": messages, "max_tokens": 1, **extra}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        tokens = httpx.post(server.url + "/tokenize", json={"messages": messages, **extra}).json()["tokens"]
        return response.json()["usage"]["prompt_tokens"], len(tokens)

    default, default_tokens = prompt()
    assert default == default_tokens
    thinking, _ = prompt(chat_template_kwargs={"enable_thinking": True})
    assert default > thinking  # the default closed the think block; the request's own variable kept it open
    assert prompt(chat_template_kwargs={"enable_thinking": False})[0] == default
    assert prompt(chat_template_kwargs={"other": 1})[0] == default  # other variables keep the default


OPENS_THINKING = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}<|assistant|>\n<think>\n"
                  "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}")


def test_reasoning_parser_splits_reasoning_from_content_in_bodies_and_streams(shared_serve, model_name):
    """With --reasoning-parser qwen3 and a template that opens a think block, the output is reasoning until
    </think>: the body's reasoning and content are the split of the text the same prompt completes to, the stream's
    deltas add up to the body's; include_reasoning false leaves the reasoning out; a grammar holds from </think> on,
    or from the first token when thinking is off."""
    server = shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--chat-template", OPENS_THINKING,
                          "--reasoning-parser", "qwen3")
    messages = [{"role": "user", "content": "Is 7 prime?"}]

    def chat(**extra) -> dict:
        body = {"model": model_name, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                **extra}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        if not extra.get("stream"):
            return response.json()["choices"][0]["message"]
        deltas = [json.loads(line[6:])["choices"] for line in response.text.splitlines() if line.startswith("data: {")]
        parts = [c[0]["delta"] for c in deltas if c]
        joined = {k: "".join(d.get(k) or "" for d in parts) or None for k in ("reasoning", "content")}
        return joined

    def completed(**extra) -> str:
        ids = httpx.post(server.url + "/tokenize", json={"messages": messages, **extra}).json()["tokens"]
        body = {"model": model_name, "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    thinking = chat()
    reasoning, content = split(completed(), True)
    assert (thinking["reasoning"], thinking["content"]) == (reasoning or None, content or None)
    assert thinking["reasoning"]
    assert chat(stream=True) == {"reasoning": thinking["reasoning"], "content": thinking["content"]}
    hidden = chat(include_reasoning=False)
    assert hidden["reasoning"] is None and hidden["content"] == thinking["content"]
    off = chat(chat_template_kwargs={"enable_thinking": False})
    assert off["reasoning"] is None
    assert off["content"] == completed(chat_template_kwargs={"enable_thinking": False})
    # a grammar waits for the end of thinking (which this model never writes): the same reasoning, no content
    assert chat(response_format={"type": "json_object"}) == {**thinking, "content": None}
    closed = chat(response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": False})
    assert closed["reasoning"] is None and closed["content"].startswith("{")  # no think block: JSON at once
    echoed = [*messages, {"role": "assistant", **thinking}, {"role": "user", "content": "Why?"}]
    assert httpx.post(server.url + "/tokenize", json={"messages": echoed}).status_code == 200  # as clients send back


def test_thinking_token_budget_ends_the_think_block_after_its_tokens(shared_serve, server, model_name):
    """As vLLM's thinking_token_budget: the answer thinks for at most that many tokens, then </think> is written
    and the answer goes on as content (this model never ends its thinking itself); without --reasoning-parser it
    is a 400 naming the field."""
    reasoner = shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--chat-template", OPENS_THINKING,
                            "--reasoning-parser", "qwen3")
    end = httpx.post(reasoner.url + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()
    body = {"model": model_name, "messages": [{"role": "user", "content": "Is 7 prime?"}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    free = _post(reasoner, "chat/completions", body)["choices"][0]
    for budget in (0, 3):
        capped = _post(reasoner, "chat/completions", {**body, "thinking_token_budget": budget})["choices"][0]
        ids = capped["token_ids"]
        assert ids[:budget] == free["token_ids"][:budget] and ids[budget:budget + end["count"]] == end["tokens"]
        assert capped["message"]["content"]
        assert (capped["message"]["reasoning"] or "") == (free["message"]["reasoning"][:len(
            capped["message"]["reasoning"] or "")])
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}  # the prompt closed the block: nothing capped
    assert _post(reasoner, "chat/completions", {**off, "thinking_token_budget": 0})["choices"][0]["token_ids"] == \
        _post(reasoner, "chat/completions", off)["choices"][0]["token_ids"]
    refused = httpx.post(server.url + "/v1/chat/completions", json={**body, "thinking_token_budget": 4}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"


def test_generation_config_sets_the_sampling_a_request_leaves_unset(defaults_server, model_name):
    """--generation-config DIR (and auto, the model's own file): its temperature and max_new_tokens stand in for a
    request's unset temperature and max_tokens; what the request sets wins."""
    server = defaults_server

    def chat(**extra) -> dict:
        body = {"model": model_name, "messages": [{"role": "user", "content": "Count."}], "ignore_eos": True, **extra}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    unset = [chat() for _ in range(2)]
    assert [u["usage"]["completion_tokens"] for u in unset] == [5, 5]
    greedy = chat(temperature=0, max_tokens=5)["choices"][0]["message"]["content"]
    assert [u["choices"][0]["message"]["content"] for u in unset] == [greedy, greedy]
    assert chat(max_tokens=7)["usage"]["completion_tokens"] == 7
    hot = {chat(temperature=2.0, seed=s)["choices"][0]["message"]["content"] for s in range(4)}
    assert len(hot) > 1  # the request's own temperature


def test_include_stop_str_in_output_and_skip_special_tokens(client, model_name, tokenizer):
    kw = dict(model=model_name, prompt="def main():", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(**kw).choices[0].text
    stop = free[5:7]  # text the greedy output writes
    cut = client.completions.create(**kw, stop=[stop]).choices[0].text
    kept = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                                     stop=[stop]).choices[0].text
    assert kept == cut + stop and free.startswith(kept)
    eos = sorted(tokenizer.eos_token_ids)[0]
    forced = dict(model=model_name, prompt="x", max_tokens=3, logit_bias={str(eos): 100})
    hidden = client.completions.create(**forced, extra_body={"ignore_eos": True}).choices[0].text
    shown = client.completions.create(**forced, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert hidden == "" and shown.choices[0].text == 3 * tokenizer.decode([eos], skip_special_tokens=False) != ""


def _post(server, endpoint: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, server, model_name, tokenizer):
    """The request is answered as if its prompt were its last k tokens: same text, same log-probabilities, the echo of
    those tokens, usage counting them; each prompt of a batch is cut; -1 keeps what the context leaves."""
    prompt = "def main():\n    total = 0\n    for i in range(10):\n"
    ids = tokenizer.encode(prompt)
    kw = dict(model=model_name, max_tokens=4, temperature=0, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    cut = client.completions.create(prompt=prompt, **{**kw, "extra_body": {"ignore_eos": True,
                                                                            "truncate_prompt_tokens": 5}})
    alone = client.completions.create(prompt=ids[-5:], **kw)
    assert len(ids) > 5 and cut.usage.prompt_tokens == 5 == alone.usage.prompt_tokens
    assert cut.choices[0].text == alone.choices[0].text
    assert cut.choices[0].text.startswith(tokenizer.decode(ids[-5:])) and not cut.choices[0].text.startswith("def")
    assert cut.choices[0].logprobs.tokens == alone.choices[0].logprobs.tokens
    assert cut.choices[0].logprobs.token_logprobs == alone.choices[0].logprobs.token_logprobs
    whole = client.completions.create(prompt=prompt, **{**kw, "extra_body": {"ignore_eos": True,
                                                                              "truncate_prompt_tokens": 500}})
    assert whole.usage.prompt_tokens == len(ids) and whole.choices[0].text.startswith(prompt)  # not cut: as sent
    other = "import os\nimport sys\nprint(os.getcwd())\n"
    batch = client.completions.create(prompt=[prompt, other], **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 3}})
    singles = [client.completions.create(prompt=p[-3:], **kw) for p in (ids, tokenizer.encode(other))]
    assert batch.usage.prompt_tokens == 6
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [s.choices[0].text for s in singles]
    long = "word " * 600  # over the context of 512 tokens
    body = {"model": model_name, "prompt": long, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 400
    fitted = _post(server, "completions", {**body, "truncate_prompt_tokens": -1})
    assert fitted["usage"]["prompt_tokens"] == 512 - 4 and fitted["usage"]["completion_tokens"] == 4
    # vLLM's truncation_side: right keeps the first tokens (left, the default, the last)
    first = client.completions.create(prompt=prompt, **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 5, "truncation_side": "right"}})
    head = client.completions.create(prompt=ids[:5], **kw)
    assert first.choices[0].text == head.choices[0].text and first.choices[0].text.startswith("def")
    last = client.completions.create(prompt=prompt, **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 5, "truncation_side": "left"}})
    assert last.choices[0].text == cut.choices[0].text
    wrong = httpx.post(server.url + "/v1/completions", json={**body, "truncation_side": "middle"}, timeout=60)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "truncation_side"


def test_truncate_prompt_tokens_in_chat_cuts_the_rendered_prompt(client, server, model_name):
    messages = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital?"}]
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    kw = dict(model=model_name, max_tokens=5, temperature=0)
    out = client.chat.completions.create(messages=messages, **kw, extra_body={"ignore_eos": True,
                                                                               "truncate_prompt_tokens": 6})
    alone = client.completions.create(prompt=rendered[-6:], **kw, extra_body={"ignore_eos": True})
    assert len(rendered) > 6 and out.usage.prompt_tokens == 6
    assert out.choices[0].message.content == alone.choices[0].text
    fitted = client.chat.completions.create(messages=[{"role": "user", "content": "word " * 600}], **kw,
                                            extra_body={"ignore_eos": True, "truncate_prompt_tokens": -1})
    assert fitted.usage.prompt_tokens == 512 - 5 and fitted.usage.completion_tokens == 5


def test_return_tokens_as_token_ids(client, server, model_name, tokenizer):
    """Tokens in log-probabilities are 'token_id:<id>' (the text offsets and chat's bytes stay the text's), with the
    same values as the text-named ones."""
    prompt = "def main():"
    ids = tokenizer.encode(prompt)
    kw = dict(model=model_name, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    plain = _post(server, "completions", {**kw, "ignore_eos": True})["choices"][0]["logprobs"]
    named = _post(server, "completions", {**kw, "ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = named["choices"][0]["logprobs"]
    out_ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert all(t.startswith("token_id:") for t in lp["tokens"]) and out_ids[:len(ids)] == ids
    assert [tokenizer.decode([t], skip_special_tokens=False) for t in out_ids] == plain["tokens"]
    assert named["choices"][0]["text"] == prompt + "".join(plain["tokens"][len(ids):])
    assert lp["token_logprobs"] == plain["token_logprobs"] and lp["text_offset"] == plain["text_offset"]
    for tops, plain_tops in zip(lp["top_logprobs"][1:], plain["top_logprobs"][1:]):
        assert all(k.startswith("token_id:") for k in tops)
        assert sorted(tops.values()) == pytest.approx(sorted(plain_tops.values()))
    streamed = client.completions.create(**{**kw, "echo": False}, stream=True,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    tokens = [t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == lp["tokens"][len(ids):]
    chat = dict(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
                logprobs=True, top_logprobs=2, ignore_eos=True)
    text_named = _post(server, "chat/completions", chat)["choices"][0]["logprobs"]["content"]
    id_named = _post(server, "chat/completions", {**chat, "return_tokens_as_token_ids": True})
    content = id_named["choices"][0]["logprobs"]["content"]
    assert len(content) == len(text_named) == 4
    for entry, plain_entry in zip(content, text_named):
        token_id = int(entry["token"].removeprefix("token_id:"))
        assert tokenizer.decode([token_id], skip_special_tokens=False) == plain_entry["token"]
        assert entry["bytes"] == plain_entry["bytes"] == list(plain_entry["token"].encode())
        assert entry["logprob"] == pytest.approx(plain_entry["logprob"])
        assert [t["token"].startswith("token_id:") for t in entry["top_logprobs"]] == [True, True]
        assert [t["bytes"] for t in entry["top_logprobs"]] == [t["bytes"] for t in plain_entry["top_logprobs"]]


def test_prompt_logprobs_as_vllm_returns_them(client, server, model_name, tokenizer):
    """vLLM's shape: null for the first prompt token, then {token id: {logprob, rank, decoded_token}} of the token and
    the top alternatives; the numbers are echo + logprobs' numbers; chat puts them on the response."""
    prompt = "def main():\n    return"
    ids = tokenizer.encode(prompt)
    body = {"model": model_name, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    out = _post(server, "completions", {**body, "echo": True, "logprobs": 2, "prompt_logprobs": 2})
    choice = out["choices"][0]
    pl, echo = choice["prompt_logprobs"], choice["logprobs"]
    assert len(pl) == len(ids) == out["usage"]["prompt_tokens"] and pl[0] is None
    for i, entry in enumerate(pl[1:], start=1):
        actual = entry[str(ids[i])]
        assert actual["logprob"] == echo["token_logprobs"][i] and actual["rank"] >= 1
        assert actual["decoded_token"] == tokenizer.decode([ids[i]], skip_special_tokens=False)
        assert list(entry)[0] == str(ids[i]) and len(entry) in (2, 3)  # the token first, then the top 2
        top = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] <= 2)
        assert [rank for rank, _ in top] == [1, 2]
        assert sorted(echo["top_logprobs"][i].values()) == sorted(v["logprob"] for v in entry.values())
    only = _post(server, "completions", {**body, "prompt_logprobs": 0, "n": 2})
    for c in only["choices"]:
        assert c["prompt_logprobs"][0] is None
        assert [list(e) for e in c["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
        assert [e[str(t)]["logprob"] for e, t in zip(c["prompt_logprobs"][1:], ids[1:])] == \
            echo["token_logprobs"][1:len(ids)]
    assert _post(server, "completions", body)["choices"][0]["prompt_logprobs"] is None
    cut = _post(server, "completions", {**body, "prompt_logprobs": 1, "truncate_prompt_tokens": 4})
    assert len(cut["choices"][0]["prompt_logprobs"]) == 4 == cut["usage"]["prompt_tokens"]
    one = _post(server, "completions", {**body, "prompt": ids[:1], "prompt_logprobs": 1, "echo": True,
                                        "logprobs": 1})["choices"][0]
    assert one["prompt_logprobs"] == [None] and one["logprobs"]["token_logprobs"][0] is None
    messages = [{"role": "user", "content": "hi"}]
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    chat = _post(server, "chat/completions", {**{k: v for k, v in body.items() if k != "prompt"},
                                              "messages": messages, "prompt_logprobs": 1})
    as_completion = _post(server, "completions", {**body, "prompt": rendered, "prompt_logprobs": 1})
    assert len(chat["prompt_logprobs"]) == len(rendered) == chat["usage"]["prompt_tokens"]
    assert [list(e) if e else e for e in chat["prompt_logprobs"]] == \
        [list(e) if e else e for e in as_completion["choices"][0]["prompt_logprobs"]]
    for mine, theirs in zip(chat["prompt_logprobs"][1:], as_completion["choices"][0]["prompt_logprobs"][1:]):
        assert [v["logprob"] for v in mine.values()] == pytest.approx([v["logprob"] for v in theirs.values()],
                                                                      abs=1e-4)
    assert _post(server, "chat/completions", {"model": model_name, "messages": messages,
                                              "max_tokens": 2})["prompt_logprobs"] is None
    streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True, "prompt_logprobs": 0})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")  # 0 streams, as vLLM
    assert "prompt_logprobs" not in streamed.text


def test_priority_zero_is_accepted_and_others_refused(server, model_name):
    for endpoint, base in (("completions", {"prompt": "hi"}), ("chat/completions", {
            "messages": [{"role": "user", "content": "hi"}]})):
        body = {"model": model_name, "max_tokens": 2, **base}
        assert _post(server, endpoint, {**body, "priority": 0})["usage"]["completion_tokens"] >= 1
        for value in (1, -1):
            response = httpx.post(f"{server.url}/v1/{endpoint}", json={**body, "priority": value}, timeout=60)
            assert response.status_code == 400 and response.json()["error"]["param"] == "priority", response.text
            assert "first come, first served" in response.json()["error"]["message"]


@pytest.mark.parametrize("extra, param, code", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "invalid_value"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "invalid_value"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens", "invalid_value"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens", "invalid_value"),
    ({"truncate_prompt_tokens": 513}, "truncate_prompt_tokens", "context_length_exceeded"),  # over max_model_len
    ({"prompt_logprobs": -1}, "prompt_logprobs", "invalid_value"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "invalid_value"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs", "invalid_value"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "conflicting_fields"),
    ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids", "invalid_value"),
    ({"priority": 2.5}, "priority", "invalid_value"),
])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_bad_vllm_extension_values_are_refused_naming_the_field(server, model_name, endpoint, extra, param, code):
    base = {"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": model_name, "max_tokens": 2, **base, **extra},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert param in error["message"]
