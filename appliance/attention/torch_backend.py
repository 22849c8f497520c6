"""Reference attention backend in plain torch: scatter K/V by slot, gather the batch's pages, SDPA per sequence
(per group of decode rows on the CPU).

Runs anywhere torch runs (the CPU path) and is the reference the fast backends are checked against. On the CPU, decode
rows (one query each) attend in groups, one SDPA a group over their pages padded to the next power of two and masked,
where one SDPA a row would spend most of a large batch's step in Python.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from appliance.attention.kv_write import write_kv
from appliance.attention.metadata import AttentionMetadata


class TorchAttention:
    name = "torch"
    supports_cuda_graph = False

    def prepare(self, metadata: AttentionMetadata) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, kv, metadata.slot_mapping)
        m = metadata
        out = torch.empty_like(q)
        single = np.diff(m.qo_indptr[:m.num_seqs + 1]) == 1
        batched = kv.device.type == "cpu" and single.sum() > 1
        rows = np.flatnonzero(~single) if batched else np.arange(m.num_seqs)
        if batched:
            for group, width in _groups(np.flatnonzero(single), m.kv_indptr):
                _decode_group(q, kv, m, group, width, out)
        if not len(rows):
            return out
        # every other sequence's pages in one gather: [2, pages of the batch, page_size, Hkv, D]
        idx = torch.from_numpy(np.asarray(m.kv_indices[:m.kv_indptr[m.num_seqs]])).to(kv.device, torch.long)
        pages = kv[:, idx]
        for i in rows.tolist():
            q0, q1 = int(m.qo_indptr[i]), int(m.qo_indptr[i + 1])
            seq_len, q_len = int(m.seq_lens[i]), q1 - q0
            p0, p1 = int(m.kv_indptr[i]), int(m.kv_indptr[i + 1])
            keys = pages[0, p0:p1].flatten(0, 1)[:seq_len]
            values = pages[1, p0:p1].flatten(0, 1)[:seq_len]
            # query row j sits at absolute position seq_len - q_len + j and sees keys 0..that position
            mask = None
            if q_len > 1:
                rows_at = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
                mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows_at
            attn = F.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
            out[q0:q1] = attn.squeeze(0).transpose(0, 1)
        return out


def _groups(seqs: np.ndarray, kv_indptr: np.ndarray) -> list[tuple[np.ndarray, int]]:
    """Sequences (indices) in groups of the same padded page count, the next power of two of theirs: a row's result
    depends on its own pages only, whatever else the batch holds (as one SDPA a sequence's did)."""
    counts = (kv_indptr[seqs + 1] - kv_indptr[seqs]).astype(np.int64)
    width = np.left_shift(1, np.ceil(np.log2(np.maximum(counts, 1))).astype(np.int64))
    return [(seqs[width == w], int(w)) for w in np.unique(width).tolist()]


def _decode_group(q: torch.Tensor, kv: torch.Tensor, m: AttentionMetadata, group: np.ndarray, width: int,
                  out: torch.Tensor) -> None:
    """One SDPA for decode rows `group`: each row's pages padded (with its first page) to `width` pages and the
    keys past its length masked."""
    lens = m.seq_lens[group].astype(np.int64)
    starts = m.kv_indptr[group].astype(np.int64)
    counts = m.kv_indptr[group + 1].astype(np.int64) - starts
    at = np.arange(width)
    slots = np.where(at < counts[:, None], starts[:, None] + at, starts[:, None])
    idx = torch.from_numpy(np.asarray(m.kv_indices)[slots].astype(np.int64)).to(kv.device)
    pages = kv[:, idx].flatten(2, 3)  # [2, rows, width * page_size, Hkv, D] (a copy)
    valid = torch.arange(pages.shape[2], device=kv.device) < torch.from_numpy(lens).to(kv.device).unsqueeze(1)
    pages.masked_fill_(~valid[None, :, :, None, None], 0.0)  # slots never written may hold NaN
    keys, values = pages[0].transpose(1, 2), pages[1].transpose(1, 2)  # [rows, Hkv, L, D]
    mask = valid[:, None, None, :]
    q_rows = torch.from_numpy(m.qo_indptr[group].astype(np.int64)).to(q.device)
    attn = F.scaled_dot_product_attention(q[q_rows].unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
    out[q_rows] = attn.squeeze(2)
