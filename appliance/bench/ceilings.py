"""Ceilings of the device measured in the same run as the thing being timed: device-to-device copy bandwidth (bytes
read plus bytes written per second), the bf16 GEMM rate on random data and, for a model split across GPUs, the link
between two of them (bytes one GPU copies into another's memory per second). Speed is reported as a ratio to these.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.engine.cuda_timing import time_cuda


@dataclass
class Ceilings:
    device_name: str
    copy_bytes_per_s: float   # read + write
    gemm_flops_per_s: float   # bf16 8192^3 on random inputs
    link_bytes_per_s: float | None = None  # GPU 0 -> GPU 1, one direction (measured only for several GPUs)

    def as_dict(self) -> dict:
        out = {"device": self.device_name, "copy_TBps": self.copy_bytes_per_s / 1e12,
               "gemm_TFLOPps": self.gemm_flops_per_s / 1e12}
        if self.link_bytes_per_s is not None:
            out["link_GBps"] = self.link_bytes_per_s / 1e9
        return out


def measure_ceilings(copy_bytes: int = 2 << 30, gemm_n: int = 8192, gpus: int = 1) -> Ceilings:
    """Copy bandwidth over a buffer far larger than L2, and the GEMM rate, on the current CUDA device; with `gpus`
    above 1, also the link from GPU 0 to GPU 1."""
    copy_s = _time_copy(copy_bytes)
    gemm_s = _time_gemm(gemm_n)
    link = None
    if gpus > 1 and torch.cuda.device_count() > 1:
        link_bytes = copy_bytes // 4
        link = link_bytes / _time_link(link_bytes)
        with torch.cuda.device(1):
            torch.cuda.empty_cache()
    torch.cuda.empty_cache()
    return Ceilings(torch.cuda.get_device_name(), 2 * copy_bytes / copy_s, 2 * gemm_n ** 3 / gemm_s, link)


def _time_copy(nbytes: int) -> float:
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src))


def _time_link(nbytes: int) -> float:
    """Seconds GPU 0 takes to copy `nbytes` into GPU 1's memory (peer to peer where the GPUs allow it)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda:1")
    with torch.cuda.device(0):
        return time_cuda(lambda: dst.copy_(src, non_blocking=True))


def _time_gemm(n: int) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return time_cuda(lambda: a @ b, iters=10)
