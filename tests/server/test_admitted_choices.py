"""Work a request was admitted for is never refused later for load: with n > 1 sharing its prompt's prefill, the
other choices (submitted once the first one's prompt is cached) and a beam search's later steps pass a full waiting
queue, where a new request gets the 429 (here: one seat, one queue place)."""
from __future__ import annotations

import pytest

from appliance.config import Config
from in_process import ready_app


@pytest.fixture(scope="module")
def client():
    with ready_app(Config.flat(kv_cache_memory="64MiB", max_model_len=512, max_num_seqs=1, max_waiting=1)) as client:
        yield client


@pytest.mark.parametrize("extra", [{"n": 4}, {"n": 3, "use_beam_search": True}])
@pytest.mark.parametrize("stream", [False, True])
def test_an_admitted_request_ends_whole_on_a_server_with_one_seat(client, extra, stream):
    body = {"prompt": "The capital of France is", "max_tokens": 5, "ignore_eos": True, "stream": stream, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), response.text
        indices = {int(e.split('"index":')[1].split(",")[0]) for e in events[:-1] if '"index":' in e}
        assert indices == set(range(body["n"]))
    else:
        choices = response.json()["choices"]
        assert len(choices) == body["n"] and all(c["finish_reason"] == "length" for c in choices)
    assert client.get("/load").status_code == 200
