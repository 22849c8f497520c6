"""The host time of a GEMM's first launch at each row count, against its second: the LM head (vocabulary x hidden, as
a mixed step or a prefill launch computes logits outside the decode graphs) at 1..`--rows` rows. cuBLAS chooses its
kernel by the shape, and the driver loads a kernel's module at its first launch (lazy loading, the CUDA default):
the rows at which the first launch is slow are where the choice changes. The engine launches every such size once at
start-up (`kernel_warm_s` in its start-up figures) so that serving never pays it.

    PYTHONPATH=. python tests/gpu/first_launch_bench.py [--rows 256] [--hidden 4096] [--vocab 128256] [--over-ms 1]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--over-ms", type=float, default=1.0, help="list launches whose host time exceeds this")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("first_launch_bench needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')}")
    w = torch.randn(args.vocab, args.hidden, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(args.rows, args.hidden, dtype=torch.bfloat16, device="cuda")
    F.linear(x[:1], w)  # the library's handle and first kernel
    torch.cuda.synchronize()
    for launch in ("first", "second"):
        slow, total = [], 0.0
        for rows in range(1, args.rows + 1):
            start = time.perf_counter()
            F.linear(x[:rows], w)
            ms = (time.perf_counter() - start) * 1e3
            torch.cuda.synchronize()
            total += ms
            if ms > args.over_ms:
                slow.append(f"{rows}: {ms:.1f}")
        print(f"{launch} launch at each row count: {total:.1f} ms of host in all; over {args.over_ms} ms "
              f"({len(slow)}): {', '.join(slow) or '-'}")


if __name__ == "__main__":
    main()
