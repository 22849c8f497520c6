"""Where a slow step launch spends its host time: the engine thread's Python stack, sampled while a launch runs longer
than a threshold (the step log keeps the samples beside the step, `StepLog(stacks_after_ms=...)`).

A sampler thread wakes every half threshold and, when the launch under way began longer ago than the threshold,
takes the engine thread's innermost frames (`sys._current_frames`). It runs under the interpreter's lock, as any
Python thread: a sample lands where the engine thread let the lock go (between two of its bytecodes, or in a torch
call that releases it), so a launch stuck inside a call that keeps the lock is sampled just after that call. Waking
costs the engine a switch of the lock, about 80 times a second while a log is attached (`muxd bench --save-steps`).
"""
from __future__ import annotations

import sys
import threading
import time
from types import FrameType

LEAF_FRAMES = 6  # innermost frames kept per sample, whatever their package
OWN_FRAMES = 10  # then the innermost of muxd's own frames
MAX_SAMPLES = 6  # samples kept per launch
MAX_DEPTH = 80  # frames walked per sample


class SlowStacks:
    """Samples the thread that calls `begin` while its launch (until `end`) runs longer than `after_ms`."""

    def __init__(self, after_ms: float) -> None:
        if after_ms <= 0:
            raise ValueError(f"stacks_after_ms must be positive, got {after_ms}")
        self.after_s = after_ms / 1e3
        self._lock = threading.Lock()
        self._launch = 0  # the running launch's number (0: none running)
        self._count = 0
        self._began = 0.0
        self._thread = 0
        self._samples: list[list[str]] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._run, name="muxd-slow-stacks", daemon=True)
        self._sampler.start()

    def begin(self) -> None:
        with self._lock:
            self._count += 1
            self._launch, self._began, self._thread, self._samples = self._count, time.perf_counter(), \
                threading.get_ident(), []

    def end(self) -> list[list[str]]:
        """The samples taken since `begin` (innermost frame first): none for a launch that ended in time."""
        with self._lock:
            self._launch = 0
            samples, self._samples = self._samples, []
        return samples

    def close(self) -> None:
        self._stop.set()
        self._sampler.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.after_s / 2):
            with self._lock:
                launch, began, thread = self._launch, self._began, self._thread
            if not launch or time.perf_counter() - began < self.after_s:
                continue
            frame = sys._current_frames().get(thread)
            if frame is None:
                continue
            stack = frames(frame)
            with self._lock:
                if self._launch == launch and len(self._samples) < MAX_SAMPLES:
                    self._samples.append(stack)


def frames(frame: FrameType | None) -> list[str]:
    """'path:line function' of `frame` and its callers, innermost first: the innermost few, then muxd's own frames
    further out (where in the engine the leaf was called from), paths from the package directory on."""
    out: list[str] = []
    while frame is not None and len(out) < MAX_DEPTH:
        code = frame.f_code
        out.append(f"{_short(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    own = [f for f in out[LEAF_FRAMES:] if f.startswith("appliance/")]
    return out[:LEAF_FRAMES] + own[:OWN_FRAMES]


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("appliance", "torch", "flashinfer", "triton", "site-packages", "dist-packages"):
            return "/".join(parts[i + (parts[i] in ("site-packages", "dist-packages")):])
    return "/".join(parts[-2:])
