"""What happens after an engine step fails: how many in-process restarts a time window allows (`RestartBudget`),
and the rebuild itself (`rebuild_engine`: a new KV cache, scheduler, planner and executor around the same loaded
weights and tokenizer). `AsyncEngine` runs the recovery; past the budget the process should stop so that its
orchestrator restarts it.
"""
from __future__ import annotations

import collections
import logging

import torch

from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine

log = logging.getLogger("muxd.engine")


class RestartBudget:
    """At most `restarts` engine failures within `window_s` seconds are recovered from; one more is fatal."""

    def __init__(self, restarts: int, window_s: float) -> None:
        self.restarts, self.window_s = restarts, window_s
        self._failures: collections.deque[float] = collections.deque()

    def allow(self, now: float) -> bool:
        """Record a failure at `now` (monotonic seconds); True when a restart is still allowed."""
        self._failures.append(now)
        while self._failures and self._failures[0] < now - self.window_s:
            self._failures.popleft()
        return len(self._failures) <= self.restarts

    @property
    def recent(self) -> int:
        return len(self._failures)


def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per (handle, stream), for every stream ever used, for the life of the
    process: each engine's streams (SM partitions, capture streams) take their own, up to 32 MiB each on Hopper, so
    without this every rebuild would keep the failed engine's. Only safe with no captured graph left that may replay
    (they hold the workspace's address) and no kernel in flight; the next cuBLAS call on a stream allocates anew."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def rebuild_engine(old: Engine) -> Engine:
    """A fresh engine from `old`'s config around its model and tokenizer; `old` gives back its KV cache and graphs
    first (on a GPU the new cache needs that memory)."""
    model, tokenizer, config = old.model, old.tokenizer, old.config
    old.free_device_memory()
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        torch.cuda.synchronize()  # raises on a sticky device fault: then rebuilding cannot help
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
    return build_engine(config, model, tokenizer)
