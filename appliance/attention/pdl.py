"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of one-row decode steps.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still finishing: its launch
and its start overlap the other's last blocks, and it waits on the device (`griddepcontrol.wait`) before it reads
what that kernel wrote. A one-row decode step runs about 300 kernels that each read little, so the time between
them counts: there the single-token compiled graph (Inductor's `triton.enable_pdl`, which places its waits itself)
and muxd's Triton kernels (which wait first) launch with PDL. Measured on an H200 (`muxd bench engine`), a one-row
step came down from 1.19-1.20x to 1.14x its byte floor at 1k and 8k contexts; at 8 rows it was 0.1-0.3 ms slower and
at 64 rows no faster, so larger batches launch plainly (`MAX_ROWS`). `set_enabled` (the runtime's `--pdl` setting)
turns it off for the process; it takes effect only on CUDA devices of compute capability 9.0 and later.
"""
from __future__ import annotations

import functools

import torch

MAX_ROWS = 1  # launches of up to this many rows use PDL

_enabled = True


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def active(device: torch.device, rows: int = 1) -> bool:
    """Whether a launch of `rows` rows on `device` uses PDL."""
    if not _enabled or device.type != "cuda" or rows > MAX_ROWS:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device, rows: int) -> dict:
    """Keyword arguments of a Triton launch of `rows` rows of a kernel with a `PDL` constexpr: its own and, where
    active, Triton's `launch_pdl`."""
    return {"PDL": True, "launch_pdl": True} if active(device, rows) else {"PDL": False}
