"""Device time of CUDA work, measured with events on the current stream: one call at a time (`time_cuda`) or calls
queued back to back as a busy loop runs them (`time_cuda_queued`). The engine times its graphs with it at start-up;
the benchmarks time ceilings and steps."""
from __future__ import annotations

from typing import Callable

import torch


def time_cuda(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() on the current stream, timed with CUDA events one call at a time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def time_cuda_queued(fn: Callable[[], object], iters: int = 10, rounds: int = 5, warmup: int = 3) -> float:
    """Seconds of fn() on the current stream when calls are queued back to back, as a loop that keeps the device busy
    runs them: the least, over `rounds`, of the mean of `iters` calls queued behind two more (neither the host's launch
    of a call nor a wait between calls counts; a host that stalls while queueing a round, e.g. for another thread,
    only lengthens that round)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        fn()  # queued first, so that the timed calls start behind work already on the device
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best
