"""Beam search (vLLM's use_beam_search) on the embedded model in process: a beam of width 1 is greedy decoding, the
n beams are distinct, ranked by length-penalised log-probability, and each one's log-probability is the model's
likelihood of its tokens; streamed as answered; what it cannot honour is a 400 naming the field; no page is left
held."""
from __future__ import annotations

import json
import math

import pytest

from appliance.config import Config
from in_process import ready_app

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client():
    with ready_app(Config.flat(kv_cache_memory="64MiB", max_model_len=512)) as client:
        yield client


def _post(client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_beam_of_width_one_is_greedy_decoding(client):
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    greedy = _post(client, "/v1/completions", {**body, "temperature": 0})["choices"][0]
    beam = _post(client, "/v1/completions", {**body, "use_beam_search": True})["choices"][0]
    assert beam["token_ids"] == greedy["token_ids"] and beam["text"] == greedy["text"]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beams_are_distinct_ranked_and_scored_by_the_models_likelihood(client, length_penalty):
    out = _post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "n": 4, "use_beam_search": True,
                                            "length_penalty": length_penalty, "logprobs": 1,
                                            "return_token_ids": True, "include_stop_str_in_output": True})
    prompt_ids = out["choices"][0]["prompt_token_ids"]
    beams = [(c["token_ids"], sum(c["logprobs"]["token_logprobs"]), c["finish_reason"]) for c in out["choices"]]
    assert len(beams) == 4 and len({tuple(ids) for ids, _, _ in beams}) == 4
    eos = {ids[-1] for ids, _, reason in beams if reason == "stop"}
    scores = [logprob / (len(prompt_ids) + len(ids) - (ids[-1] in eos)) ** length_penalty
              for ids, logprob, _ in beams]
    assert scores == sorted(scores, reverse=True)
    assert out["usage"]["completion_tokens"] == sum(len(ids) for ids, _, _ in beams)
    for ids, logprob, _ in beams:  # the model's own log-likelihood of the beam's tokens after the prompt
        scored = _post(client, "/v1/completions", {"prompt": prompt_ids + ids, "max_tokens": 1,
                                                   "prompt_logprobs": 0})["choices"][0]["prompt_logprobs"]
        likelihood = sum(entry[str(t)]["logprob"] for entry, t in zip(scored[len(prompt_ids):], ids))
        assert math.isclose(likelihood, logprob, abs_tol=1e-3 * len(ids)), (likelihood, logprob)


def test_beam_search_streams_its_beams_and_chat_takes_it(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "n": 2, "use_beam_search": True}
    whole = _post(client, "/v1/chat/completions", body)
    texts = {0: "", 1: ""}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["delta"].get("content") or ""
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert all(c["message"]["content"] for c in whole["choices"])


@pytest.mark.parametrize("extra, param", [
    ({"n": 11}, "n"),
    ({"stop": ["x"]}, "stop"),
    ({"best_of": 3, "n": 2}, "best_of"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_what_beam_search_cannot_honour_is_refused_by_name(client, extra, param):
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "use_beam_search": True,
                                                     **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert response.json()["error"]["code"] == "conflicting_fields"  # (each field alone is valid)


def test_beams_are_counted_as_finished_choices(client):
    from prometheus_client.parser import text_string_to_metric_families

    def successes() -> float:
        families = text_string_to_metric_families(client.get("/metrics").text)
        return sum(s.value for f in families if f.name == "vllm:request_success" for s in f.samples
                   if s.name.endswith("_total"))

    before = successes()
    _post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 3, "use_beam_search": True})
    assert successes() == before + 3


def test_a_server_reporting_logits_refuses_beam_search():
    with ready_app(Config.flat(kv_cache_memory="16MiB", max_model_len=256, logprobs_mode="raw_logits")) as logits:
        response = logits.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "use_beam_search": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "use_beam_search", response.text
    assert "--logprobs-mode raw_logits" in response.json()["error"]["message"]


def test_no_page_is_left_held(client):
    _post(client, "/v1/completions", {"prompt": [PROMPT, "another prompt"], "max_tokens": 6, "n": 3,
                                      "use_beam_search": True})
    engine = client.app.state.muxd.engine.engine
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_a_client_that_leaves_ends_its_search_and_frees_every_page():
    """A client gone mid-search (its read timed out): the search stops at once, its engine requests end, no page
    stays held, and the server answers the next request."""
    import threading
    import time

    import httpx
    import uvicorn
    from live_server import free_port

    from appliance.bench.launcher import wait_until_ready
    from appliance.server.api import create_app

    app = create_app(Config.flat(kv_cache_memory="64MiB", max_model_len=512))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, None, 120, lambda: "")
        engine = app.state.muxd.engine.engine
        steps = []
        step = engine.step
        engine.step = lambda: steps.append(1) or step()
        long = {"prompt": PROMPT, "max_tokens": 400, "n": 4, "use_beam_search": True, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=long, timeout=httpx.Timeout(60, read=0.5))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the engine has had nothing to do for half a second
            before = len(steps)
            time.sleep(0.5)
            if not engine.has_unfinished() and len(steps) == before:
                break
        assert not engine.has_unfinished()
        assert len(steps) < 400  # a whole search takes at least an engine step for each of its 400 tokens
        assert engine.pool.num_free_pages == engine.pool.num_pages
        after = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    finally:
        server.should_exit = True
        thread.join(30)
