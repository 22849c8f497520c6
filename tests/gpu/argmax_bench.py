"""The sampler's row-wise argmax alone: torch.argmax against muxd's Triton argmax (`sampler.triton_argmax`), fp32
logits [rows, vocab]. Prints per way and row count the host time of a call (launches queued back to back, no
synchronisation) and the device time of a call (a CUDA graph of 20 calls, timed with events).

    PYTHONPATH=. python tests/gpu/argmax_bench.py [--rows 1,8,64] [--vocab 128256]
"""
from __future__ import annotations

import argparse
import time

import torch

from appliance.engine.sampler import triton_argmax


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, vocabulary {args.vocab}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.vocab, device="cuda")
        out = torch.empty(rows, dtype=torch.long, device="cuda")
        ways = {"torch": lambda: torch.argmax(x, -1, out=out), "triton": lambda: triton_argmax(x, out)}
        for name, call in ways.items():
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                call()
            host_us = (time.perf_counter() - start) / 200 * 1e6
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    call()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            begin.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            device_us = begin.elapsed_time(end) / 20 * 1e3
            print(f"rows {rows:4d} {name:6s}: host {host_us:6.1f} us a call, device {device_us:6.1f} us a call")


if __name__ == "__main__":
    main()
