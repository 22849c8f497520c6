"""`--served-model-name a b` (as vLLM's): every name is an alias of the one model, in process. /v1/models lists them
all, a request may send any, its response names the one it sent (the first when it sent none); a model given by path
is also accepted under the path as written (vLLM's default name)."""
from __future__ import annotations

import pytest

from appliance.config import Config
from appliance.errors import ConfigError
from in_process import ready_app


def test_several_names_are_aliases_of_the_model():
    cfg = Config.flat(served_model_name=["first", "org/second"], kv_cache_memory="16MiB", max_model_len=128)
    with ready_app(cfg) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards] == [("first", "first", None),
                                                                        ("org/second", "first", None)]
        assert client.get("/v1/models/org/second").json()["id"] == "org/second"
        body = {"prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json={**body, "model": "org/second"}).json()["model"] == "org/second"
        assert client.post("/v1/completions", json=body).json()["model"] == "first"
        chat = client.post("/v1/chat/completions", json={"model": "first", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert chat.json()["model"] == "first"
        unknown = client.post("/v1/completions", json={**body, "model": "third"})
        assert unknown.status_code == 404
        message = unknown.json()["error"]["message"]
        assert "'third' does not exist; this server serves 'first' or 'org/second'" in message


def test_a_model_given_by_path_also_answers_to_the_path(text_checkpoint):
    model = Config.flat(model=str(text_checkpoint)).model
    assert model.served_names == (text_checkpoint.name,)  # listed under its directory's name, as before
    assert model.accepted_names == (text_checkpoint.name, str(text_checkpoint))
    named = Config.flat(model=str(text_checkpoint), served_model_name="mine").model
    assert named.served_names == named.accepted_names == ("mine",)  # a name given replaces both


@pytest.mark.parametrize("names", [[""], ["a", " "]])
def test_an_empty_name_is_refused(names):
    with pytest.raises(ConfigError, match="--served-model-name: every name must be non-empty text"):
        Config.flat(served_model_name=names)
