"""The OpenAPI document tells the truth (400 with the error body, never 422; /metrics is Prometheus text; streams are
event streams), and a bounded schemathesis run with all of its checks finds nothing against a real server."""
from __future__ import annotations

import json

import httpx
import pytest
import reliability


@pytest.fixture(scope="module")
def server(serve):
    return serve(*reliability.SCHEMATHESIS_FLAGS)


def test_the_schema_documents_what_the_server_sends(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in schema["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "404", "413", "429", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
        assert "Retry-After" in responses["429"]["headers"] and "Retry-After" in responses["503"]["headers"]
        assert "itemSchema" in responses["200"]["content"]["text/event-stream"]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert httpx.get(server.url + "/metrics").headers["content-type"] == list(metrics)[0]
    prompt = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert {"type": "integer", "minimum": 0, "maximum": 4095} in [branch.get("items") for branch in prompt["anyOf"]]
    slo_class = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["slo_class"]
    assert slo_class["enum"] == ["default", None]  # the one class of the default contract


def test_bounded_schemathesis_run_finds_no_failure(server):
    figures = reliability.schemathesis_run(server, examples=8, phases="fuzzing", max_response_time=120)
    assert figures["exit_code"] == 0 and figures["failures"] == {} and not figures["errors"], figures
    assert figures["operations_tested"] == 16 and figures["test_cases"] >= 16


def test_schemathesis_coverage_phase_finds_no_failure(server):
    """The coverage phase walks each field's edges (wrong types, values past the bounds, empty values, methods an
    operation lacks) rather than sampling: it found a 500 that sampling had not (a response_format whose type was an
    object). Its invalid cases, every one on every operation; valid data is the sampled run's above (the coverage
    phase's valid cases, about 1,600, take longer than its 2,600 invalid ones: `scripts/reliability.py schemathesis`
    runs them)."""
    figures = reliability.schemathesis_run(server, examples=8, phases="coverage", mode="negative",
                                           max_response_time=120)
    assert figures["exit_code"] == 0 and figures["failures"] == {} and not figures["errors"], figures
    assert figures["operations_tested"] == 16 and figures["test_cases"] >= 1000


def test_each_operation_has_its_own_id_and_a_405_lists_every_method():
    """/ping serves GET and POST as one route: the document gives each method its own operation ID (FastAPI would
    give both one, which OpenAPI forbids, and warn), and the route still answers other methods with both in Allow."""
    import warnings

    from fastapi.testclient import TestClient

    from appliance.config import Config
    from appliance.server.api import create_app

    cfg = Config.flat(model="embedded")
    cfg.check()
    app = create_app(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI's "Duplicate Operation ID" warning fails the test
        schema = app.openapi()
    ids = [op["operationId"] for item in schema["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
    assert {m: op["operationId"] for m, op in schema["paths"]["/ping"].items()} == {"get": "ping_get",
                                                                                      "post": "ping_post"}
    response = TestClient(app).options("/ping")
    assert response.status_code == 405 and set(response.headers["allow"].split(", ")) == {"GET", "POST"}  # any order
