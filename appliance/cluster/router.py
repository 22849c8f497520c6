"""The SLO-aware Ray Serve request router of the engine replicas: ranks them with scoring.Scorer from the report
each replica sends (record_routing_stats) and the routing hints the ingress attaches to the request; Ray Serve then
takes the best ranked replica that has room (max_ongoing_requests), as it does for its own routers.

Ray Serve names the class by import path, `appliance.cluster.router:SLORequestRouter`; the class is built on first
access (module `__getattr__`) so that importing this module does not import Ray.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

from appliance.cluster.hints import RoutingHints
from appliance.cluster.scoring import ReplicaReport, Scorer

CLASS_PATH = f"{__name__}:SLORequestRouter"
LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()  # routers of this process, for the ingress's /metrics


def __getattr__(name: str) -> Any:
    if name == "SLORequestRouter":
        return _router_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hints_of(pending_request: Any) -> RoutingHints:
    kwargs = getattr(pending_request, "kwargs", None) or {}
    return RoutingHints.from_dict(kwargs.get("hints") if isinstance(kwargs, dict) else None)


def _request_id(pending_request: Any) -> str:
    return str(getattr(getattr(pending_request, "metadata", None), "internal_request_id", id(pending_request)))


def reports_of(replicas: Any) -> dict[str, tuple[Any, ReplicaReport]]:
    """Ray's running replicas by name, each with its last report."""
    return {r.replica_id.unique_id: (r, ReplicaReport.from_stats(r.routing_stats, r.replica_id.unique_id))
            for r in replicas}


def live_reports() -> list[ReplicaReport]:
    """The last report of every replica the routers of this process know."""
    out: dict[str, ReplicaReport] = {}
    for router in list(LIVE):
        out.update({name: report for name, (_, report) in reports_of(router.curr_replicas.values()).items()})
    return sorted(out.values(), key=lambda r: r.replica)


@functools.lru_cache(maxsize=None)
def _router_class() -> type:
    from ray.serve.request_router import RequestRouter  # defers the optional cluster dependency (Ray)

    class SLORequestRouter(RequestRouter):
        """Ranks every candidate replica by the request's predicted TTFT against its target (scoring.py)."""

        def initialize_state(self, **kwargs: Any) -> None:
            self.scorer = Scorer()
            # Ray may ship this class by value, with a copy of this module's globals: register in the module itself
            sys.modules[__name__].LIVE.add(self)

        async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list[list]:
            replicas = reports_of(candidate_replicas)
            hints = hints_of(pending_request)
            ranked = self.scorer.rank([report for _, report in replicas.values()], hints)
            if ranked and pending_request is not None:
                self.scorer.chose(_request_id(pending_request), ranked[0].replica, hints)
            return [[replicas[choice.replica][0]] for choice in ranked]

        def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
            self.scorer.sent(replica_id.unique_id, hints_of(pending_request), _request_id(pending_request))

        def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
            self.scorer.completed(replica_id.unique_id, str(internal_request_id))

        def update_replicas(self, replicas: list) -> None:
            super().update_replicas(replicas)
            self.scorer.forget({r.replica_id.unique_id for r in replicas})

    SLORequestRouter.__module__ = __name__
    SLORequestRouter.__qualname__ = "SLORequestRouter"
    return SLORequestRouter
