"""Test instrumentation: observe every forward of an engine's runner (plan and the logits it produced)."""
from __future__ import annotations

from typing import Callable

import torch


def on_forward(engine, callback: Callable[[object, dict[str, torch.Tensor]], None]) -> Callable[[], None]:
    """Call callback(plan, {request id: logits row}) after each forward; returns a function that removes the spy."""
    inner = engine.runner.forward

    def spy(plan, requests):
        ids, logits = inner(plan, requests)
        callback(plan, {i: row.clone() for i, row in zip(ids, logits)} if ids else {})
        return ids, logits

    engine.runner.forward = spy
    return lambda: engine.runner.__dict__.pop("forward", None)
