"""muxd's own paged decode attention for small CUDA-graph batches: a split-KV kernel in Triton.

At a few rows, decode attention is bound by latency, not bandwidth: flashinfer's decode, planned for the batch on
the host, takes about 11 us a layer for a 1k context whose bytes take 1 us (H200). Here each (row, KV head, split)
program reads a run of that row's pages with its whole GQA group of query heads in one tile, then one program per
(row, head) merges the splits' partial softmaxes. The grid is fixed by the batch size, and each program finds its
pages from the row's length on the device (a split covers at least `PAGES_PER_BLOCK` pages; splits past the row's
end do nothing), so a graph captured once serves any context and the host plans nothing but one index copy.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from appliance.attention.metadata import AttentionMetadata
from appliance.attention.pinned import PinnedRing

MAX_BATCH = 8          # graph batches up to this many rows use the kernel (measured faster than flashinfer there)
PAGES_PER_BLOCK = 4    # pages one program reads per loop iteration, and the least a split covers
NUM_WARPS = 4

_kernels = None


def splits_for(batch: int) -> int:
    """KV splits per (row, KV head), a power of two: enough programs to fill the GPU at one row, fewer as rows add
    programs."""
    return max(8, 64 >> (max(batch, 1) - 1).bit_length())


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> str | None:
    """Why the kernel cannot serve this shape (None when it can): tile sizes must be powers of two."""
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
    for name, n in (("head_dim", head_dim), ("page size", page_size)):
        if n < 1 or n & (n - 1):
            return f"{name} {n} is not a power of two"
    if num_heads // num_kv_heads > 64:
        return f"a group of {num_heads // num_kv_heads} query heads per KV head is over 64"
    return None


def _build():
    global _kernels
    if _kernels is None:
        from appliance.attention.triton_decode_kernels import decode_merge, decode_partial  # defers Triton

        _kernels = (decode_partial, decode_merge)
    return _kernels


class TritonDecode:
    """Decode attention of a fixed number of rows (a CUDA-graph batch size) with fixed device index buffers:
    `plan()` copies a batch's layout into them without waiting (stream-ordered, like the graph's other inputs);
    `run()` launches the two kernels and is what a graph captures."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, batch: int, max_pages: int,
                 device: torch.device, splits: int | None = None, pages_per_block: int = PAGES_PER_BLOCK,
                 num_warps: int = NUM_WARPS) -> None:
        """splits (a power of two; default `splits_for(batch)`), pages_per_block and num_warps: the tiling, which
        tests/gpu/decode_attention_bench.py can sweep."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.batch, self.splits = batch, splits or splits_for(batch)
        self.pages_per_block, self.num_warps = pages_per_block, num_warps
        # [indptr (batch + 1) | seq_lens (batch) | page indices (max_pages)], filled by one copy a plan
        self.index = torch.zeros(2 * batch + 1 + max(max_pages, batch), dtype=torch.int32, device=device)
        self.indptr = self.index[:batch + 1]
        self.seq_lens = self.index[batch + 1:2 * batch + 1]
        self.indices = self.index[2 * batch + 1:]
        self.partial_out = torch.empty(batch * num_heads * self.splits * head_dim, dtype=torch.float32,
                                       device=device)
        self.partial_lse = torch.empty(batch * num_heads * self.splits, dtype=torch.float32, device=device)
        self.scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        self._staging = PinnedRing(torch.int32, pinned=device.type == "cuda")

    def plan(self, m: AttentionMetadata) -> None:
        if m.num_seqs != self.batch or not m.decode_only:
            raise RuntimeError(f"the Triton decode of {self.batch} rows got {m.num_seqs} sequences "
                               f"of {m.num_tokens} tokens")
        if len(m.kv_indices) > len(self.indices):
            raise RuntimeError(f"the batch lists {len(m.kv_indices)} pages; the decode holds {len(self.indices)}")
        packed, _ = self._staging.stage([m.kv_indptr, m.seq_lens, np.asarray(m.kv_indices, dtype=np.int32)])
        self.index[:len(packed)].copy_(packed, non_blocking=True)
        self._staging.done()

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [batch, H, D]; k/v cache [pages, page_size, Hkv, D] of one layer -> [batch, H, D]."""
        partial, merge = _build()
        out = torch.empty_like(q)
        b = q.shape[0]
        page = k_cache.shape[1]
        partial[(b, self.num_kv_heads, self.splits)](
            q, k_cache, v_cache, self.indptr, self.indices, self.seq_lens, self.partial_out, self.partial_lse,
            self.scale_log2, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            G=self.group, GP=max(16, 1 << (self.group - 1).bit_length()), D=self.head_dim, PAGE=page,
            PPB=self.pages_per_block, SPLITS=self.splits, num_warps=self.num_warps)
        merge[(b, self.num_heads)](self.partial_out, self.partial_lse, self.seq_lens, out, out.stride(0),
                                   out.stride(1), D=self.head_dim, PAGE=page, PPB=self.pages_per_block,
                                   SPLITS=self.splits)
        return out
