"""Test instrumentation: observe every iteration an engine launches (its plan and the logits its forwards made)."""
from __future__ import annotations

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
            seen.update({i: row.clone() for i, row in zip(ids, logits)} if ids else {})
            return ids, logits

        setattr(runner, name, spy)

    for name in ("decode", "prefill", "forward"):
        watch(name)
    inner_start = executor.start

    def start(plan, requests, partition=None):
        seen.clear()
        out = inner_start(plan, requests, partition)
        if not plan.empty:
            callback(plan, dict(seen))
        return out

    executor.start = start

    def undo() -> None:
        for name in ("decode", "prefill", "forward"):
            runner.__dict__.pop(name, None)
        executor.__dict__.pop("start", None)

    return undo
