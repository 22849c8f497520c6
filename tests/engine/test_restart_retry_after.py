"""A request met by an engine rebuild is told when to come back: its 503 carries a Retry-After of the seconds the
rebuild likely has left (the last rebuild's time, else the failed engine's build), at most 60 s, which clients such
as OpenAI's SDK honour; before, every such 503 said "a few seconds" (5 s) where an 8B's rebuild takes 46-49 s."""
from __future__ import annotations

import time

import pytest

from appliance.config import Config
from appliance.engine.async_engine import MAX_RETRY_AFTER_S, RESTARTING, AsyncEngine
from appliance.engine.factory import build_engine
from appliance.errors import UnavailableError
from appliance.server.errors import response_for


@pytest.fixture(scope="module")
def aengine(llama_checkpoint):
    path, _ = llama_checkpoint
    return AsyncEngine(build_engine(Config.flat(model=str(path), num_gpu_blocks_override=64)))


def restarting_for(aengine: AsyncEngine, seconds: float) -> UnavailableError:
    aengine.restarting, aengine._restart_began = True, time.monotonic() - seconds
    try:
        with pytest.raises(UnavailableError) as caught:
            aengine.check_open()
    finally:
        aengine.restarting = False
    assert caught.value.code == RESTARTING
    return caught.value


def test_the_wait_counts_down_from_the_engines_build_time(aengine):
    assert aengine.engine.startup["build_s"] > 0  # measured by build_engine
    aengine.engine.startup["build_s"] = 40.0
    aengine._rebuild_s = None
    error = restarting_for(aengine, 10.0)
    assert 29.0 <= error.retry_after <= 30.0 and "retry in about 30 s" in str(error)
    response = response_for(error)
    assert response.status_code == 503 and response.headers["Retry-After"] in ("30", "29")


def test_the_last_rebuild_time_is_the_better_guess_and_the_wait_is_capped(aengine):
    aengine.engine.startup["build_s"] = 90.0  # a first start compiles: a rebuild with a warm cache is shorter
    aengine._rebuild_s = None
    assert restarting_for(aengine, 0.0).retry_after == MAX_RETRY_AFTER_S
    aengine._rebuild_s = 12.0
    assert 11.0 <= restarting_for(aengine, 0.5).retry_after <= 11.5
    overdue = restarting_for(aengine, 30.0)  # longer than expected: come back soon
    assert overdue.retry_after == 5.0 and response_for(overdue).headers["Retry-After"] == "5"


def test_without_a_measured_build_the_503_keeps_the_default_wait(aengine):
    aengine.engine.startup.pop("build_s", None)
    aengine._rebuild_s = None
    error = restarting_for(aengine, 1.0)
    assert error.retry_after is None and "retry in a few seconds" in str(error)
    assert response_for(error).headers["Retry-After"] == "5"
