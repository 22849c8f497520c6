"""The autoscaling policy of the engine replicas, on their own signals: Ray Serve's autoscaler calls it with the
replicas' `record_autoscaling_stats` (replica.py) averaged over its look-back window, and applies the bounds
(--min-replicas, --max-replicas) and delays (--upscale-delay, --downscale-delay) to what it returns.

The deployment is sized for --target-queue requests waiting or running per replica (vLLM's num_requests_waiting +
num_requests_running, as an HPA on the single server would use), and one replica more while any replica predicts a
new prompt would wait longer than its TTFT target (no slack left). Ray is not imported: the policy only reads the
context Ray hands it.
"""
from __future__ import annotations

from typing import Any

POLICY_PATH = f"{__name__}:SLOAutoscaler"


class SLOAutoscaler:
    def __init__(self, target_queue: float = 4.0) -> None:
        if not target_queue > 0:
            raise ValueError(f"target_queue must be > 0, got {target_queue}")
        self.target_queue = target_queue

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        current = ctx.current_num_replicas
        if current == 0:
            return ctx.target_num_replicas, {}
        return self.desired(current, ctx.aggregated_metrics or {}, ctx.total_num_requests), {}

    def desired(self, current: int, metrics: dict[str, dict[Any, float]], ongoing: float) -> float:
        """Replicas wanted for the replicas' reported load (`ongoing`, Ray's own count, where none reported)."""
        queue = metrics.get("queue")
        load = sum(queue.values()) if queue else float(ongoing)
        wanted = load / self.target_queue
        if any(ratio > 1.0 for ratio in (metrics.get("wait_ratio") or {}).values()):
            wanted = max(wanted, current + 1)
        return wanted
