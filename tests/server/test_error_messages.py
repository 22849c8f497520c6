"""The 400 message pydantic's errors become: one reason per field, the one that explains the value sent."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from appliance.server.errors import validation_error
from appliance.server.protocol import bodies_for
from appliance.server.responses_api import responses_body

COMPLETION, CHAT = bodies_for(1000, ["default"])


def _error(body: type, data: dict) -> dict:
    with pytest.raises(ValidationError) as info:
        body.model_validate(data)
    response = validation_error(info.value.errors())
    assert response.status_code == 400
    return json.loads(response.body)["error"]


def test_a_union_names_the_member_whose_type_the_value_has():
    """An empty input list is a list too short, not a string expected (the union's first member)."""
    error = _error(responses_body(CHAT), {"input": []})
    assert error["param"] == "input" and "at least 1 item" in error["message"], error
    assert "valid string" not in error["message"]


def test_the_value_is_quoted_once():
    error = _error(COMPLETION, {"prompt": 5})
    assert error["param"] == "prompt" and error["message"].count("got 5") == 1, error
