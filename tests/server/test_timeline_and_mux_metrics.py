"""The executor's timeline over HTTP (GET /debug/timeline) and at shutdown (--trace-dir), and the multiplexing
series in /metrics."""
from __future__ import annotations

import httpx


def test_timeline_endpoint_mux_metrics_and_the_timeline_at_shutdown(request, tmp_path):
    """GET /debug/timeline and the multiplexing series while serving; with --trace-dir the timeline is also written
    when the server stops (SIGTERM)."""
    import json
    import signal

    from live_server import ServerProcess

    server = ServerProcess(["--model", request.config.getoption("--serve-model"), "--planner", "layerwise",
                            "--trace-dir", str(tmp_path / "traces")], tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"model": "muxd-embedded", "prompt": "def main():", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        trace = httpx.get(server.url + "/debug/timeline").json()
        names = {e["name"] for e in trace["traceEvents"]}
        assert {"decode", "prefill launch"} <= names
        metrics = server.metrics()
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=60)
    assert metrics["muxd:decode_sms"] == 0  # CPU: the null partition
    assert metrics["muxd:prefill_layers_launched_total"] >= 4  # layerwise: a layer a step, 4 layers
    assert "muxd:partition_switches_total" in metrics
    # garbage collections of the server process, by generation (start-up objects are frozen: full ones stay rare)
    assert all(f'muxd:gc_collections_total{{generation="{g}"}}' in metrics for g in "012")
    assert metrics['muxd:gc_pause_seconds_total{generation="0"}'] >= 0
    # the engine thread and the event loop each ran Python for this request (their share of one interpreter)
    assert metrics['muxd:thread_cpu_seconds_total{thread="engine"}'] > 0
    assert metrics['muxd:thread_cpu_seconds_total{thread="event_loop"}'] > 0
    [saved] = list((tmp_path / "traces").glob("timeline-*.json"))
    assert any(e["name"] == "decode" for e in json.loads(saved.read_text())["traceEvents"])


def test_the_closed_loop_state_is_in_metrics(serve):
    """mux: the planning headroom of each SLO class and metric, from the first request on."""
    server = serve("--policy", "mux")
    body = {"model": "muxd-embedded", "prompt": "def main():", "max_tokens": 6, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    metrics = server.metrics()
    tbt = metrics['muxd:slo_planning_headroom{metric="tbt",slo_class="default"}']
    ttft = metrics['muxd:slo_planning_headroom{metric="ttft",slo_class="default"}']
    assert 0.3 <= tbt <= 1.0 and 0.5 <= ttft <= 1.0
