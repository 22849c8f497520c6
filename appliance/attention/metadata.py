"""The layout of one flat token batch as attention sees it: which rows belong to which sequence, where each
sequence's KV pages are, and where each new token's K/V is written.

Host arrays (numpy int32) feed the backends' planning; device tensors (slot mapping) feed the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Rows of q/k/v are grouped by sequence: sequence i owns rows qo_indptr[i]:qo_indptr[i+1], which are its tokens
    at positions seq_lens[i] - q_len .. seq_lens[i] - 1 (everything before is already in the cache). Its KV pages are
    kv_indices[kv_indptr[i]:kv_indptr[i+1]], the last one holding last_page_len[i] tokens."""

    qo_indptr: np.ndarray       # [n + 1] int32
    kv_indptr: np.ndarray       # [n + 1] int32
    kv_indices: np.ndarray      # [kv_indptr[-1]] int32
    last_page_len: np.ndarray   # [n] int32
    seq_lens: np.ndarray        # [n] int32
    page_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device: page * page_size + offset of each row

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def decode_only(self) -> bool:
        """Every sequence contributes exactly one query row."""
        return self.num_tokens == self.num_seqs

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr)


def page_layout(starts: np.ndarray, ends: np.ndarray, pages: list[np.ndarray],
                page_size: int) -> tuple[np.ndarray, ...]:
    """Vectorised layout of sequences that compute tokens [starts[i], ends[i]) with page arrays pages[i].

    Returns (qo_indptr, kv_indptr, kv_indices, last_page_len, positions, slots) as numpy arrays; positions and slots
    have one entry per row of the flat batch.
    """
    q_lens = ends - starts
    qo_indptr = np.zeros(len(ends) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qo_indptr[1:])
    n_pages = (ends + page_size - 1) // page_size
    kv_indptr = np.zeros(len(ends) + 1, dtype=np.int32)
    np.cumsum(n_pages, out=kv_indptr[1:])
    kv_indices = (np.concatenate([p[:n] for p, n in zip(pages, n_pages.tolist())]).astype(np.int32, copy=False)
                  if len(pages) else np.zeros(0, dtype=np.int32))
    last_page_len = (ends - (n_pages - 1) * page_size).astype(np.int32)
    total = int(qo_indptr[-1])
    seq_of_row = np.repeat(np.arange(len(ends)), q_lens)
    positions = np.arange(total, dtype=np.int64) - qo_indptr[seq_of_row] + starts[seq_of_row]
    page_of_row = kv_indices[kv_indptr[seq_of_row] + positions // page_size].astype(np.int64)
    slots = page_of_row * page_size + positions % page_size
    return qo_indptr, kv_indptr, kv_indices, last_page_len, positions, slots
