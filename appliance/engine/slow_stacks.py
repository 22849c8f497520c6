"""Where a slow step launch spends its host time: the engine thread's Python stack, sampled while a launch runs longer
than a threshold (the step log keeps the samples beside the step, `StepLog(stacks_after_ms=...)`).

The samples come from the interpreter's fault handler (`faulthandler.dump_traceback_later`), whose watchdog is a C
thread that reads the frames without the interpreter's lock: a launch that ends in time costs two calls that arm and
disarm it, and a slow one is neither stopped nor slowed while it is sampled. Inside a torch call (a copy that waits
for the device, a kernel launch) the stack shows the Python line that made it.
"""
from __future__ import annotations

import faulthandler
import os
import re
import tempfile
import threading

LEAF_FRAMES = 6  # innermost frames kept per sample, whatever their package
OWN_FRAMES = 10  # then the innermost of muxd's own frames
MAX_SAMPLES = 6  # samples kept per launch

_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')


class SlowStacks:
    """Samples the calling thread's stack every `after_ms` while a launch (between `begin` and `end`) runs."""

    def __init__(self, after_ms: float) -> None:
        if after_ms <= 0:
            raise ValueError(f"stacks_after_ms must be positive, got {after_ms}")
        self.after_s = after_ms / 1e3
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._fd = self._file.fileno()
        self._start = 0
        self._thread = 0

    def begin(self) -> None:
        self._thread = threading.get_ident()
        self._start = os.lseek(self._fd, 0, os.SEEK_END)
        faulthandler.dump_traceback_later(self.after_s, repeat=True, file=self._fd)

    def end(self) -> list[list[str]]:
        """Disarm; the samples taken since `begin` (innermost frame first), none for a launch that ended in time."""
        faulthandler.cancel_dump_traceback_later()
        size = os.lseek(self._fd, 0, os.SEEK_END) - self._start
        if size <= 0:
            return []
        text = os.pread(self._fd, size, self._start).decode("utf-8", "replace")
        return engine_stacks(text, self._thread)[:MAX_SAMPLES]

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._file.close()


def engine_stacks(text: str, thread: int) -> list[list[str]]:
    """The stacks of thread `thread` in fault-handler dumps: one list of 'path:line function' per dump, innermost
    first (the innermost few, then muxd's own frames), paths from the package directory (appliance/, torch/, ...)
    on."""
    name = f"0x{thread:016x}"
    stacks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            current = [] if name in line else None
            if current is not None:
                stacks.append(current)
            continue
        match = _FRAME.match(line)
        if match and current is not None:
            current.append(f"{_short(match['path'])}:{match['line']} {match['func'].strip()}")
    return [_kept(s) for s in stacks if s]


def _kept(frames: list[str]) -> list[str]:
    """The innermost frames, then muxd's own frames further out (where in the engine the leaf was called from)."""
    own = [f for f in frames[LEAF_FRAMES:] if f.startswith("appliance/")]
    return frames[:LEAF_FRAMES] + own[:OWN_FRAMES]


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("appliance", "torch", "flashinfer", "triton", "site-packages", "dist-packages"):
            return "/".join(parts[i + (parts[i] in ("site-packages", "dist-packages")):])
    return "/".join(parts[-2:])
