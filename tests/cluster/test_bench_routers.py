"""`muxd bench --routers`: a `muxd cluster` per router, started the way `--policies` starts `muxd serve` (no Ray
here: the command lines and labels only; scripts/compare_routers.py runs them for docs/PERFORMANCE.md)."""
from __future__ import annotations

from appliance.bench.launcher import ROUTERS, ServerProcess
from appliance.bench.run import BenchOptions, Session, variants
from appliance.cluster import settings


def test_bench_knows_the_cluster_routers():
    assert ROUTERS == settings.ROUTERS


def test_a_router_starts_muxd_cluster_with_its_flags(tmp_path):
    server = ServerProcess("embedded", None, ["--max-num-seqs", "4"], log_dir=tmp_path, router="pow2",
                           cluster_args=["--replicas", "3"])
    args = server.args[3:]
    assert args[:5] == ["cluster", "--router", "pow2", "--replicas", "3"]
    assert args[5:] == ["--port", str(server.port), "--model", "embedded", "--max-num-seqs", "4", "--log-level",
                        "warning"]
    assert server.log.name == "server-router-pow2.log" and server.stop_timeout > 20
    plain = ServerProcess("embedded", "serial", log_dir=tmp_path)
    assert plain.args[3] == "serve" and "--router" not in plain.args and plain.log.name == "server-serial.log"


def test_every_policy_meets_every_router():
    opts = BenchOptions(policies=["serial", "chunked"], routers=["slo", "pow2"])
    assert variants(opts) == [("serial", "slo"), ("serial", "pow2"), ("chunked", "slo"), ("chunked", "pow2")]
    assert variants(BenchOptions()) == [(None, None)]
    sessions = [Session(BenchOptions(routers=["slo"]), None, "slo"), Session(BenchOptions(), "serial", "pow2")]
    assert [s.label for s in sessions] == ["router slo", "serial router pow2"]
    for s in sessions:
        s.loop.close()  # never entered: nothing else to stop
