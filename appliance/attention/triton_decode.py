"""muxd's own paged decode attention for CUDA-graph batches, in Triton: a split-KV kernel for a few rows, a balanced
one beyond.

At a few rows, decode attention is bound by latency, not bandwidth: flashinfer's decode, planned for the batch on
the host, takes about 11 us a layer for a 1k context whose bytes take 1 us (H200). Here each (row, KV head, split)
program reads a run of that row's pages with its whole GQA group of query heads in one tile, then one program per
(row, head) merges the splits' partial softmaxes. The grid is fixed by the batch size, and each program finds its
pages from the row's length on the device (a split covers at least `PAGES_PER_BLOCK` pages; splits past the row's
end do nothing), so a graph captured once serves any context and the host plans nothing but one index copy.

`BalancedTritonDecode` serves larger batches: the host cuts the batch's rows into work items of about equal pages
(`balance`: a short row is one item, a long one several), one program per (KV head, item) on a grid fixed by the
batch size, and the last item of a cut row to finish merges its partials, so one launch a layer serves any mix of
lengths. It aims at `BALANCED_WAVES` programs an SM: a whole number of rounds of the programs an SM holds at once, so
no nearly empty last round.

`TritonDecode.run_rope` folds the rotary kernel's work into the split kernel (q/k norms, the rotation, the new
K/V written to the cache and added to the softmax from registers): one launch a layer fewer, 0.03-0.08 ms a step
at 1-8 rows (H200). `ROPE_IN_ATTENTION` turns it off.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from appliance.attention.metadata import AttentionMetadata
from appliance.attention.pdl import launch_options
from appliance.attention.pinned import PinnedRing

MAX_BATCH = 8          # graph batches up to this many rows run the split-KV kernel, larger ones the balanced one
PAGES_PER_BLOCK = 2    # pages one program reads per loop iteration, and the least a split covers
NUM_WARPS = 2          # (measured faster than 4 warps x 4 pages at 1-8 rows)
NUM_STAGES = 3         # Triton's software pipelining of the page loop: 2 tiles of K/V in flight a program
PROGRAMS_PER_SM = 6    # programs of the split kernel an SM holds at once (156 registers a thread at 2 warps; 37 KB
                       # of shared memory at 3 stages)
ROPE_IN_ATTENTION = True  # the split kernel rotates q and writes the new K/V itself (`run_rope`: one launch a layer
                          # fewer)

BALANCED_PAGES_PER_BLOCK = 4
BALANCED_WARPS = 4
BALANCED_STAGES = 3
BALANCED_PROGRAMS_PER_SM = 3  # programs of the balanced kernel an SM holds at once (70 KB of shared memory at 3
                              # stages; 126-142 registers a thread)
BALANCED_WAVES = 6       # programs a balanced plan aims at, in SMs' worth (two rounds of what an SM holds)
BALANCED_MIN_PAGES = 8   # the least pages a work item of a cut row covers
BALANCED_MAX_SPLITS = 32  # items a row is cut into at most

_kernels = None
_balanced = None


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
        from appliance.attention.triton_decode_kernels import (  # defers Triton
            decode_merge,
            decode_partial,
            decode_partial_rope,
        )

        _kernels = (decode_partial, decode_merge, decode_partial_rope)
    return _kernels


class TritonDecode:
    """Decode attention of a fixed number of rows (a CUDA-graph batch size) with fixed device index buffers:
    `plan()` copies a batch's layout into them without waiting (stream-ordered, like the graph's other inputs);
    `run()` launches the two kernels and is what a graph captures."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, batch: int, max_pages: int,
                 device: torch.device, splits: int | None = None, pages_per_block: int = PAGES_PER_BLOCK,
                 num_warps: int = NUM_WARPS, scratch: torch.Tensor | None = None,
                 num_stages: int = NUM_STAGES, rope: bool | None = None) -> None:
        """splits (a power of two; default `splits_for(batch)`), pages_per_block, num_warps and num_stages (the
        page loop's pipelining depth): the tiling, which tests/gpu/decode_attention_bench.py can sweep; scratch: a
        device buffer the partials may live in (`partials`); rope: whether `run_rope` serves the backend's fused
        QKV calls (default `ROPE_IN_ATTENTION`)."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.batch, self.splits = batch, splits or splits_for(batch)
        self.pages_per_block, self.num_warps, self.num_stages = pages_per_block, num_warps, num_stages
        # [indptr (batch + 1) | seq_lens (batch) | page indices (max_pages)], filled by one copy a plan
        self.index = torch.zeros(2 * batch + 1 + max(max_pages, batch), dtype=torch.int32, device=device)
        self.indptr = self.index[:batch + 1]
        self.seq_lens = self.index[batch + 1:2 * batch + 1]
        self.indices = self.index[2 * batch + 1:]
        self.partial_out, self.partial_lse = partials(batch * num_heads * self.splits, head_dim, device, scratch)
        self.scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        self._staging = PinnedRing(torch.int32, pinned=device.type == "cuda")
        self.fuses_rope = ROPE_IN_ATTENTION if rope is None else rope

    def plan(self, m: AttentionMetadata) -> None:
        _copy_plan(self, m, [m.kv_indptr, m.seq_lens, np.asarray(m.kv_indices, dtype=np.int32)])

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [batch, H, D]; k/v cache [pages, page_size, Hkv, D] of one layer -> [batch, H, D]."""
        partial, merge, _ = _build()
        out = torch.empty_like(q)
        b = q.shape[0]
        page = k_cache.shape[1]
        launch = launch_options(q.device, b)
        partial[(b, self.num_kv_heads, self.splits)](
            q, k_cache, v_cache, self.indptr, self.indices, self.seq_lens, self.partial_out, self.partial_lse,
            self.scale_log2, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            G=self.group, GP=max(16, 1 << (self.group - 1).bit_length()), D=self.head_dim, PAGE=page,
            PPB=self.pages_per_block, SPLITS=self.splits, num_warps=self.num_warps, num_stages=self.num_stages,
            **launch)
        merge[(b, self.num_heads)](self.partial_out, self.partial_lse, self.seq_lens, out, out.stride(0),
                                   out.stride(1), D=self.head_dim, PAGE=page, PPB=self.pages_per_block,
                                   SPLITS=self.splits, **launch)
        return out

    def run_rope(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv: torch.Tensor,
                 slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
        """`run` of a fused QKV projection [batch, (H + 2 Hkv) D] not yet rotated, with the rotary kernel's work
        (kv_write.rope_write_kv: q/k norms where given, the rotation by cos_sin at `positions`, the new K/V written
        at `slot_mapping` of kv [2, pages, page_size, Hkv, D]) done by the attention kernel -> [batch, H, D]. For
        tensors `kv_write.rope_kernel_takes`."""
        _, merge, partial_rope = _build()
        b, page, d = qkv.shape[0], kv.shape[2], self.head_dim
        out = qkv.new_empty(b, self.num_heads, d)
        norm = q_norm is not None and k_norm is not None
        launch = launch_options(qkv.device, b)
        partial_rope[(b, self.num_kv_heads, self.splits)](
            qkv, positions, cos_sin, slot_mapping, q_norm if norm else qkv, k_norm if norm else qkv, kv[0], kv[1],
            self.indptr, self.indices, self.seq_lens, self.partial_out, self.partial_lse, self.scale_log2, float(eps),
            qkv.stride(0), cos_sin.shape[0], kv.stride(1), kv.stride(2), kv.stride(3), HEADS=self.num_heads,
            KV_HEADS=self.num_kv_heads, G=self.group, GP=max(16, 1 << (self.group - 1).bit_length()), D=d, PAGE=page,
            PPB=self.pages_per_block, SPLITS=self.splits, NORM=norm, num_warps=self.num_warps,
            num_stages=self.num_stages, **launch)
        merge[(b, self.num_heads)](self.partial_out, self.partial_lse, self.seq_lens, out, out.stride(0),
                                   out.stride(1), D=d, PAGE=page, PPB=self.pages_per_block, SPLITS=self.splits,
                                   **launch)
        return out


def balance(npages: np.ndarray, target: int, capacity: int, min_pages: int = BALANCED_MIN_PAGES,
            max_splits: int = BALANCED_MAX_SPLITS) -> np.ndarray:
    """Work items [capacity, 5] (row, first page, end page, the row's first item, the row's items; -1 past the last
    item) cutting rows of `npages` pages into about `target` items of equal pages: each row into round(pages /
    chunk) items (at least one, at most max_splits) of chunk >= min_pages pages."""
    npages = np.asarray(npages, dtype=np.int64)
    chunk = max(min_pages, -(-int(npages.sum()) // max(target, 1)))
    while True:
        splits = np.clip(np.rint(npages / chunk).astype(np.int64), 1, max_splits)
        if splits.sum() <= capacity:
            break
        chunk *= 2
    per = -(-npages // splits)
    rows = np.repeat(np.arange(len(npages)), splits)
    start = np.cumsum(splits) - splits
    k = np.arange(int(splits.sum())) - start[rows]
    p0 = k * per[rows]
    items = np.full((capacity, 5), -1, dtype=np.int32)
    items[:len(rows)] = np.stack([rows, p0, np.minimum(p0 + per[rows], npages[rows]), start[rows], splits[rows]], 1)
    return items


def balanced_sizes(waves: int, sm_count: int, num_kv_heads: int, batch: int) -> tuple[int, int]:
    """The items a balanced plan of `batch` rows aims at (`waves` programs an SM, over the KV heads) and the items
    its grid holds (the aim and two more a row: the room `balance` may take beyond it)."""
    target = max(1, -(-waves * sm_count // num_kv_heads))
    return target, target + 2 * batch


class BalancedTritonDecode:
    """Decode attention of a fixed number of rows (a CUDA-graph batch size) in one launch, its rows cut into work
    items of about equal pages on the host at each `plan()` (one index copy, stream-ordered); `run()` is what a
    graph captures."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, batch: int, max_pages: int,
                 device: torch.device, sm_count: int | None = None,
                 pages_per_block: int = BALANCED_PAGES_PER_BLOCK, num_warps: int = BALANCED_WARPS,
                 scratch: torch.Tensor | None = None, waves: int = BALANCED_WAVES,
                 min_pages: int = BALANCED_MIN_PAGES, num_stages: int = BALANCED_STAGES) -> None:
        """sm_count: the GPU's (the device's when None; 132 off CUDA), which with `waves` (programs in SMs' worth)
        sets the items a plan aims at; min_pages: the least pages an item of a cut row covers; scratch: a device
        buffer the partials may live in (`partials`)."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.group_pad = max(16, 1 << (self.group - 1).bit_length())  # the query tile's rows (tl.dot takes >= 16)
        if sm_count is None:
            sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
                else 132
        self.target, self.capacity = balanced_sizes(waves, sm_count, num_kv_heads, batch)
        self.min_pages = min_pages
        self.batch = batch
        self.pages_per_block, self.num_warps, self.num_stages = pages_per_block, num_warps, num_stages
        # [indptr (batch + 1) | seq_lens (batch) | items (capacity x 5) | page indices (max_pages)], one copy a plan
        items = 5 * self.capacity
        self.index = torch.zeros(2 * batch + 1 + items + max(max_pages, batch), dtype=torch.int32, device=device)
        self.indptr = self.index[:batch + 1]
        self.seq_lens = self.index[batch + 1:2 * batch + 1]
        self.items = self.index[2 * batch + 1:2 * batch + 1 + items]
        self.indices = self.index[2 * batch + 1 + items:]
        # partials [item, KV head, query head of the group]
        self.partial_out, self.partial_lse = partials(self.capacity * num_kv_heads * self.group, head_dim, device,
                                                      scratch)
        # items of each (row, KV head) done so far; the row's last resets it to zero
        self.counts = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=device)
        self.scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        self._staging = PinnedRing(torch.int32, pinned=device.type == "cuda")

    def plan(self, m: AttentionMetadata) -> None:
        items = balance(-(-np.asarray(m.seq_lens, dtype=np.int64) // m.page_size), self.target, self.capacity,
                        self.min_pages)
        _copy_plan(self, m, [m.kv_indptr, m.seq_lens, items.ravel(), np.asarray(m.kv_indices, dtype=np.int32)])

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [batch, H, D]; k/v cache [pages, page_size, Hkv, D] of one layer -> [batch, H, D]."""
        global _balanced
        if _balanced is None:
            from appliance.attention.triton_decode_kernels import decode_balanced  # defers Triton

            _balanced = decode_balanced
        out = torch.empty_like(q)
        _balanced[(self.num_kv_heads, self.capacity)](
            q, k_cache, v_cache, self.indptr, self.indices, self.seq_lens, self.items, self.partial_out,
            self.partial_lse, self.counts, out, self.scale_log2, q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), G=self.group, GP=self.group_pad,
            D=self.head_dim, PAGE=k_cache.shape[1], PPB=self.pages_per_block, num_warps=self.num_warps,
            num_stages=self.num_stages)
        return out


def partials(rows: int, head_dim: int, device: torch.device,
             scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 buffers for `rows` partial outputs [rows * head_dim] and their log-sum-exps [rows]: views of `scratch`
    (bytes on the device, e.g. the float workspace that graph backends of one stream share, as their replays never
    overlap) where it holds them, else their own."""
    need = rows * (head_dim + 1)
    if scratch is not None and scratch.device == torch.device(device) and scratch.numel() * scratch.element_size() \
            >= 4 * need and scratch.is_contiguous():
        floats = scratch.view(-1)[:4 * need].view(torch.float32)
        return floats[:rows * head_dim], floats[rows * head_dim:need]
    return (torch.empty(rows * head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def _copy_plan(dec: TritonDecode | BalancedTritonDecode, m: AttentionMetadata, arrays: list[np.ndarray]) -> None:
    """Check a decode batch against a graph decode's sizes and copy its layout (`arrays`, packed in the order of the
    decode's index buffer) there without waiting."""
    if m.num_seqs != dec.batch or not m.decode_only:
        raise RuntimeError(f"the Triton decode of {dec.batch} rows got {m.num_seqs} sequences of {m.num_tokens} tokens")
    if len(m.kv_indices) > len(dec.indices):
        raise RuntimeError(f"the batch lists {len(m.kv_indices)} pages; the decode holds {len(dec.indices)}")
    packed, _ = dec._staging.stage(arrays)
    dec.index[:len(packed)].copy_(packed, non_blocking=True)
    dec._staging.done()
