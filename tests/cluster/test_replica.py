"""Engine replicas in this process behind the ingress, routed by the SLO scorer (no Ray): the single server's
answers through the cluster path, what a replica reports, a client that leaves aborts its request, an engine that
stops fails the health check."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from appliance.cluster import asgi
from appliance.cluster.ingress import REPLICA_HEADER, create_ingress_app
from appliance.cluster.replica import EngineReplica
from appliance.cluster.scoring import ReplicaReport, Scorer
from appliance.cluster.settings import ClusterSettings, engine_values
from appliance.config import Config

PREFIX = "Summarise the following report in one line. " * 30


class InProcess:
    """The Ray backend's part, in process: rank the replicas by their reports, stream from the best."""

    def __init__(self, replicas: list[EngineReplica]) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.scorer = Scorer()

    async def open(self, request, hints):
        reports = [ReplicaReport.from_stats(r.record_routing_stats()) for r in self.replicas.values()]
        best = self.scorer.rank(reports, hints)[0].replica
        self.scorer.sent(best, hints)
        async for message in self.replicas[best].generate(request, hints.to_dict()):
            yield message

    async def ready(self):
        return True


async def _scenario() -> None:
    config = Config.flat(max_num_seqs=4, api_key="k")
    replicas = [await EngineReplica.start(engine_values(config), f"r{i}") for i in range(2)]
    try:
        app = create_ingress_app(InProcess(replicas), ClusterSettings(), config, InProcess(replicas).ready)
        auth = {"Authorization": "Bearer k"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://i") as client:
            assert (await client.get("/v1/models")).status_code == 401  # the ingress checks the key
            seen = set()
            for question in ("Who wrote it?", "When?", "Why?"):
                r = await client.post("/v1/completions", headers=auth, json={
                    "prompt": PREFIX + question, "max_tokens": 4, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
                seen.add(r.headers[REPLICA_HEADER])
            assert len(seen) == 1  # one prompt prefix, one replica: its prefix cache serves the rest
            r = await client.post("/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 10**6})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # a consumer that leaves mid-stream (the ingress, when its client went away) aborts the engine request
        replica = replicas[1]
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "stream": True,
                           "ignore_eos": True}).encode()
        stream = replica.generate(asgi.proxied("POST", "/v1/chat/completions", body=body, headers=[
            (b"content-type", b"application/json")]), {})
        async for message in stream:
            if message[0] == "body" and b'"content":"' in message[1] and b'"content":""' not in message[1]:
                break
        await stream.aclose()
        for _ in range(100):  # 5 s: the 1500 tokens asked for would take far longer
            if replica.state.engine.stats.get("num_running", 1) == 0:
                break
            await asyncio.sleep(0.05)
        assert replica.state.engine.stats["num_running"] == 0 and not replica.state.engine.engine.has_unfinished()
        report = replicas[0].record_routing_stats()
        assert report["healthy"] and "" in report["ttft_targets"]
        # every request a replica received has ended, the abandoned stream too: the router's count of ends agrees
        ends = [r.record_routing_stats() for r in replicas]
        assert all(stats["finished"] == stats["received"] for stats in ends)
        assert sum(ends[1]["finished"].values()) >= 1
        # calibrated on prompts that share no prefix: a longer prompt costs more (a prefix-cache hit would not)
        assert report["prefill_ms_per_token"] > 0
        assert (await replicas[0].ready()) == "r0"
        await replicas[0].check_health()
        replicas[0].state.engine.error = RuntimeError("boom")
        with pytest.raises(RuntimeError, match="engine stopped"):
            await replicas[0].check_health()
        assert not replicas[0].record_routing_stats()["healthy"]
        replicas[0].state.engine.error = None
    finally:
        for r in replicas:
            await r.shutdown()


def test_replicas_in_process_behind_the_ingress():
    asyncio.run(asyncio.wait_for(_scenario(), 240))
