"""The settings of `muxd cluster` (and `muxd serve --replicas N`): how many engine replicas, where the Ray cluster
is, which router, how the replicas autoscale and how faults are handled. Each field is a flag of the same name, as
the engine's own settings are (appliance/config.py); the engine flags travel to every replica unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from appliance.config import GROUPS, Config, at_least, flag
from appliance.errors import ConfigError

ROUTERS = ("slo", "pow2")  # SLO-aware (router.py) or Ray Serve's default power-of-two-choices


@dataclass(frozen=True)
class ClusterSettings:
    replicas: int = flag(2, "Engine replicas (each a whole muxd engine on its GPU, or on CPU). With "
                         "--max-replicas above it, the replicas the deployment starts with.")
    ray_address: Optional[str] = flag(None, "Ray cluster to join (e.g. ray://head:10001 or auto); unset: start a "
                                      "local one on this machine.", "--ray", envvar="RAY_ADDRESS")
    router: str = flag("slo", "Replica choice: slo (least predicted TTFT from each replica's queue, running batch, "
                       "KV usage, prefix-cache affinity and predictor) or pow2 (Ray Serve's default "
                       "power-of-two-choices on ongoing requests).")
    min_replicas: Optional[int] = flag(None, "Autoscale down to this many replicas (default: --replicas).")
    max_replicas: Optional[int] = flag(None, "Autoscale up to this many replicas (default: --replicas: no "
                                       "autoscaling).")
    target_queue: float = flag(4.0, "Autoscaling: requests waiting or running per replica the deployment is sized "
                               "for; also scales up while a replica's predicted queue wait exceeds its TTFT "
                               "target.")
    upscale_delay: float = flag(10.0, "Autoscaling: seconds the load must call for more replicas before one starts.")
    downscale_delay: float = flag(60.0, "Autoscaling: seconds the load must call for fewer replicas before one "
                                  "stops.")
    max_ongoing_requests: int = flag(256, "Requests in flight per replica before the router holds new ones back "
                                     "(Ray Serve's max_ongoing_requests).")
    replica_cpus: float = flag(1.0, "CPUs Ray reserves for each replica.")
    replica_gpus: Optional[float] = flag(None, "GPUs Ray reserves for each replica (default: with a CUDA "
                                         "--device, one per tensor-parallel rank (-tp); else 0).")
    routing_stats_period: float = flag(0.5, "Seconds between the reports (queue, batch, KV usage, predicted "
                                       "wait) each replica sends the router.")
    health_check_period: float = flag(5.0, "Seconds between health checks of a replica; a replica whose engine "
                                      "stopped fails its check and is replaced.")
    health_check_timeout: float = flag(30.0, "Seconds a health check may take before the replica counts as "
                                       "failed.")
    retries: int = flag(2, "Times a request that no replica has started answering is retried on another "
                        "replica (a replica died, or refused it with 429 or 503).")
    stall_timeout: float = flag(600.0, "Seconds without a byte from its replica after which a request is ended "
                                "with an error (nothing hangs on a replica that stopped answering).")

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        at_least(self, 1, "replicas", "max_ongoing_requests")
        at_least(self, 0, "min_replicas", "upscale_delay", "downscale_delay", "replica_cpus", "replica_gpus", "retries")
        if not self.min_count <= self.replicas <= self.max_count:
            raise ConfigError(f"--replicas {self.replicas} must lie within --min-replicas {self.min_count} and "
                              f"--max-replicas {self.max_count}")
        for name in ("target_queue", "routing_stats_period", "health_check_period", "health_check_timeout",
                     "stall_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")

    @property
    def min_count(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def max_count(self) -> int:
        return self.replicas if self.max_replicas is None else self.max_replicas

    @property
    def autoscaling(self) -> bool:
        return self.min_count != self.max_count

    def gpus_per_replica(self, engine: Config) -> float:
        if self.replica_gpus is not None:
            return self.replica_gpus
        if not engine.runtime.resolved_device().startswith("cuda"):
            return 0.0
        return float(engine.parallel.tensor_parallel_size)  # a replica's ranks are processes of its own

    def values(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def engine_values(config: Config) -> dict[str, Any]:
    """Every engine setting by name: what `Config.flat` rebuilds the same config from in a replica's process."""
    return {f.name: getattr(getattr(config, group), f.name) for group, cls in GROUPS.items()
            for f in dataclasses.fields(cls)}


def replica_config(values: dict[str, Any]) -> Config:
    """A replica's engine config: the cluster's engine flags, minus what the ingress does in front of it (the API
    key is checked there; a replica is reached only through the ingress)."""
    return Config.flat(**{**values, "api_key": None})
