"""A bounded log of what the executor ran where and when (host clock): decode steps and prefill launches per SM
partition, merges of finished prefills, preemptions. Exported as Chrome-trace JSON (chrome://tracing, Perfetto).
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path


class Timeline:
    def __init__(self, capacity: int = 20_000) -> None:
        self._events: deque[dict] = deque(maxlen=capacity)
        self._origin = time.perf_counter()
        self._lock = threading.Lock()  # the engine thread writes, the HTTP server reads

    def _us(self, t: float) -> float:
        return (t - self._origin) * 1e6

    def span(self, name: str, track: str, start: float, end: float, **args) -> None:
        """Something that ran on `track` (a partition's stream) from start to end (perf_counter seconds)."""
        with self._lock:
            self._events.append({"name": name, "ph": "X", "ts": self._us(start), "dur": max(0.0, self._us(end) -
                                 self._us(start)), "pid": 1, "tid": track, "args": args})

    def instant(self, name: str, track: str, at: float | None = None, **args) -> None:
        with self._lock:
            self._events.append({"name": name, "ph": "i", "s": "t", "ts": self._us(at or time.perf_counter()),
                                 "pid": 1, "tid": track, "args": args})

    def chrome_trace(self) -> dict:
        with self._lock:
            events = list(self._events)
        tracks = sorted({e["tid"] for e in events})
        ids = {t: i for i, t in enumerate(tracks)}
        out = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": ids[t], "args": {"name": t}} for t in tracks]
        out += [dict(e, tid=ids[e["tid"]]) for e in events]
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def save(self, path: str | Path, last_seconds: float | None = None) -> None:
        """Write the trace (only its last `last_seconds` when given, to keep a file small)."""
        trace = self.chrome_trace()
        if last_seconds is not None:
            spans = [e["ts"] for e in trace["traceEvents"] if e["ph"] != "M"]
            cut = max(spans, default=0.0) - last_seconds * 1e6
            trace["traceEvents"] = [e for e in trace["traceEvents"] if e["ph"] == "M" or e["ts"] >= cut]
        Path(path).write_text(json.dumps(trace))

    def __len__(self) -> int:
        return len(self._events)
