"""The app as browsers and proxies meet it, in process (the routes answer 503 while no model is loaded, which is
enough here): CORS as `vllm serve` applies it (--allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials), --root-path behind the API key, and --disable-fastapi-docs."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from appliance.config import Config
from appliance.errors import ConfigError
from appliance.server.api import create_app

PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def call(cfg: Config, method: str, path: str, **kw) -> httpx.Response:
    app = create_app(cfg)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


def test_preflight_and_responses_carry_cors_headers_by_default():
    cfg = Config.flat(api_key="sk-1")
    preflight = call(cfg, "OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200, preflight.text  # answered before the API key is asked for
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    refused = call(cfg, "POST", "/v1/completions", json={}, headers={"Origin": "https://app.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert call(Config.flat(), "GET", "/health", headers={"Origin": "https://x"}).headers[
        "access-control-allow-origin"] == "*"


def test_allowed_origins_and_credentials():
    cfg = Config.flat(allowed_origins='["https://app.example"]', allowed_methods='["GET", "POST"]',
                      allow_credentials=True)
    allowed = call(cfg, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    other = call(cfg, "OPTIONS", "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in call(cfg, "GET", "/health",
                                                     headers={"Origin": "https://evil.example"}).headers


@pytest.mark.parametrize("flag, text, words", [
    ("allowed_origins", "[https://app.example]", "--allowed-origins: cannot read '[https://app.example]' as JSON"),
    ("allowed_methods", '"GET"', "--allowed-methods: '\"GET\"' is not a JSON list of strings"),
    ("allowed_headers", "[1]", "--allowed-headers: '[1]' is not a JSON list of strings"),
])
def test_a_malformed_list_names_its_flag(flag, text, words):
    with pytest.raises(ConfigError) as err:
        Config.flat(**{flag: text})
    assert words in str(err.value)


def test_root_path_routes_stay_behind_the_api_key():
    cfg = Config.flat(api_key="sk-1", root_path="/llm")
    for path in ("/llm/v1/models", "/v1/models"):
        assert call(cfg, "GET", path).status_code == 401, path
        assert call(cfg, "GET", path, headers={"Authorization": "Bearer sk-1"}).status_code == 503, path  # loading
    assert call(cfg, "GET", "/llm/health").status_code == 200
    assert call(cfg, "GET", "/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_fastapi_docs_can_be_turned_off():
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert call(Config.flat(), "GET", path).status_code == 200, path
        assert call(Config.flat(disable_fastapi_docs=True), "GET", path).status_code == 404, path
