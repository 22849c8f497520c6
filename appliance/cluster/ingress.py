"""The cluster's one OpenAI-compatible endpoint: every route of `muxd serve` reaches a replica through the relay
(relay.py), with routing hints for the generation routes; the ingress itself answers /health, /ready and /metrics
(the router's counters and each replica's last report). The gate in front is the single server's (server/gate.py):
the API key and the body cap are checked here, before any replica is involved; CORS (--allowed-origins ...) is in
front of the gate, as in the single server.

`IngressServer` is the Ray Serve ingress class (deploy.py wraps it); `create_ingress_app` runs without Ray on any
`Backend`, which the tests use.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from appliance.cluster.hints import ORIGIN, RoutingHints, hints_for
from appliance.cluster.ray_backend import RayBackend
from appliance.cluster.relay import Backend, Relay
from appliance.cluster.scoring import ReplicaReport
from appliance.cluster.settings import ClusterSettings
from appliance.config import Config
from appliance.errors import UnavailableError
from appliance.server.api import PROMETHEUS_TEXT
from appliance.server.errors import install_handlers
from appliance.server.gate import Gate, Traffic

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")
HOP_BY_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}
REPLICA_HEADER = "x-muxd-replica"  # which replica answered (for operators and tests)


def create_ingress_app(backend: Backend, settings: ClusterSettings, engine: Config,
                       ready: Callable[[], Awaitable[bool]],
                       reports: Callable[[], list[ReplicaReport]] = list) -> FastAPI:
    relay = Relay(backend, settings.retries, settings.stall_timeout)
    metrics = IngressMetrics(engine.model.model_name)
    app = FastAPI(title="muxd cluster", version=__import__("appliance").__version__, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.relay = relay
    seats = settings.max_count * (engine.scheduler.max_num_seqs + engine.scheduler.max_waiting)
    app.add_middleware(Gate, traffic=Traffic(), max_body=engine.server.request_byte_limit, max_in_flight=seats,
                       api_key=engine.server.api_key, body_timeout=engine.server.body_timeout)
    # outermost, as the single server's: preflights answered before the gate, its refusals with the headers
    app.add_middleware(CORSMiddleware, **engine.server.cors())
    install_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready_route():
        if not await ready():
            raise UnavailableError("no replica is ready yet (loading, or every replica is being replaced)",
                                   "no_replica")
        return {"status": "ready", "model": engine.model.model_name}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(relay, reports()), media_type=PROMETHEUS_TEXT)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxy(path: str, request: Request):
        body = await request.body()
        route = "/" + path
        hints = RoutingHints(origin=ORIGIN)
        if request.method == "POST" and route in GENERATION_ROUTES:
            hints = _hints(route, body, request.headers.get("x-slo-class"))
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in HOP_BY_HOP]
        proxied = {"method": request.method, "path": route, "query": request.url.query.encode(),
                   "headers": headers, "body": body}
        answer = await relay.send(proxied, hints)
        out = {k.decode("latin-1"): v.decode("latin-1") for k, v in answer.headers
               if k.lower() not in HOP_BY_HOP}
        out[REPLICA_HEADER] = answer.replica
        if answer.streaming:
            return StreamingResponse(relay.body(answer), status_code=answer.status, headers=out)
        return Response(b"".join(answer.held), status_code=answer.status, headers=out)

    return app


def _hints(route: str, body: bytes, slo_header: str | None) -> RoutingHints:
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return RoutingHints(origin=ORIGIN)  # the replica answers the malformed body
    if route == "/invocations":  # SageMaker's: a chat body or a completion body, as the replica reads it
        route = "/v1/chat/completions" if "messages" in parsed else "/v1/completions"
    return hints_for(route, parsed, slo_header, ORIGIN)


class IngressMetrics:
    """The ingress's Prometheus series: what the relay did, and each replica's last report."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.labels = labels
        r = self.registry
        self.routed = Counter("muxd:cluster_requests_routed", "Requests whose answer started, by replica.",
                              [*labels, "replica"], registry=r)
        self.retries = Counter("muxd:cluster_retries", "Requests sent to another replica before they started.",
                               list(labels), registry=r).labels(**labels)
        self.lost = Counter("muxd:cluster_streams_lost", "Started answers whose replica was lost mid-way.",
                            list(labels), registry=r).labels(**labels)
        self.unavailable = Counter("muxd:cluster_unavailable", "Requests no replica could serve (503).",
                                   list(labels), registry=r).labels(**labels)
        names = {"num_waiting": "Requests waiting in the replica's engine.",
                 "num_running": "Requests prefilling or decoding on the replica.",
                 "kv_usage": "Fraction of the replica's KV-cache pages in use.",
                 "backlog_ms": "Predicted prefill time of the prompts queued on the replica (ms)."}
        self.gauges = {k: Gauge(f"muxd:cluster_replica_{k}", doc, [*labels, "replica"], registry=r)
                       for k, doc in names.items()}
        self._seen: dict[str, int] = {}
        self._seen_totals = [0, 0, 0]

    def render(self, relay: Relay, reports: list[ReplicaReport]) -> bytes:
        c = relay.counters
        for replica, total in c.routed.items():
            self.routed.labels(replica=replica, **self.labels).inc(total - self._seen.get(replica, 0))
            self._seen[replica] = total
        for i, (metric, total) in enumerate(((self.retries, c.retries), (self.lost, c.lost_mid_stream),
                                             (self.unavailable, c.unavailable))):
            metric.inc(total - self._seen_totals[i])
            self._seen_totals[i] = total
        for gauge in self.gauges.values():
            gauge.clear()
        for report in reports:
            for key, gauge in self.gauges.items():
                gauge.labels(replica=report.replica, **self.labels).set(float(getattr(report, key)))
        return generate_latest(self.registry)


class IngressServer:
    """The Ray Serve ingress (deploy.py wraps it with serve.ingress): the app over the engine replicas' handle."""

    def __init__(self, replicas: Any, cluster_values: dict[str, Any], engine_values: dict[str, Any]) -> None:
        settings = ClusterSettings(**cluster_values)
        engine = Config.flat(**engine_values)
        self.backend = RayBackend(replicas)
        self._muxd_app = create_ingress_app(self.backend, settings, engine, self.backend.ready, self.backend.reports)

    def __serve_build_asgi_app__(self) -> Any:
        return self._muxd_app
