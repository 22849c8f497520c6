"""One benchmark run end to end: the workload (trace or synthetic, shaped for the served model), prompts, and a
`Session` per target (a URL, a `muxd serve` launched per policy, a `muxd cluster` launched per router, or the engine
in process) that replays it once or at many rates for a capacity sweep.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from appliance.bench.client import HttpTarget, InProcessTarget, ReplayResult, probe_server, replay
from appliance.bench.launcher import ServerProcess
from appliance.bench.prompts import PromptSynth
from appliance.config import EMBEDDED_MODEL_DIR, EMBEDDED_NAME, Config
from appliance.config_flags import parse_serve_args
from appliance.engine import gc_pauses
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.factory import build_engine
from appliance.engine.steplog import StepLog, log_predictor
from appliance.engine.supervisor import RestartBudget, rebuild_engine
from appliance.errors import ConfigError
from appliance.model_zoo.hub_cache import local_model_dir, not_found
from appliance.slo.attainment import evaluate
from appliance.slo.contract import Contract
from appliance.workload import shaping as wl
from appliance.workload.metrics import METRIC_NAMES, PERCENTILES, SLO, RequestTimeline, summarize
from appliance.workload.traces import RequestSpec, load_trace

SLOW_LAUNCH_MS = 25.0  # --save-steps: a step launch slower than this gets its engine-thread stacks sampled
CHECK_TIMEOUT_S = 60.0  # the test request before a replay fails after this long (or --request-timeout) unanswered


@dataclass
class BenchOptions:
    """Everything `muxd bench` was asked to do (flags, validated by the CLI)."""

    trace: Path | None = None           # None: synthetic
    trace_format: str = "auto"
    num_prompts: int = 1000             # synthetic (vLLM bench serve's random dataset: 1,000 x 1,024 in, 128 out)
    input_len: str = "1024"
    output_len: str = "128"
    prefix_len: int = 0                 # synthetic: tokens of one prompt prefix every request shares
    window: tuple[float, float] | None = None
    skip: int = 0
    max_requests: int | None = None
    request_rate: float | None = None   # None: the trace's own times (synthetic: inf)
    speedup: float | None = None
    burstiness: float = 1.0
    seed: int = 0
    max_model_len: int | None = None
    url: str | None = None
    endpoint: str = "completions"
    served_model_name: str | None = None
    model: str | None = None            # served model (launch / in-process) and default tokenizer source
    tokenizer: str | None = None
    policies: list[str] = field(default_factory=list)
    serve_args: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)      # `muxd cluster --router` per run (replicas on Ray Serve)
    cluster_args: list[str] = field(default_factory=list)  # extra `muxd cluster` flags, e.g. --replicas 2
    in_process: bool = False
    ready_timeout: float = 600.0
    temperature: float = 0.0
    sampling: dict[str, Any] = field(default_factory=dict)  # top_p, top_k, min_p sent with every request
    sharegpt_output_len: int | None = None  # a ShareGPT file's output lengths, all this
    max_concurrency: int | None = None
    request_timeout: float | None = None
    max_idle: float | None = None       # idle waits (nothing in flight) cut to this many seconds
    slo: SLO | None = None
    percentiles: tuple[float, ...] = PERCENTILES
    percentile_metrics: tuple[str, ...] = METRIC_NAMES
    result_dir: Path | None = None
    result_filename: str | None = None  # the result JSON's name for a single run (default result.json)
    append_result: bool = False         # add each result JSON to its file as a line (vLLM's --append-result)
    label: str | None = None            # the results' label, before the policy's
    num_warmups: int = 0                # requests sent before each replay, not counted
    metadata: dict[str, str] = field(default_factory=dict)  # KEY=VALUE pairs written into each result JSON
    save_detailed: bool = False
    save_steps: bool = False            # --in-process: the replay's step and prefill-launch logs in its JSON
    spread_ties: bool = False           # spread requests sharing a timestamp over the gap to the next one
    simulate: bool = False              # replay on the simulated executor (no server, no GPU)
    profile: Path | None = None         # latency profile for --simulate (default: the roofline prior)
    gpu: str = "h100"                   # the GPU --simulate plans for
    device_error: float = 0.0           # --simulate: the simulated GPU is (1 + this) x slower than profiled
    device_spread: float = 0.05         # --simulate: each point judged over the GPU this much slower/faster too
    host_error: float = 0.0             # --simulate: the simulated host is (1 + this) x slower than modelled
    host_spread: float = 0.2            # --simulate: sigma of the lognormal spread of prefill launches' host time
    planner_prior: bool = False         # --simulate: the planner starts from the roofline prior, the clock profiled

    @property
    def model_or_default(self) -> str:
        return self.model or "embedded"


def model_dir(name: str) -> Path:
    """A model named as `muxd serve` takes it ('embedded', a directory, a hub id in the local Hugging Face cache);
    with --url also by muxd's name for its embedded model."""
    return EMBEDDED_MODEL_DIR if name in ("embedded", EMBEDDED_NAME) else local_model_dir(name)


def prompt_synth(opts: BenchOptions) -> PromptSynth | None:
    """Tokenizer from --tokenizer, else --model (launched and in-process servers default to the embedded model);
    a URL target without either only works with a trace that records its prompt texts."""
    source = opts.tokenizer or opts.model or (None if opts.url else "embedded")
    if source is None:
        return None
    if not model_dir(source).is_dir():
        flag = "--tokenizer" if source == opts.tokenizer else "--model"
        raise ConfigError(f"{flag} {not_found(source)}; --model is the model muxd serves (with --url, the model "
                          "asked for and, without --tokenizer, the tokenizer's source)")
    return PromptSynth.from_model_dir(model_dir(source), seed=opts.seed)


def load_workload(opts: BenchOptions, synth: PromptSynth | None) -> list[RequestSpec]:
    """The requests before re-timing and clipping: the trace (window, skip, limit) or a synthetic set."""
    if opts.trace is None:
        rate = opts.request_rate if opts.request_rate is not None else math.inf
        specs = wl.synthetic(opts.num_prompts, rate, wl.LengthDist.parse(opts.input_len, "--input-len"),
                             wl.LengthDist.parse(opts.output_len, "--output-len"), opts.burstiness, opts.seed,
                             opts.prefix_len)
        return wl.select(specs, opts.window, opts.skip, opts.max_requests)
    count = (lambda text: len(synth.tokenizer.encode(text))) if synth and synth.tokenizer else None
    specs = load_trace(opts.trace, opts.trace_format, count_tokens=count)
    if opts.sharegpt_output_len is not None:
        specs = [replace(s, output_len=opts.sharegpt_output_len) for s in specs]
    specs = wl.select(specs, opts.window, opts.skip, opts.max_requests)
    return wl.spread_ties(specs, opts.seed) if opts.spread_ties else specs


def shape(raw: list[RequestSpec], opts: BenchOptions, max_model_len: int | None,
          rate: float | None = None) -> tuple[list[RequestSpec], list[str]]:
    """Re-time (to `rate`, else the options' rate or speed-up) and clip to the context; returns notes to report."""
    notes = []
    if rate is not None:
        specs = wl.retime(raw, rate=rate, burstiness=opts.burstiness, seed=opts.seed)
    elif opts.trace is None:
        specs = wl.retime(raw, speedup=opts.speedup) if opts.speedup else list(raw)
    else:
        specs = wl.retime(raw, opts.request_rate, opts.speedup, opts.burstiness, opts.seed)
    limits = [x for x in (max_model_len, opts.max_model_len) if x]
    limit = min(limits) if limits else None
    if limit:
        specs, clipped = wl.clip_to_context(specs, limit)
        if clipped:
            notes.append(f"{clipped} of {len(specs)} requests clipped to the context of {limit} tokens")
    else:
        notes.append("the server does not report max_model_len and --max-model-len is not set: nothing clipped")
    return specs, notes


class Session:
    """A target kept up for one or more replays: a context manager owning its event loop, and the server process
    or engine when it starts one."""

    def __init__(self, opts: BenchOptions, policy: str | None = None, router: str | None = None) -> None:
        self.opts, self.policy, self.router = opts, policy, router
        routed = router and f"router {router}"
        self.label = (" ".join(x for x in (opts.label, policy, routed) if x)
                      or ("in-process" if opts.in_process else (opts.url or "muxd")))
        self.loop = asyncio.new_event_loop()
        self.server: ServerProcess | None = None
        self.engine: Any = None
        self._gc_before: dict[str, Any] | None = None
        self._cpu: list[tuple[float, float, float]] = []  # _cpu_now() before and after the last replay
        self._steps: StepLog | None = None  # the latest replay's step log (--save-steps)
        self.target: HttpTarget | InProcessTarget | None = None
        self.model_id = ""
        self.max_model_len: int | None = None
        self.backend = "in-process" if opts.in_process else ("openai-chat" if opts.endpoint == "chat" else "openai")

    def __enter__(self) -> "Session":
        try:
            self.loop.run_until_complete(self._open())
        except BaseException:
            self.__exit__()
            raise
        return self

    async def _open(self) -> None:
        opts = self.opts
        if opts.in_process:
            cfg = in_process_config(opts.model_or_default, self.policy, opts.serve_args)
            cfg.check()
            engine = await asyncio.to_thread(build_engine, cfg)
            # recovered from a failed step as `muxd serve` recovers (lifecycle.py): the replay measures what a
            # server would have done, not the rest of its requests failing behind a dead engine
            srv, rebuild = cfg.server, rebuild_engine if cfg.parallel.tensor_parallel_size == 1 else None
            self.engine = AsyncEngine(engine, rebuild=rebuild,
                                      restarts=RestartBudget(srv.engine_restarts, srv.engine_restart_window))
            self.engine.start()
            self.model_id, self.max_model_len = cfg.model.model_name, engine.max_model_len
            self.target = InProcessTarget(self.engine, opts.temperature, self.label, sampling=opts.sampling,
                                          defaults=cfg.model.sampling_defaults())
            return
        url = opts.url
        if url is None:
            self.server = ServerProcess(opts.model_or_default, self.policy, opts.serve_args, opts.ready_timeout,
                                        opts.result_dir, self.router, opts.cluster_args)
            await asyncio.to_thread(self.server.__enter__)
            url = self.server.url
        self.model_id, self.max_model_len = await probe_server(url, opts.served_model_name, prefer=opts.model)
        self.target = HttpTarget(url, self.model_id, opts.endpoint, opts.temperature, extra_body=opts.sampling,
                                 label=self.label)

    def __exit__(self, *exc: object) -> None:
        try:
            if isinstance(self.target, HttpTarget):
                self.loop.run_until_complete(self.target.aclose())
            if self.engine is not None:
                self.engine.shutdown()
        finally:
            if self.server is not None:
                self.server.stop()
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def replay(self, specs: list[RequestSpec], prompts: list[str | list[int]],
               on_done: Callable[[RequestTimeline], None] | None = None) -> ReplayResult:
        assert self.target is not None, "use the session as a context manager"
        self.loop.run_until_complete(self._check(prompts[0]))
        if self.opts.num_warmups:
            self.loop.run_until_complete(self._warm_up(specs, prompts))
        self._gc_before = gc_pauses.recorder().snapshot() if self.engine is not None else None
        self._cpu = [self._cpu_now()] if self.engine is not None else []
        self._steps = None
        if self.opts.save_steps and self.engine is not None:  # (the engine is idle between replays)
            self._steps = StepLog(self.engine.engine, log_predictor(self.engine.engine),
                                  stacks_after_ms=SLOW_LAUNCH_MS).attach()
            steps = self._steps
            self.engine.on_rebuilt = lambda engine: steps.follow(engine, log_predictor(engine))
        restarts = self.engine.restart_count if self.engine is not None else 0
        try:
            result = self.loop.run_until_complete(replay(specs, prompts, self.target, self.opts.max_concurrency,
                                                         self.opts.request_timeout, on_done,
                                                         max_idle=self.opts.max_idle))
            if self.engine is not None and self.engine.restart_count > restarts:
                rebuilt = self.engine.restart_count - restarts
                result.notes.append(f"the engine failed {rebuilt} time{'s' if rebuilt > 1 else ''} during this replay "
                                    "and was rebuilt (the failed step's requests failed); the planner's figures count "
                                    "from the last rebuild")
            return result
        finally:
            if self._cpu:
                self._cpu.append(self._cpu_now())
            if self._steps is not None:
                self.engine.on_rebuilt = None
                self._steps.detach()

    def _cpu_now(self) -> tuple[float, float, float]:
        """(wall, this event loop thread's CPU, the engine thread's CPU) seconds, on the event loop's thread."""
        return time.monotonic(), time.thread_time(), self.engine.engine_cpu_s

    def _thread_cpu(self) -> dict[str, float]:
        """Over the last replay: each busy thread's CPU seconds and share of the wall time. The two share one
        interpreter: where their shares add up near 1, each waits for the other's Python."""
        (wall0, loop0, engine0), (wall1, loop1, engine1) = self._cpu
        wall = max(wall1 - wall0, 1e-9)
        return {"wall_s": wall, "event_loop_cpu_s": loop1 - loop0, "engine_cpu_s": engine1 - engine0,
                "event_loop_share": (loop1 - loop0) / wall, "engine_share": (engine1 - engine0) / wall}

    async def _check(self, prompt: str | list[int]) -> None:
        """One short request before the replay, so a wrong model name or endpoint fails clearly and at once."""
        probe = RequestSpec(0.0, 1, 2)
        timeline = RequestTimeline(arrival=0.0)
        wait = self.opts.request_timeout or CHECK_TIMEOUT_S
        try:
            await asyncio.wait_for(self.target.send(prompt[:8] if isinstance(prompt, list) else prompt[:64], probe,
                                                    timeline), wait)
        except asyncio.TimeoutError:
            timeline.error = f"no answer within {wait:g} s; --request-timeout sets the wait"
        except Exception as exc:  # noqa: BLE001 - reported as a configuration problem
            timeline.error = f"{type(exc).__name__}: {exc}"
        if timeline.error or not timeline.token_times:
            raise ConfigError(f"{self.label}: the test request failed ({timeline.error or 'no token came back'}); "
                              "check --url, --endpoint, --served-model-name")

    async def _warm_up(self, specs: list[RequestSpec], prompts: list[str | list[int]]) -> None:
        """vLLM's --num-warmups: that many of the workload's first requests (in turn), all at once, before the
        replay; their latencies are not counted."""
        n = self.opts.num_warmups
        timelines = [RequestTimeline(arrival=0.0) for _ in range(n)]
        raised = await asyncio.gather(*(self.target.send(prompts[i % len(specs)], specs[i % len(specs)], t)
                                        for i, t in enumerate(timelines)), return_exceptions=True)
        failed = [f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else t.error
                  for t, exc in zip(timelines, raised)
                  if isinstance(exc, BaseException) or t.error or not t.token_times]
        if failed:
            raise ConfigError(f"{self.label}: {len(failed)} of {n} warm-up requests failed "
                              f"({failed[0] or 'no token came back'})")

    def summarize(self, result: ReplayResult, specs: list[RequestSpec], notes: list[str],
                  rate: float | None = None) -> dict[str, Any]:
        """The vLLM-style result JSON of one replay: run metadata, then the metrics. `request_rate` is the rate
        asked for (None: the trace's own times), `offered_rate` what the replayed arrivals averaged."""
        opts = self.opts
        requested = rate if rate is not None else opts.request_rate
        out: dict[str, Any] = {
            "date": result.started_at, "endpoint_type": self.backend, "backend": self.backend, "label": self.label,
            "policy": self.policy,
            **({"router": self.router, "cluster_args": " ".join(opts.cluster_args)} if self.router else {}),
            "model_id": self.model_id, "tokenizer_id": opts.tokenizer or opts.model,
            "trace": str(opts.trace) if opts.trace else "synthetic", "num_prompts": len(specs),
            "request_rate": _rate_value(requested), "offered_rate": _rate_value(wl.offered_rate(specs)),
            "speedup": opts.speedup, "burstiness": opts.burstiness,
            "max_concurrency": opts.max_concurrency, **opts.metadata,
        }
        out.update(summarize(result.timelines, result.duration, opts.slo, specs, opts.percentiles,
                             opts.save_detailed, opts.percentile_metrics))
        out["short_outputs"] = result.short_outputs
        out.update(contract_verdict(opts.slo, result.timelines, specs))
        out["notes"] = notes + result.notes
        if self.engine is not None:  # in process: what the planner decided and learned, since the engine began
            snapshot = self.engine.engine.scheduler.planner.snapshot()
            if snapshot is not None:
                out["planner"] = snapshot
            if self._gc_before is not None:  # the engine's process's garbage collections during this replay
                out["gc"] = gc_pauses.since(self._gc_before, gc_pauses.recorder().snapshot())
            if len(self._cpu) == 2:
                out["threads"] = self._thread_cpu()
            if self._steps is not None:
                out["steps"], out["prefills"] = self._steps.steps, self._steps.prefills
            if self.engine.engine.startup:  # what starting the engine took (graph capture, memory), once per engine
                out["startup"] = dict(self.engine.engine.startup)
        return out


def variants(opts: BenchOptions) -> list[tuple[str | None, str | None]]:
    """(policy, router) of every session the options ask for, policies outermost."""
    return [(policy, router) for policy in opts.policies or [None] for router in opts.routers or [None]]


def _rate_value(rate: float | None) -> float | str | None:
    return "inf" if rate is not None and math.isinf(rate) else rate


def in_process_config(model: str, policy: str | None, serve_args: list[str]) -> Config:
    """The config `muxd serve --model MODEL --policy POLICY <serve_args>` would build, for the in-process engine:
    the flags are parsed as the serve command parses them, so both modes accept the same ones."""
    overrides = {"model": model, **({"policy": policy} if policy else {})}
    return parse_serve_args(list(serve_args), **overrides)


def contract_verdict(slo: SLO | None, timelines: list[RequestTimeline], specs: list[RequestSpec]) -> dict[str, Any]:
    """With a YAML contract as the SLO: whether the whole replay kept it (attainment, the TTFT percentile and the
    TBT percentile over every gap) and why not; nothing for other SLOs."""
    if not isinstance(slo, Contract):
        return {}
    return evaluate(slo, timelines, specs).verdict()
