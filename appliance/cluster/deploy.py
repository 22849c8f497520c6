"""The muxd cluster as a Ray Serve application: the engine replicas' deployment (router, autoscaling, health
checks, resources) behind the ingress deployment, and the ways to run it: `run` for `muxd cluster` (joins a Ray
cluster or starts a local one, serves until SIGINT/SIGTERM), and `app_builder` for Serve config files and KubeRay's
RayService (`import_path: appliance.cluster.deploy:app_builder`, the flags as `args`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
from typing import Any, Callable

import appliance
from appliance.cluster import autoscale, router
from appliance.cluster.ingress import IngressServer
from appliance.cluster.replica import ServedReplica
from appliance.cluster.settings import ClusterSettings, engine_values
from appliance.config import Config
from appliance.errors import ConfigError

log = logging.getLogger("muxd.cluster")
APP_NAME = "muxd"
ENGINE_DEPLOYMENT = "MuxdEngine"
INGRESS_DEPLOYMENT = "MuxdIngress"
METRICS_INTERVAL_S = 1.0   # how often replicas hand the autoscaler their signals
LOOK_BACK_S = 5.0          # the window the autoscaler averages them over
CLUSTER_HINT = "install it with: pip install 'muxd[cluster]'"


def require_ray() -> None:
    try:
        import ray  # noqa: F401 - defers the optional cluster dependency (Ray) to the commands that need it
        from ray import serve  # noqa: F401 - defers it too
    except ImportError as exc:
        raise ConfigError(f"the cluster mode needs Ray Serve ({exc}); {CLUSTER_HINT}") from None


def engine_options(engine: Config, settings: ClusterSettings) -> dict[str, Any]:
    """The engine replicas' deployment options (Ray Serve's names)."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig  # defers Ray

    routing: dict[str, Any] = {"request_routing_stats_period_s": settings.routing_stats_period,
                               "request_routing_stats_timeout_s": max(1.0, 4 * settings.routing_stats_period)}
    if settings.router == "slo":
        routing["request_router_class"] = router.CLASS_PATH
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT, "max_ongoing_requests": settings.max_ongoing_requests,
        "health_check_period_s": settings.health_check_period, "health_check_timeout_s": settings.health_check_timeout,
        "graceful_shutdown_timeout_s": engine.server.shutdown_timeout,
        "ray_actor_options": {"num_cpus": settings.replica_cpus, "num_gpus": settings.gpus_per_replica(engine)},
        "request_router_config": RequestRouterConfig(**routing)}
    if settings.autoscaling:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=settings.min_count, max_replicas=settings.max_count, initial_replicas=settings.replicas,
            upscale_delay_s=settings.upscale_delay, downscale_delay_s=settings.downscale_delay,
            metrics_interval_s=METRICS_INTERVAL_S, look_back_period_s=LOOK_BACK_S,
            policy=AutoscalingPolicy(policy_function=autoscale.POLICY_PATH,
                                     policy_kwargs={"target_queue": settings.target_queue}))
    else:
        options["num_replicas"] = settings.replicas
    return options


def build_app(engine: Config, settings: ClusterSettings) -> Any:
    """The Serve application: ingress -> engine replicas."""
    from ray import serve  # defers the optional cluster dependency (Ray)

    values = engine_values(engine)
    replicas = serve.deployment(ServedReplica).options(**engine_options(engine, settings)).bind(values)
    ingress = serve.deployment(serve.ingress()(IngressServer)).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=1_000_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas, settings.values(), values)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder: `args` holds engine and cluster flags by field name (dashes or underscores)."""
    cluster_fields = {f.name for f in dataclasses.fields(ClusterSettings)}
    values = {str(k).replace("-", "_"): v for k, v in (args or {}).items()}
    settings = ClusterSettings(**{k: v for k, v in values.items() if k in cluster_fields})
    engine = Config.flat(**{k: v for k, v in values.items() if k not in cluster_fields})
    engine.check()
    return build_app(engine, settings)


PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_S = 60  # a local cluster's first wait for a starting HTTP proxy (Serve's default: 5 s)


def start_ray(engine: Config, settings: ClusterSettings) -> None:
    """Join --ray ADDRESS, or start a local Ray cluster with room for every replica."""
    import ray  # defers the optional cluster dependency (Ray)

    if ray.is_initialized():
        return
    if settings.ray_address:
        ray.init(address=settings.ray_address, log_to_driver=False)
        return
    # a local cluster: logical CPUs for every replica (tests and laptops run more replicas than cores)
    cpus = max(os.cpu_count() or 1, math.ceil(settings.max_count * settings.replica_cpus) + 1)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH")) if p),
           # Serve gives a starting HTTP proxy 5 s (then 10, 15, ...) to answer, three times, before it kills and
           # restarts it: on a loaded machine a proxy can take longer to start, and each restart throws its start-up
           # away (seen on 2 busy cores: no proxy up after 5 minutes). A longer first wait, unless set already
           PROXY_READY_ENV: os.environ.get(PROXY_READY_ENV, str(PROXY_READY_S))}
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(appliance.__file__)))


def deploy(engine: Config, settings: ClusterSettings) -> str:
    """Start (or join) Ray, serve the app on --host:--port, wait until every replica is up; returns the URL."""
    from ray import serve  # defers the optional cluster dependency (Ray)
    from ray.exceptions import RayActorError

    start_ray(engine, settings)
    http = {"host": engine.server.host, "port": engine.server.port}
    try:
        serve.start(http_options=http)
    except (TimeoutError, RayActorError):  # (Ray's GetTimeoutError is a TimeoutError)
        # Serve waits a fixed 60 s for its HTTP proxies, which a loaded machine can take longer to start (or its
        # controller gives up on a proxy that has not started and replaces it, whose wait then ends with the actor's
        # death); the controller is up by then, and a second call connects to it and lets the proxies go on starting
        # (the URL answers once they are up)
        log.warning("Ray Serve's HTTP proxies are not up after Serve's wait; deploying while they start")
        serve.start(http_options=http)
    serve.run(build_app(engine, settings), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{http['host']}:{http['port']}"


def run(engine: Config, settings: ClusterSettings, echo: Callable[[str], Any] = print) -> None:
    """`muxd cluster`: deploy, then serve until SIGINT or SIGTERM, then stop the application (and a local Ray)."""
    import ray  # defers the optional cluster dependency (Ray)
    from ray import serve  # defers it too

    local = not settings.ray_address and not ray.is_initialized()
    url = deploy(engine, settings)
    scaling = (f"autoscaling {settings.min_count}..{settings.max_count} replicas" if settings.autoscaling
               else f"{settings.replicas} replicas")
    echo(f"muxd cluster: {engine.model.model_name} on {url} ({scaling}, router {settings.router}); "
         "Ctrl-C stops it")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        echo("muxd cluster: stopping")
        serve.delete(APP_NAME)
        if local:
            serve.shutdown()
            ray.shutdown()
