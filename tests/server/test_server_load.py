"""vLLM's /load, in process: with --enable-server-load-tracking it answers the requests in flight on /v1 and
/invocations (the count the gate keeps and shutdown waits for), without it 0, as vLLM's does."""
from __future__ import annotations

import pytest

from appliance.config import Config
from in_process import ready_app


@pytest.mark.parametrize("tracking", [True, False])
def test_load_is_the_requests_in_flight_with_tracking_and_zero_without(tracking):
    cfg = Config.flat(kv_cache_memory="16MiB", max_model_len=128, enable_server_load_tracking=tracking)
    with ready_app(cfg) as client:
        assert client.get("/load").json() == {"server_load": 0}
        traffic = client.app.state.muxd.traffic
        traffic.enter()
        traffic.enter()  # two requests being served
        assert client.get("/load").json() == {"server_load": 2 if tracking else 0}
        traffic.leave()
        traffic.leave()
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert answer.status_code == 200
        assert client.get("/load").json() == {"server_load": 0}  # a request answered is no longer counted
