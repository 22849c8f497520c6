"""The soak test (scripts/soak.py) in small: mixed traffic (streams, cancellations, requests with stateful features,
malformed requests, bursts) for a few seconds; no 5xx, and afterwards the KV pool, the open file descriptors and
(within allocator slack) the resident memory are back where they were. docs/RELIABILITY.md has the 30-minute run."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from soak import SOAK_FLAGS, soak  # noqa: E402


def test_mixed_traffic_leaves_nothing_behind(serve):
    server = serve(*SOAK_FLAGS)
    figures = soak(server, seconds=6, windows=2, burst_every_s=2, burst_size=20, sample_every_s=3)
    statuses = figures["by_status"]
    assert figures["server_errors_5xx"] == 0, figures["by_kind_and_status"]
    assert set(figures["probe_statuses"]) <= {200, 429}, figures["probe_statuses"]  # a burst may fill every place
    assert set(statuses) <= {200, 400, 429}, statuses
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0  # it served, and refused what was malformed
    kinds = figures["by_kind_and_status"]
    assert kinds.get("featured 200", 0) > 0 and "featured 400" not in kinds, kinds  # every feature's request is valid
    assert figures["leaked_kv_pages"] == 0 and figures["after"]["running"] == 0
    assert figures["leaked_fds"] <= 0, (figures["before"], figures["after"])
    assert figures["rss_growth_mib"] < 64, figures["samples"]
