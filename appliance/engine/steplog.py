"""A log of every engine step, for diagnosis and serving calibration: planning time, launch time (`launch_ms`, the
step's wall time: for a decode or mixed step, from its launch, or from the previous step's tokens when it waited
behind them in the overlapped loop, to its tokens on the host; `host_launch_ms`, the host time the launch itself
took; `host_cpu_ms`, the engine thread's CPU time in it: far less means it waited, for the interpreter's lock or the
driver; `host_wait_ms`, the part blocked on a device event: a full staging ring, a token buffer still being read;
where not zero, `device_allocs`, `device_frees`, `alloc_retries`, `syncs`: the caching allocator's calls to the
driver since the previous launch; `stacks`, given `stacks_after_ms`: where a slow launch was, sampled), the device
time of its decode or mixed kernels (`device_ms`, on CUDA), whether the next step was launched before its tokens were
read (`overlapped`), the host time since the previous step's launch ended less the time spent reading tokens
(`gap_ms`: the engine's bookkeeping, outputs and streaming, or an idle wait), the plan's mode, decode partition and
prefill layers, the requests it prefills (`prefill_ids`; an in-process replay names them `trace-<index>`) and those it
preempted, the prefill launches in flight, and, given a predictor, its figure for the step beside what the executor
measured; a temporal step also has the device time of its prefill layers after decode (`after_ms`, `after_items`).
Beside the steps it keeps the prefill launches as they finished (`prefills`: their GPU time, prefill SMs, layers,
whether decode ran beside them, and the profile's solo figure). `StepLog.attach` wraps the engine's scheduler and
executor; `detach` restores them; `follow` moves the log to an engine rebuilt after a failed step; `log_predictor`
picks the predictor for an engine's log.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from appliance.attention.pinned import HOST_WAITS
from appliance.engine.slow_stacks import SlowStacks
from appliance.predictor.predictor import Predictor
from appliance.predictor.profile import load_predictor
from appliance.predictor.shapes import decode_load, prefill_items


def log_predictor(engine: Any) -> Predictor | None:
    """The predictor whose figures a step log sets beside the measured steps: the engine's own, else, for a policy
    that plans without one (chunked at a given budget), its `--profile`'s, so that replays of every policy served
    with a profile calibrate it; None without either."""
    if engine.predictor is not None:
        return engine.predictor
    sched = engine.config.scheduler
    if sched.profile is None:
        return None
    device = engine.kv_cache.data.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return load_predictor(sched.profile, engine.model.config, gpu, sched.profile_file)


ALLOCATOR_COUNTS = {"device_allocs": "num_device_alloc", "device_frees": "num_device_free",
                    "alloc_retries": "num_alloc_retries", "syncs": "num_sync_all_streams", "ooms": "num_ooms"}


def _allocations() -> dict[str, int]:
    """The caching allocator's counts of device allocations, frees, retries and stream syncs (a retry frees cached
    blocks, which waits for the device); empty without CUDA. The allocator's own nested statistics, whose top level
    holds these counts: `memory_stats()` flattens them in Python first, about 0.4 ms of the engine thread a step."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.memory_stats_as_nested_dict()
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTS.items()}


def planned_row(t: float, plan: Any, sched: Any, inflight: int) -> dict[str, Any]:
    """A step as planned, as the log keeps it (the simulator's step log too): when, what it runs (the requests whose
    prompts it prefills by id, and those it preempted where any), the planner's mode and headroom, the prefill
    launches in flight and the prompts waiting."""
    return {"t": t, "decode": len(plan.decode), "decode_sms": plan.decode_sms, "mixed": plan.mixed,
            "layers": (plan.prefill[0].layer_end - plan.prefill[0].layer_start) if plan.prefill else 0,
            "prefill_tokens": sum(w.num_tokens for w in plan.prefill),
            "prefill_ids": [w.request_id for w in plan.prefill],
            **({"preempted": list(plan.preempted)} if plan.preempted else {}),
            "mode": getattr(getattr(sched.planner, "stats", None), "last_mode", ""),
            "inflight": inflight, "waiting": len(sched.waiting), "headroom": sched.planner.headrooms()}


def item_pairs(items: Any) -> list[list[int]]:
    """Prefill items as the log keeps them: [new, reused] tokens each."""
    return [[i.new, i.reused] for i in items]


class StepLog:
    def __init__(self, engine: Any, predictor: Predictor | None = None,
                 stacks_after_ms: float | None = None) -> None:
        """`stacks_after_ms`: sample the engine thread's stack every that many ms while a launch runs longer (a
        step's `stacks`, engine/slow_stacks.py)."""
        self.engine, self.predictor = engine, predictor
        self._stacks = SlowStacks(stacks_after_ms) if stacks_after_ms else None
        self.steps: list[dict[str, Any]] = []
        self.prefills: list[dict[str, Any]] = []
        self._originals: tuple | None = None
        self._seen = engine.executor.prefills_seen
        self._launch_end: float | None = None  # when the previous step's launch returned
        self._waited = 0.0  # seconds spent reading tokens (waiting for the device) since then
        self._rows: dict[int, dict[str, Any]] = {}  # launched steps not collected yet -> their row
        self._allocs = _allocations()  # the allocator's counts when the last launch ended

    def attach(self) -> "StepLog":
        sched, executor = self.engine.scheduler, self.engine.executor
        self._originals = (sched.schedule, executor.start, executor.collect)
        schedule, start, collect = self._originals

        def timed_schedule():
            t0 = time.perf_counter()
            plan = schedule()
            self.steps.append({
                "plan_ms": (time.perf_counter() - t0) * 1e3,
                "gap_ms": None if self._launch_end is None else (t0 - self._launch_end - self._waited) * 1e3,
                **planned_row(t0, plan, sched, executor.num_inflight)})
            return plan

        def timed_start(plan, requests, partition=None, **kw):
            waited = HOST_WAITS.seconds
            if self._stacks is not None:
                self._stacks.begin()
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                step = start(plan, requests, partition, **kw)
            finally:
                stacks = self._stacks.end() if self._stacks is not None else []
            if self.steps:
                row = self.steps[-1]
                row["host_launch_ms"] = (time.perf_counter() - t0) * 1e3
                row["host_cpu_ms"] = (time.thread_time() - cpu0) * 1e3
                row["host_wait_ms"] = (HOST_WAITS.seconds - waited) * 1e3
                allocs, seen = _allocations(), self._allocs  # (one query a step: since the last launch ended)
                row.update({k: v - seen.get(k, 0) for k, v in allocs.items() if v != seen.get(k, 0)})
                self._allocs = allocs
                if stacks:
                    row["stacks"] = stacks
                row["partition"] = executor.current.name
                row["prefill_launch_ms"] = executor.last_launch_ms
                row["prefill_graphs"] = executor.last_launch_graphs
                row.update(self._predicted(plan, requests, step))
                if step.rows:
                    self._rows[id(step)] = row
                else:  # nothing to read back: the launch was the step
                    row["launch_ms"] = row["host_launch_ms"]
            self._collect_prefills()
            self._launch_end, self._waited = time.perf_counter(), 0.0
            return step

        def timed_collect(step):
            t0 = time.perf_counter()
            tokens = collect(step)
            self._waited += time.perf_counter() - t0  # the device's time, not the host's
            row = self._rows.pop(id(step), None)
            if row is not None:
                row.update(launch_ms=step.wall_ms, device_ms=step.device_ms, overlapped=step.overlapped)
                obs = executor.last_decode
                if obs is not None and "pred_ms" in row and not step.plan.mixed:
                    row.update(obs_ms=obs.ms, beside=len(obs.concurrent))
                if executor.last_after_ms is not None and step.plan.prefill:  # a temporal step's prefill layers
                    row.update(after_ms=executor.last_after_ms,
                               after_items=item_pairs(prefill_items(step.plan.prefill)))
            return tokens

        sched.schedule, executor.start, executor.collect = timed_schedule, timed_start, timed_collect
        return self

    def follow(self, engine: Any, predictor: Predictor | None = None) -> None:
        """Log `engine` from now on, in the same rows: the engine that replaced this one after a failed step
        (engine/supervisor.py); the old one's launches not yet read are dropped. Call it while neither steps."""
        self._restore()
        self.engine, self.predictor = engine, predictor
        self._seen = engine.executor.prefills_seen
        self._launch_end, self._waited, self._rows = None, 0.0, {}
        self.attach()

    def _restore(self) -> None:
        if self._originals is not None:
            sched, executor = self.engine.scheduler, self.engine.executor
            sched.schedule, executor.start, executor.collect = self._originals
            self._originals = None

    def detach(self) -> None:
        self._restore()
        if self._stacks is not None:
            self._stacks.close()
            self._stacks = None

    def _collect_prefills(self) -> None:
        finished, self._seen = self.engine.executor.prefills_since(self._seen)
        for obs in finished:
            items = prefill_items(obs.works)
            row: dict[str, Any] = {"ms": obs.ms, "prefill_sms": obs.prefill_sms, "layers": obs.layers,
                                   "beside": obs.beside_decode, "items": item_pairs(items),
                                   "decode_beside": self._decode_between(obs.launched_at, obs.seen_at)}
            if self.predictor is not None:
                sms = None if obs.prefill_sms >= self.predictor.sm_count else obs.prefill_sms
                row["pred_ms"] = self.predictor.prefill_solo_ms(items, sms, obs.layers)
            self.prefills.append(row)

    def _decode_between(self, start: float, end: float) -> dict[str, float]:
        """The decode steps planned while a prefill launch ran (from its launch to the host seeing it done): how many,
        their mean batch and mean cached tokens (what competes with the prefill for memory bandwidth)."""
        batch = ctx = n = 0
        for step in reversed(self.steps):
            if step["t"] < start:
                break
            if step["t"] <= end and step["decode"]:
                batch, ctx, n = batch + step["decode"], ctx + step.get("ctx", 0), n + 1
        return {"steps": n, "batch": batch / n if n else 0.0, "ctx": ctx / n if n else 0.0}

    def _predicted(self, plan, requests, step) -> dict[str, Any]:
        """The predictor's figure for the step as planned, beside what the executor measured."""
        if self.predictor is None or not plan.decode:
            return {}
        p = self.predictor
        load = decode_load(requests, plan.decode)
        row: dict[str, Any] = {"ctx": load.reused_tokens}
        if plan.mixed:
            items = prefill_items(plan.prefill)
            row.update(pred_ms=p.mixed_ms(items, load), items=item_pairs(items))
            return row
        beside = prefill_items(step.beside)
        row.update(pred_ms=p.decode_ms(load, step.decode_sms, beside) if beside else p.decode_ms(load))
        return row
