"""What vLLM users' clients and dashboards rely on, against a real `muxd serve`: vLLM's metric names, usage on every
chunk, /tokenize, /detokenize, /version."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.server.metrics import VLLM_ITL_BUCKETS, VLLM_TTFT_BUCKETS


@pytest.fixture(scope="module")
def server(serve):
    return serve("--kv-cache-memory", "64MiB", "--max-model-len", "512")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


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


def test_continuous_usage_false_is_accepted(server, model_name):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": False}}
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    assert events and all("usage" not in e for e in events)
