"""Decode steps' wall time against their device time, from the step logs of this directory (or of a --save-steps
point JSON): all decode steps, the temporal steps' prefill layers counted as theirs (as `muxd bench diagnose`
prints it), decode steps that follow a decode step (no earlier step's device time spilling into their wall), and
every step of the replay.

    python walldev.py steps-chat-short-seed7.csv.gz steps-random-700-180.csv.gz
"""
import csv
import gzip
import json
import statistics
import sys


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        if ".csv" in path:
            return [{k: v if k == "mode" else (None if v == "" else float(v)) for k, v in row.items()}
                    for row in csv.DictReader(f)]
        return json.load(f)["steps"]


def decode_only(s: dict) -> bool:
    return bool(s.get("device_ms")) and bool(s["decode"]) and not s["mixed"] and s.get("launch_ms") is not None


def ratio(steps: list[dict], own: bool = False) -> str:
    wall = statistics.fmean(s["launch_ms"] for s in steps)
    dev = statistics.fmean(s["device_ms"] + ((s.get("after_ms") or 0.0) if own else 0.0) for s in steps)
    return f"{len(steps)} steps, wall {wall:.2f} ms, device {dev:.2f} ms: {wall / dev:.3f}"


for path in sys.argv[1:]:
    steps = load(path)
    timed = [s for s in steps if decode_only(s)]
    plain = [b for a, b in zip(steps, steps[1:]) if decode_only(a) and decode_only(b) and not a.get("after_ms")
             and not a.get("layers") and not b.get("after_ms") and not b.get("layers")]
    every = [s for s in steps if s.get("launch_ms") is not None]
    wall = sum(s["launch_ms"] for s in every)
    dev = sum((s.get("device_ms") or 0.0) + (s.get("after_ms") or 0.0) for s in every)
    print(path)
    print(f"  decode steps: {ratio(timed)}; with the temporal steps' prefill layers: {ratio(timed, own=True)}")
    print(f"  decode steps after a decode step: {ratio(plain)}")
    print(f"  every step: wall {wall / 1e3:.1f} s, device {dev / 1e3:.1f} s: {wall / dev:.3f}")
