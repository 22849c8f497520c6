"""Builds the flat token batch of one forward from requests and token spans: token ids, positions and attention
metadata, computed with vectorised numpy and sent to the device in one copy from pinned memory.

Each request's page list is mirrored in a numpy array that grows as pages are appended, so a step costs O(new pages),
never a Python loop over every token or page.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from appliance.attention import AttentionMetadata, page_layout
from appliance.engine.request import Request


@dataclass
class TokenBatch:
    input_ids: torch.Tensor   # [T] int64, device
    positions: torch.Tensor   # [T] int64, device
    metadata: AttentionMetadata
    last_rows: np.ndarray     # row of each sequence's last token

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def span_tokens(r: Request, start: int, end: int) -> list[int]:
    """r.all_token_ids[start:end] without building the whole list (decode reads one token of a long context)."""
    n = len(r.prompt_token_ids)
    if start >= n:
        return r.output_token_ids[start - n:end - n]
    if end <= n:
        return r.prompt_token_ids[start:end]
    return r.prompt_token_ids[start:] + r.output_token_ids[:end - n]


class _PageMirror:
    __slots__ = ("source", "array", "size")

    def __init__(self, source: list[int]) -> None:
        self.source = source  # the PagePool's list object: appended to in place, replaced when reallocated
        self.array = np.empty(max(16, 2 * len(source)), dtype=np.int32)
        self.size = 0


class PinnedStager:
    """Host->device copies of small int64 arrays through a ring of pinned buffers (one copy per batch).

    A buffer is reused only after the copy that last read it has completed (an event per slot).
    """

    def __init__(self, device: torch.device, slots: int = 4) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        sizes = [len(a) for a in arrays]
        packed = np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, np.int64)
        if not self.pinned:
            return list(torch.from_numpy(packed.copy()).split(sizes))
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        buf = self._bufs[slot]
        if buf is None or buf.numel() < len(packed):
            buf = torch.empty(max(len(packed), 4096) * 2, dtype=torch.int64, pin_memory=True)
            self._bufs[slot] = buf
        host = buf[:len(packed)]
        host.numpy()[:] = packed
        dev = host.to(self.device, non_blocking=True)
        event = self._events[slot] or torch.cuda.Event()
        event.record()
        self._events[slot] = event
        return list(dev.split(sizes))


class BatchBuilder:
    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size, self.device = page_size, device
        self._mirrors: dict[str, _PageMirror] = {}
        self.stager = PinnedStager(device)

    def release(self, request_id: str) -> None:
        self._mirrors.pop(request_id, None)

    def pages(self, r: Request) -> np.ndarray:
        """The request's page list as an int32 array (kept in step with the pool's list incrementally)."""
        source = r.page_table.pages
        m = self._mirrors.get(r.request_id)
        if m is None or m.source is not source or m.size > len(source):
            m = self._mirrors[r.request_id] = _PageMirror(source)
        n = len(source)
        if n > m.size:
            if n > len(m.array):
                grown = np.empty(2 * n, dtype=np.int32)
                grown[:m.size] = m.array[:m.size]
                m.array = grown
            m.array[m.size:n] = source[m.size:n]
            m.size = n
        return m.array[:n]

    def build(self, reqs: list[Request], spans: list[tuple[int, int]], with_ids: bool = True, pad_rows: int = 0,
              pad_page: int = 0) -> TokenBatch:
        """The batch computing tokens [a, b) of each request; with_ids=False leaves input_ids empty (the hidden
        state is carried over from an earlier layer range). pad_rows extra one-token sequences (token 0 at position
        0 of page pad_page) fill a batch up to a captured CUDA-graph size."""
        starts = np.array([a for a, _ in spans] + [0] * pad_rows, dtype=np.int64)
        ends = np.array([b for _, b in spans] + [1] * pad_rows, dtype=np.int64)
        pages = [self.pages(r) for r in reqs] + [np.array([pad_page], np.int32)] * pad_rows
        ids = None
        if with_ids:
            ids = [t for r, (a, b) in zip(reqs, spans) for t in span_tokens(r, a, b)] + [0] * pad_rows
        return self.build_raw(starts, ends, pages, ids)

    def build_raw(self, starts: np.ndarray, ends: np.ndarray, pages: list[np.ndarray],
                  ids: list[int] | None) -> TokenBatch:
        """The batch of sequences computing tokens [starts[i], ends[i]) with page arrays pages[i]."""
        qo, kv_indptr, kv_indices, last_len, positions, slots = page_layout(starts, ends, pages, self.page_size)
        arrays = [positions, slots]
        if ids is not None:
            arrays.append(np.asarray(ids, dtype=np.int64))
        dev = self.stager.to_device(arrays)
        meta = AttentionMetadata(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices, last_page_len=last_len,
                                 seq_lens=ends.astype(np.int32), page_size=self.page_size, slot_mapping=dev[1])
        input_ids = dev[2] if ids is not None else dev[0][:0]
        return TokenBatch(input_ids=input_ids, positions=dev[0], metadata=meta, last_rows=qo[1:] - 1)
