"""One engine replica of the cluster: the whole single-server muxd app (server/api.py) in this process, requests
served through it in process (asgi.py), and what the router, the autoscaler and the health checker ask of it.

Ray Serve calls `record_routing_stats` (the report the router ranks replicas by), `record_autoscaling_stats` (the
signals the autoscaling policy sizes the deployment from) and `check_health` (an engine that stopped fails it and
the replica is replaced) by those names; the class itself does not import Ray and runs without it in tests.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, AsyncIterator

from appliance.cluster import asgi
from appliance.cluster.hints import RoutingHints
from appliance.cluster.settings import replica_config
from appliance.engine.request import RequestStatus, SamplingParams
from appliance.errors import UnavailableError
from appliance.predictor.shapes import PrefillItem
from appliance.server.api import create_app

log = logging.getLogger("muxd.cluster")
PREFIX_MEMORY = 1024     # prefix hashes a replica reports (the most recent; its prefix cache holds their pages)
CALIBRATION_TOKENS = (16, 512)  # idle prefills timed at start-up when the engine has no latency predictor


class EngineReplica:
    """A muxd engine and its OpenAI app, loaded by the constructor (Ray Serve routes nothing to a replica before
    its constructor returns)."""

    async def __init__(self, engine_values: dict[str, Any], name: str | None = None) -> None:
        self.config = replica_config(engine_values)
        self.name = name or _replica_name()
        self.app = create_app(self.config, on_fatal=self._on_fatal)
        self.state = self.app.state.muxd
        self._fatal: BaseException | None = None
        self._received: collections.Counter = collections.Counter()
        self._finished: collections.Counter = collections.Counter()
        self._prefixes: collections.OrderedDict = collections.OrderedDict()
        self._seq = 0
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        while not self.state.ready:
            if self._fatal is not None:
                await self.shutdown()
                raise RuntimeError(f"replica {self.name}: the engine failed to start: {self._fatal}")
            await asyncio.sleep(0.05)
        contract = self.config.scheduler.contract
        slos = {name: contract.slo_for(name) for name in contract.class_names()}
        self._targets = {name: (s.ttft_ms, s.ttft_per_1k_ms) for name, s in slos.items()}
        self._targets[""] = self._targets[contract.default_class_name]
        self._fixed_ms, self._per_token_ms = await self._prefill_model()
        log.info("replica %s ready: prefill %.1f ms + %.3f ms/token", self.name, self._fixed_ms, self._per_token_ms)

    @classmethod
    async def start(cls, engine_values: dict[str, Any], name: str | None = None) -> "EngineReplica":
        """Build one outside Ray Serve (which awaits the async constructor itself)."""
        replica = cls.__new__(cls)
        await replica.__init__(engine_values, name)  # type: ignore[misc]
        return replica

    def _on_fatal(self, exc: BaseException) -> None:
        self._fatal = exc

    async def shutdown(self) -> None:
        """Stop the engine (requests still running end with an error)."""
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)

    # ---- requests -----------------------------------------------------------------------------------------------
    async def generate(self, request: dict[str, Any], hints: dict[str, Any] | None = None) -> AsyncIterator[tuple]:
        """Serve one proxied HTTP request: ("start", status, headers, replica name), then ("body", bytes)."""
        routing = RoutingHints.from_dict(hints)
        self._received[routing.origin] += 1
        for h in routing.prefix:
            self._prefixes[h] = None
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > PREFIX_MEMORY:
            self._prefixes.popitem(last=False)
        try:
            async for message in asgi.call(self.app, request):
                yield (*message, self.name) if message[0] == "start" else message
        finally:
            self._finished[routing.origin] += 1

    async def ready(self) -> str:
        """The ingress's readiness probe: this replica's name once it serves."""
        problem = self._healthy()
        if problem is not None:
            raise UnavailableError(f"replica {self.name}: {problem}", "replica_unhealthy")
        return self.name

    # ---- what Ray Serve asks ------------------------------------------------------------------------------------
    def record_routing_stats(self) -> dict[str, Any]:
        """The report the router ranks this replica by (scoring.ReplicaReport's fields)."""
        self._seq += 1
        engine = self.state.engine
        stats = engine.stats if engine is not None else {}
        sched = engine.engine.scheduler if engine is not None else None
        return {"replica": self.name, "seq": self._seq, "healthy": self._healthy() is None,
                "num_waiting": int(stats.get("num_waiting", 0)), "num_running": int(stats.get("num_running", 0)),
                "max_num_seqs": self.config.scheduler.max_num_seqs, "kv_usage": float(stats.get("kv_usage", 0.0)),
                "backlog_ms": self._backlog_ms(sched) if sched is not None else 0.0,
                "prefill_fixed_ms": self._fixed_ms, "prefill_ms_per_token": self._per_token_ms,
                "ttft_targets": dict(self._targets), "received": dict(self._received),
                "finished": dict(self._finished),
                "prefixes": list(self._prefixes)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Per replica: requests waiting and running, and the predicted wait of a new prompt as a fraction of the
        default class's TTFT target (above 1: the replica cannot keep the contract for new work)."""
        report = self.record_routing_stats()
        base_ms = self._targets[""][0] or 1000.0
        return {"queue": float(report["num_waiting"] + report["num_running"]),
                "waiting": float(report["num_waiting"]), "wait_ratio": report["backlog_ms"] / base_ms,
                "kv_usage": report["kv_usage"]}

    async def check_health(self) -> None:
        problem = self._healthy()
        if problem is not None:
            raise RuntimeError(f"replica {self.name}: {problem}")

    def _healthy(self) -> str | None:
        if self._fatal is not None:
            return f"start-up failed: {self._fatal}"
        engine = self.state.engine
        if engine is None:
            return "no engine"
        if engine.error is not None or not engine.alive:
            return f"engine stopped: {engine.error!r}"
        return None

    # ---- predictions --------------------------------------------------------------------------------------------
    def _backlog_ms(self, sched: Any) -> float:
        """Predicted prefill time of the prompt tokens not yet computed (waiting, or prefilling) in the engine."""
        try:
            requests = tuple(sched.requests.values())
        except RuntimeError:  # changed size while copied on the engine thread: the next report counts it
            return 0.0
        tokens = [r.num_tokens - r.num_computed_tokens for r in requests
                  if r.status in (RequestStatus.WAITING, RequestStatus.PREFILLING)]
        return sum(self._fixed_ms + self._per_token_ms * max(0, t) for t in tokens)

    async def _prefill_model(self) -> tuple[float, float]:
        """(fixed ms, ms per token) of a prefill: from the engine's latency predictor when it has one, else timed
        on this replica while it is idle (start-up)."""
        engine = self.state.engine.engine
        predictor = engine.predictor
        if predictor is not None:
            fixed = predictor.prefill_ms([PrefillItem(1, 0)])
            return fixed, max(0.0, (predictor.prefill_ms([PrefillItem(1025, 0)]) - fixed) / 1024)
        sizes = [min(n, engine.max_model_len - 2) for n in CALIBRATION_TOKENS]
        vocab = engine.model.config.vocab_size
        times = [min([await self._time_prefill(n, 3 * i + k, vocab) for k in range(3)]) for i, n in enumerate(sizes)]
        per_token = max(0.0, (times[1] - times[0]) / max(1, sizes[1] - sizes[0]))
        return max(0.0, times[0] - per_token * sizes[0]), per_token

    async def _time_prefill(self, tokens: int, salt: int, vocab: int) -> float:
        """One prefill of a prompt no other shares (a prefix-cache hit would time next to nothing)."""
        engine = self.state.engine
        ids = [(7919 * (salt + 1) + 104729 * salt * i + 31 * i) % (vocab - 10) + 5 for i in range(tokens)]
        request = engine.make_request(ids, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        started = time.perf_counter()
        async for _ in engine.stream(request):
            break
        return (time.perf_counter() - started) * 1e3


def _replica_name() -> str:
    try:
        from ray import serve  # defers the optional cluster dependency (Ray) to a replica that runs under it

        return serve.get_replica_context().replica_id.unique_id
    except Exception as exc:  # noqa: BLE001 - outside Ray a replica must be given its name
        raise UnavailableError(f"a replica outside Ray Serve needs a name ({exc})", "replica") from None


class ServedReplica(EngineReplica):
    """The replica as Ray Serve runs it: Serve awaits `__del__` when it stops a replica (scale-down, shutdown)."""

    async def __del__(self) -> None:
        await self.shutdown()
