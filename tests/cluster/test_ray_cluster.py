"""The cluster on a local Ray cluster (CPU): engine replicas of the embedded model behind the ingress over real
HTTP: routing, streaming, cancellation, a replica killed mid-stream, scale-up under load and scale-down when idle.
Skipped without Ray Serve (`pip install 'muxd[cluster]'`); one Ray cluster for the module. Ray is imported by the
tests, not at collection (seconds that every pytest worker would pay)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx
import pytest

from appliance.cluster.deploy import APP_NAME, ENGINE_DEPLOYMENT, build_app, deploy
from appliance.cluster.ingress import REPLICA_HEADER
from appliance.cluster.settings import ClusterSettings
from appliance.config import Config

pytestmark = pytest.mark.cluster
LONG = {"ignore_eos": True, "stream": True}


@pytest.fixture(scope="module", autouse=True)
def needs_ray_serve():
    pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'muxd[cluster]'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def _running(app: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or ENGINE_DEPLOYMENT not in status.deployments:
        return 0
    return status.deployments[ENGINE_DEPLOYMENT].replica_states.get("RUNNING", 0)


def _scaling_up(app: str) -> bool:
    """Whether the autoscaler has asked for more engine replicas than run (Ray's status says UPSCALING)."""
    from ray import serve

    status = serve.status().applications.get(app)
    return status is not None and ENGINE_DEPLOYMENT in status.deployments and \
        status.deployments[ENGINE_DEPLOYMENT].status == "UPSCALING"


@pytest.mark.parametrize("give_up", ["timeout", "proxy replaced"])
def test_deploy_goes_on_when_serves_proxies_start_slower_than_its_wait(monkeypatch, give_up):
    """Ray Serve gives up on its HTTP proxies after a fixed 60 s (a loaded machine can take longer), or its controller
    replaces a proxy that has not started, so that Serve's wait ends with the actor's death: `deploy` connects to
    Serve's controller again and deploys while they start, rather than failing."""
    from ray import serve
    from ray.exceptions import ActorDiedError

    starts, runs = [], []

    def start(**options):
        starts.append(options)
        if len(starts) == 1:
            raise TimeoutError("HTTP proxies not available after 60s.") if give_up == "timeout" else ActorDiedError()

    monkeypatch.setattr("appliance.cluster.deploy.start_ray", lambda engine, settings: None)
    monkeypatch.setattr("appliance.cluster.deploy.build_app", lambda engine, settings: "the app")
    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "run", lambda app, **options: runs.append((app, options)))
    engine = Config.flat(port=8123)
    assert deploy(engine, ClusterSettings(replicas=1)) == f"http://{engine.server.host}:8123"
    assert len(starts) == 2 and starts[0] == starts[1] == {"http_options": {"host": engine.server.host, "port": 8123}}
    assert runs == [("the app", {"name": APP_NAME, "route_prefix": "/", "blocking": False})]


@pytest.mark.parametrize("given", [None, "7"])
def test_a_local_cluster_gives_starting_proxies_longer_than_serves_5_s(monkeypatch, given):
    """A local Ray cluster's Serve waits PROXY_READY_S for a starting HTTP proxy before it counts a failed check (on a
    loaded machine it killed and restarted proxies that had not started in 5 s, again and again); a value set in
    the environment is kept."""
    import ray

    from appliance.cluster.deploy import PROXY_READY_ENV, PROXY_READY_S, start_ray

    inits = []
    if given is None:
        monkeypatch.delenv(PROXY_READY_ENV, raising=False)
    else:
        monkeypatch.setenv(PROXY_READY_ENV, given)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: inits.append(options))
    start_ray(Config.flat(), ClusterSettings(replicas=2))
    env = inits[0]["runtime_env"]["env_vars"]
    assert env[PROXY_READY_ENV] == (given or str(PROXY_READY_S)) and "PYTHONPATH" in env


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster and the muxd app with two replicas of two seats each (so requests queue)."""
    import ray

    engine = Config.flat(port=_free_port(), max_num_seqs=2, log_level="warning")
    settings = ClusterSettings(replicas=2, replica_cpus=0.5, routing_stats_period=0.2, health_check_period=1.0)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    url = deploy(engine, settings)
    # the replicas are up; Serve's HTTP proxies may still be starting on a loaded machine (`deploy` goes on then)
    _wait(lambda: _ready(url), 180, "the cluster's /ready")
    yield url, engine
    # the local cluster this fixture started goes down whole with Ray, Serve's actors with it (serve.shutdown() first
    # would only stop them one by one, gracefully, for seconds more)
    ray.shutdown()


async def _stream(client: httpx.AsyncClient, body: dict, path: str = "/v1/completions") -> dict:
    """One streamed request: its replica, its text events, whether output came before an error, how it ended."""
    out = {"replica": None, "events": [], "error": None, "output_before_error": False, "done": False}
    async with client.stream("POST", path, json=body) as r:
        out["status"], out["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                continue
            event = json.loads(data)
            if "error" in event:
                out["error"] = event["error"]
            else:
                out["events"].append(event)
                out["output_before_error"] = True
    return out


def test_routing_and_streaming(cluster):
    url, _ = cluster

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            # the router ranks the replicas it has reports from: wait until it has both (on a busy machine the
            # second one's first report can come after the deployment says RUNNING)
            assert (await client.post("/v1/completions", json={"prompt": "warm", "max_tokens": 1})).status_code == 200
            for _ in range(480):
                if (await client.get("/metrics")).text.count("muxd:cluster_replica_num_running{") == 2:
                    break
                await asyncio.sleep(0.25)
            bodies = [{"prompt": f"{i} " + "story " * (40 + 30 * i), "max_tokens": 24, "ignore_eos": True}
                      for i in range(8)]
            answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            assert all(a.status_code == 200 for a in answers)
            spread = {a.headers[REPLICA_HEADER] for a in answers}
            prefix = "A shared system prompt that every request of this tenant starts with. " * 20
            same = [await client.post("/v1/completions", json={"prompt": prefix + q, "max_tokens": 2})
                    for q in ("one", "two", "three")]
            chat = await _stream(client, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                          **LONG}, "/v1/chat/completions")
            metrics = (await client.get("/metrics")).text
            return spread, {r.headers[REPLICA_HEADER] for r in same}, chat, metrics

    spread, same, chat, metrics = asyncio.run(run())
    assert len(spread) == 2  # a burst goes to both replicas
    assert len(same) == 1    # a shared prompt prefix stays where its KV pages are cached
    assert chat["status"] == 200 and chat["done"] and chat["error"] is None
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chat["events"])
    assert chat["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert metrics.count("muxd:cluster_replica_num_running{") == 2


def test_a_client_that_leaves_frees_its_replica(cluster):
    url, _ = cluster

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json={"prompt": "go", "max_tokens": 1900,
                                                                     **LONG}) as r:
                async for line in r.aiter_lines():
                    if '"text"' in line:
                        break  # leave after the first token; 1900 would take far longer than the wait below

    asyncio.run(run())

    def idle():
        text = httpx.get(url + "/metrics").text
        rows = [line for line in text.splitlines() if line.startswith("muxd:cluster_replica_num_running{")]
        return rows and all(line.endswith(" 0.0") for line in rows)

    _wait(idle, 15, "the abandoned request to leave its replica")


def test_a_replica_killed_mid_stream(cluster):
    import ray

    url, _ = cluster

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=180) as client:
            # 4 seats in the cluster, 8 requests: some stream, some wait in a replica's queue (not started)
            tasks = [asyncio.ensure_future(_stream(client, {"prompt": f"request {i}", "max_tokens": 200, **LONG}))
                     for i in range(8)]
            victim = None
            while victim is None:
                await asyncio.sleep(0.2)
                metrics = (await client.get("/metrics")).text
                victim = next((line.split('replica="')[1].split('"')[0] for line in metrics.splitlines()
                               if line.startswith("muxd:cluster_replica_num_waiting{") and not line.endswith(" 0.0")
                               ), None)
            name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if ENGINE_DEPLOYMENT in a["name"] and a["name"].endswith(victim))
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            return victim, await asyncio.wait_for(asyncio.gather(*tasks), 150)

    victim, results = asyncio.run(run())
    failed = [r for r in results if r["error"] is not None]
    assert failed, "the killed replica had streams that had started"
    for r in failed:  # what had started ends with a clear error, and the stream still closes with [DONE]
        assert r["replica"] == victim and r["output_before_error"] and r["done"]
        assert r["error"]["code"] == "replica_lost" and "retry" in r["error"]["message"]
    for r in results:  # nothing that had not started is lost: it finished on the other replica
        if r["error"] is None:
            assert r["status"] == 200 and r["done"] and r["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert len(results) - len(failed) >= 5  # 8 requests, at most the victim's 2 seats were streaming
    _wait(lambda: _running(APP_NAME) == 2, 120, "Ray Serve to replace the killed replica")


def test_autoscaling_up_under_load_and_down_when_idle(cluster):
    from ray import serve

    url, engine = cluster
    serve.delete(APP_NAME)
    # no delays: the scaling waits only for the load the autoscaler averages over its look-back window
    settings = ClusterSettings(replicas=1, min_replicas=1, max_replicas=2, target_queue=2, upscale_delay=0,
                               downscale_delay=0, replica_cpus=0.5, routing_stats_period=0.2)
    serve.run(build_app(engine, settings), name=APP_NAME, route_prefix="/", blocking=False)
    _wait(lambda: _running(APP_NAME) == 1, 120, "the autoscaled app to start with one replica")

    async def load():
        # six requests outstanding (two seats, so four queued) until a second replica runs: each one ended is sent
        # again, so the load the autoscaler averages cannot run out on a slow machine before the replica is up.
        # Whole answers, not streams: no token event passes Serve's proxy, the ingress and this process, whose work
        # would slow the start of the second replica on a small machine
        stop = asyncio.Event()

        async def client_loop(client: httpx.AsyncClient, i: int) -> None:
            while not stop.is_set():
                try:
                    await client.post("/v1/completions", json={"prompt": f"load {i}", "max_tokens": 1900,
                                                               "ignore_eos": True})
                except httpx.HTTPError:  # the load matters here, not each stream (routing tests check those)
                    await asyncio.sleep(0.1)

        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            tasks = [asyncio.ensure_future(client_loop(client, i)) for i in range(6)]
            try:
                # the autoscaler's decision, then the replica it starts (importing and building an engine under
                # the load of six streams takes a 2-core machine far longer than the decision)
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: _wait(lambda: _scaling_up(APP_NAME) or _running(APP_NAME) == 2,
                                        90, "the autoscaler to ask for a second replica under load"))
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: _wait(lambda: _running(APP_NAME) == 2, 240, "the second replica to run"))
            finally:
                stop.set()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(load())
    _wait(lambda: _running(APP_NAME) == 1, 90, "the idle deployment to scale back to one replica")
