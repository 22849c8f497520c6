"""L2 prefetch of the output projection's weights by one-row decode attention (`--l2-prefetch`, off by default).

A one-row decode step reads about 14 GB of weights (Llama-3.1-8B) in some 270 kernels; each matrix-vector kernel
starts and ends below the memory's rate, and muxd's split-KV attention kernel, bound by latency at one row, leaves the
memory idle for most of its run. With this on, the attention programs first pull the layer's output projection
weights (the next kernel's bytes, which no kernel of the step writes) into L2, and load their K/V with the
priority to leave L2 first; the projection then reads its weights from L2. At most `L2_SHARE` of the GPU's
L2 is prefetched a layer. `set_enabled` (the runtime's `--l2-prefetch` setting) turns it on for the process; it
takes effect at one row (`MAX_ROWS`), on CUDA devices of compute capability 9.0 and later, with muxd's split-KV
decode kernel.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

MAX_ROWS = 1      # graphs of up to this many rows prefetch
L2_SHARE = 0.75   # the most of the L2 cache one layer's prefetch covers

_enabled = False


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    """The L2 size of a capable device (0 for one before compute capability 9.0)."""
    if torch.cuda.get_device_capability(index)[0] < 9:
        return 0
    return int(torch.cuda.get_device_properties(index).L2_cache_size)


def active(device: torch.device, rows: int = 1) -> bool:
    """Whether attention of `rows` rows on `device` prefetches."""
    if not _enabled or device.type != "cuda" or rows > MAX_ROWS:
        return False
    return _l2_bytes(device.index if device.index is not None else torch.cuda.current_device()) > 0


def targets(weights: Sequence[torch.Tensor], device: torch.device,
            rows: int = 1) -> list[torch.Tensor | None] | None:
    """Per layer, the bytes its attention prefetches (a byte view of the start of each weight, at most `L2_SHARE`
    of L2; None for a weight not laid out in one piece), for a graph of `rows` rows; None where it does not
    prefetch."""
    if not active(device, rows):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = int(_l2_bytes(index) * L2_SHARE)
    return [w.detach().view(-1).view(torch.uint8)[:cap] if w.is_contiguous() else None for w in weights]


def launch_args(target: torch.Tensor | None, fallback: torch.Tensor) -> tuple[tuple[torch.Tensor, int], dict]:
    """The (pointer, bytes) arguments and the `PREFETCH` constexpr of a kernel launch that prefetches `target` (a byte
    tensor from `targets`) or, for None, nothing (`fallback`: any tensor, as an unused pointer)."""
    if target is None:
        return (fallback, 0), {"PREFETCH": False}
    return (target, target.numel()), {"PREFETCH": True}
