"""The interpreter's cyclic garbage collector while the engine serves: keeping its pauses short, and counting them.

A full collection (the oldest generation) scans every object the collector tracks. Once an engine is built that is
the model, its compiled code and captured graphs: hundreds of thousands of objects, ~0.1 s a scan on a server CPU,
during which the engine thread launches nothing: a late token for every running request, and a prefill launch
that the planner learns to fear. `freeze()` (called when the engine starts serving, as vLLM and SGLang do after
start-up) moves everything alive then out of the collector's reach, so later collections scan only what serving
made since. `recorder()` times every collection per generation (`gc.callbacks`), for /metrics and the bench's
result JSON.
"""
from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

GENERATIONS = 3
RECENT = 4096  # the latest pauses kept, for the largest pause between two snapshots


class GCPauses:
    """Collections and the time they took, per generation, since this recorder was installed (process-wide)."""

    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self.max_seconds = [0.0] * GENERATIONS
        self.frozen = 0  # objects out of the collector's reach, as of the latest freeze (counting them walks them all)
        self.recent: deque[tuple[int, int, float]] = deque(maxlen=RECENT)  # (sequence number, generation, seconds)
        self.ignoring = False  # while freeze() collects: start-up's collection is not serving's
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # collections never overlap (they hold the interpreter), so one start time serves every thread
        if self.ignoring:
            return
        if phase == "start":
            self._began = time.perf_counter()
            return
        gen = min(int(info.get("generation", 0)), GENERATIONS - 1)
        took = time.perf_counter() - self._began
        self.collections[gen] += 1
        self.seconds[gen] += took
        self.max_seconds[gen] = max(self.max_seconds[gen], took)
        self.recent.append((sum(self.collections), gen, took))

    def largest(self, after: int, upto: int) -> list[float]:
        """The largest pause per generation (seconds) among collections number `after` + 1 to `upto`; those older
        than the RECENT kept count as their generation's running maximum."""
        out = [0.0] * GENERATIONS
        if after < upto and (not self.recent or self.recent[0][0] > after + 1):
            out = [m if c else 0.0 for m, c in zip(self.max_seconds, self.collections)]
        for seq, gen, took in self.recent:
            if after < seq <= upto:
                out[gen] = max(out[gen], took)
        return out

    def snapshot(self) -> dict[str, Any]:
        """{"collections", "seconds", "max_ms"}: one entry per generation, youngest first; "frozen": objects out
        of the collector's reach."""
        return {"collections": list(self.collections), "seconds": [round(s, 6) for s in self.seconds],
                "max_ms": [round(s * 1e3, 3) for s in self.max_seconds], "frozen": self.frozen}


def since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two snapshots of the process's recorder: collections, their time and the largest
    pause, per generation."""
    largest = recorder().largest(sum(before["collections"]), sum(after["collections"]))
    return {"collections": [a - b for a, b in zip(after["collections"], before["collections"])],
            "seconds": [round(a - b, 6) for a, b in zip(after["seconds"], before["seconds"])],
            "max_ms": [round(s * 1e3, 3) for s in largest], "frozen": after["frozen"]}


_recorder: GCPauses | None = None


def recorder() -> GCPauses:
    """The process's recorder, installed on first use."""
    global _recorder
    if _recorder is None:
        _recorder = GCPauses()
        gc.callbacks.append(_recorder._callback)
    return _recorder


def freeze() -> int:
    """Collect once (objects frozen before included: an engine rebuilt leaves the old one's cycles), then keep
    every object alive now out of later collections; returns how many are frozen. Objects frozen and later dropped
    are still freed by their reference counts; only cycles among them wait for `unfreeze`."""
    rec = recorder()
    gc.unfreeze()
    rec.ignoring = True  # start-up's collection is not serving's
    try:
        gc.collect()
    finally:
        rec.ignoring = False
    gc.freeze()
    rec.frozen = gc.get_freeze_count()
    return rec.frozen


def unfreeze() -> None:
    """Give frozen objects back to the collector (an engine shut down: its cycles can be collected again)."""
    gc.unfreeze()
    recorder().frozen = 0
