"""The ingress's backend under Ray Serve: a streaming call of the engine replicas' deployment handle per request
(the router picks the replica), with every way a replica can fail turned into ReplicaLost for the relay.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from appliance.cluster.hints import RoutingHints
from appliance.cluster.relay import ReplicaLost
from appliance.cluster.router import live_reports
from appliance.cluster.scoring import ReplicaReport

READY_TIMEOUT_S = 5.0


class RayBackend:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def open(self, request: dict[str, Any], hints: RoutingHints) -> AsyncIterator[tuple]:
        stream = self.handle.options(stream=True).generate.remote(request, hints=hints.to_dict())
        replica: str | None = None
        done = False
        try:
            async for message in stream:
                if message[0] == "start":
                    replica = message[3]
                yield message
            done = True
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - a dead or unreachable replica surfaces as any of Ray's errors
            raise ReplicaLost(replica, _short(exc)) from None
        finally:
            if not done:
                stream.cancel()  # the replica stops generating (its engine requests are aborted)

    async def ready(self) -> bool:
        """Whether some replica answers (the router sends the probe like any request)."""
        try:
            await asyncio.wait_for(self.handle.ready.remote(), READY_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001 - not ready, whatever the reason
            return False

    def reports(self) -> list[ReplicaReport]:
        return live_reports()


def _short(exc: BaseException) -> str:
    """Ray's errors carry whole tracebacks: the kind and the first line say enough."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:300]}"
