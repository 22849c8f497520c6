"""Builds the flat token batch of one forward from requests and token spans: token ids, positions and attention
metadata, computed with vectorised numpy on the host and sent to the device in one copy from pinned memory.

Each request's page list is mirrored in a numpy array that grows as pages are appended, so a step costs O(new pages),
never a Python loop over every token or page. A token the host does not know yet (sampled by the step still running,
engine/launched.py) enters the batch as a placeholder naming its row of the device's token buffer, and the forward
reads it from there (`resolve`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from appliance.attention import AttentionMetadata, page_layout
from appliance.attention.pinned import PinnedRing
from appliance.engine.request import Request, joined_slice


@dataclass
class HostBatch:
    """A batch's layout on the host (numpy): what attention plans from and what is copied to the device."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    last_page_len: np.ndarray
    seq_lens: np.ndarray
    positions: np.ndarray      # int64, one per row
    slots: np.ndarray          # int64, one per row
    input_ids: np.ndarray | None

    def metadata(self, page_size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr, kv_indices=self.kv_indices,
                                 last_page_len=self.last_page_len, seq_lens=self.seq_lens, page_size=page_size,
                                 slot_mapping=slot_mapping)


@dataclass
class TokenBatch:
    input_ids: torch.Tensor   # [T] int64, device
    positions: torch.Tensor   # [T] int64, device
    metadata: AttentionMetadata
    last_rows: np.ndarray     # row of each sequence's last token
    placeholders: bool = False  # some input ids are placeholders (`resolve` them before the embedding)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def placeholder(row: int) -> int:
    """The input id standing for the token at `row` of the token buffer (negative: no token id is)."""
    return -1 - row


def resolve(ids: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`ids` with every placeholder replaced by its token from `buffer`, on the device (no host synchronisation;
    captured inside the decode CUDA graphs)."""
    return torch.where(ids < 0, buffer[(-1 - ids).clamp(min=0)], ids)


def span_tokens(r: Request, start: int, end: int) -> list[int]:
    """r.all_token_ids[start:end] without building the whole list (decode reads one token of a long context); a
    pending token (still on the device) as its placeholder."""
    n = len(r.prompt_token_ids)
    known = n + len(r.output_token_ids)
    if end > known:
        if end - known > 1 or r.pending_row < 0:
            raise RuntimeError(f"{r.request_id}: tokens [{known}, {end}) are not known on the host and only the "
                               f"latest step's token can be read on the device (pending row {r.pending_row})")
        head = span_tokens(r, start, known) if start < known else []  # (a decode step: its one pending token)
        return head + [placeholder(r.pending_row)]
    return joined_slice(r.prompt_token_ids, r.output_token_ids, start, end)


class _PageMirror:
    __slots__ = ("source", "array", "size")

    def __init__(self, source: list[int]) -> None:
        self.source = source  # the PagePool's list object: appended to in place, replaced when reallocated
        self.array = np.empty(max(16, 2 * len(source)), dtype=np.int32)
        self.size = 0


class BatchBuilder:
    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size, self.device = page_size, device
        self._mirrors: dict[str, _PageMirror] = {}
        self.staging = PinnedRing(torch.int64, pinned=device.type == "cuda")

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
        """The batch computing tokens [a, b) of each request, on the device; with_ids=False leaves input_ids empty
        (the hidden state is carried over from an earlier layer range)."""
        return self.to_device(self.layout(reqs, spans, pad_rows, pad_page, with_ids))

    def layout(self, reqs: list[Request], spans: list[tuple[int, int]], pad_rows: int = 0,
               pad_page: int = 0, with_ids: bool = True) -> HostBatch:
        """The host arrays of the batch computing tokens [a, b) of each request, plus pad_rows one-token padding
        sequences (token 0 at position 0 of page pad_page) that fill a batch up to a captured CUDA-graph size."""
        starts = np.array([a for a, _ in spans] + [0] * pad_rows, dtype=np.int64)
        ends = np.array([b for _, b in spans] + [1] * pad_rows, dtype=np.int64)
        pages = [self.pages(r) for r in reqs] + [np.array([pad_page], np.int32)] * pad_rows
        ids = None
        if with_ids:
            ids = [t for r, (a, b) in zip(reqs, spans) for t in span_tokens(r, a, b)] + [0] * pad_rows
        return self.layout_raw(starts, ends, pages, ids)

    def layout_raw(self, starts: np.ndarray, ends: np.ndarray, pages: list[np.ndarray],
                   ids: list[int] | None) -> HostBatch:
        qo, kv_indptr, kv_indices, last_len, positions, slots = page_layout(starts, ends, pages, self.page_size)
        return HostBatch(qo, kv_indptr, kv_indices, last_len, ends.astype(np.int32), positions, slots,
                         None if ids is None else np.asarray(ids, dtype=np.int64))

    def build_raw(self, starts: np.ndarray, ends: np.ndarray, pages: list[np.ndarray],
                  ids: list[int] | None) -> TokenBatch:
        """The batch of sequences computing tokens [starts[i], ends[i]) with page arrays pages[i]."""
        return self.to_device(self.layout_raw(starts, ends, pages, ids))

    def to_device(self, host: HostBatch) -> TokenBatch:
        """Positions, slots and token ids to the device in one copy; the layout stays on the host for planning."""
        arrays = [host.positions, host.slots] + ([host.input_ids] if host.input_ids is not None else [])
        packed, _ = self.staging.stage(arrays)
        dev = packed.to(self.device, non_blocking=True)
        self.staging.done()
        n = len(host.positions)
        meta = host.metadata(self.page_size, dev[n:2 * n])
        input_ids = dev[2 * n:] if host.input_ids is not None else dev[:0]
        placeholders = host.input_ids is not None and bool(len(host.input_ids)) and int(host.input_ids.min()) < 0
        return TokenBatch(input_ids=input_ids, positions=dev[:n], metadata=meta, last_rows=host.qo_indptr[1:] - 1,
                          placeholders=placeholders)
