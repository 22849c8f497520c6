"""Caps on what one request can make the engine check on every token: stop strings (count and length), stop token
ids, logit_bias entries; each refused with a 400 naming the field (in the body schema and in the engine's own
checks, for requests that do not come over HTTP)."""
from __future__ import annotations

import json

import pytest

from appliance.engine.request import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from appliance.errors import RequestError
from appliance.server.errors import validation_error
from appliance.server.protocol import bodies_for

COMPLETION, CHAT = bodies_for(1000, ["default"])


@pytest.mark.parametrize("extra, param, words", [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", f"at most {MAX_STOP_STRINGS}"),
    ({"stop": ["x"] * 10**6}, "stop", f"holds 1000000 strings; at most {MAX_STOP_STRINGS}"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop", f"at most {MAX_STOP_CHARS} characters"),
    ({"stop": ["ok", "x" * (MAX_STOP_CHARS + 1)]}, "stop.1", f"at most {MAX_STOP_CHARS} characters"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} items"),
    ({"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias",
     f"at most {MAX_LOGIT_BIAS} items"),
])
@pytest.mark.parametrize("body", [COMPLETION, CHAT], ids=["completions", "chat"])
def test_over_the_cap_is_a_400_naming_the_field(body, extra, param, words):
    base = {"prompt": "x"} if body is COMPLETION else {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(Exception) as info:
        body.model_validate({**base, **extra})
    response = validation_error(info.value.errors())
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"], error


def test_at_the_cap_is_accepted():
    body = COMPLETION.model_validate({"prompt": "x", "stop": ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
                                      "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS})
    body.sampling_params(4).validate()


@pytest.mark.parametrize("params, param", [
    (SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop"),
    (SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
])
def test_the_engine_checks_the_caps_itself(params, param):
    with pytest.raises(RequestError) as info:
        params.validate()
    assert info.value.param == param and "at most" in str(info.value)
