"""Test instrumentation: observe every iteration an engine launches (its plan and the logits its forwards made), and
step an engine through scripted arrivals and aborts, or a number of steps at a time."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch


def on_forward(engine, callback: Callable[[object, dict[str, torch.Tensor]], None]) -> Callable[[], None]:
    """Call callback(plan, {request id: logits row}) after each launched plan that runs something (not the engine's
    release of finished requests when it goes idle); returns a function that removes the spy. Logits of prefill
    chunks that end a prompt appear with the plan that launched them."""
    runner, executor = engine.runner, engine.executor
    seen: dict[str, torch.Tensor] = {}

    def watch(name: str) -> None:
        inner = getattr(runner, name)

        def spy(*args, **kwargs):
            ids, logits = inner(*args, **kwargs)
            if ids and logits.is_cuda:  # made on another stream maybe (a partition's, the overlapped loop's)
                torch.cuda.synchronize()
            seen.update({i: row.clone() for i, row in zip(ids, logits)} if ids else {})
            return ids, logits

        setattr(runner, name, spy)

    for name in ("decode", "prefill", "forward"):
        watch(name)
    inner_start = executor.start

    def start(plan, requests, partition=None, **kw):
        seen.clear()
        out = inner_start(plan, requests, partition, **kw)
        if not plan.empty:
            callback(plan, dict(seen))
        return out

    executor.start = start

    def undo() -> None:
        for name in ("decode", "prefill", "forward"):
            runner.__dict__.pop(name, None)
        executor.__dict__.pop("start", None)

    return undo


def step_through(engine, arrivals: dict, aborts: dict | None, record: Callable) -> dict[str, list]:
    """Step the engine, submitting `arrivals[k]` and aborting `aborts[k]` before engine step k, until every request
    ended; each request's outputs as `record(output)` made them, in order."""
    aborts = aborts or {}
    outs: dict[str, list] = defaultdict(list)
    k, last = 0, max([*arrivals, *aborts, 0])
    while k <= last or engine.has_unfinished():
        for r in arrivals.get(k, []):
            engine.submit(r)
        for rid in aborts.get(k, []):
            engine.abort(rid)
        if engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id].append(record(o))
        k += 1
    return dict(outs)


def stepper(engine, outputs: dict[str, list[int]]) -> Callable[[int | None], None]:
    """steps(n): step the engine n times (None: until every request ended), each output's tokens into `outputs`."""
    def steps(n: int | None = None) -> None:
        count = 0
        while engine.has_unfinished() and (n is None or count < n):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            count += 1
    return steps
