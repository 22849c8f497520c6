"""Reference attention backend in plain torch: scatter K/V by slot, gather the batch's pages, SDPA per sequence.

Runs anywhere torch runs (the CPU path) and is the reference the fast backends are checked against.
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
        # every sequence's pages in one gather: [2, pages of the batch, page_size, Hkv, D]
        idx = torch.from_numpy(np.asarray(m.kv_indices[:m.kv_indptr[m.num_seqs]])).to(kv.device, torch.long)
        pages = kv[:, idx]
        for i in range(m.num_seqs):
            q0, q1 = int(m.qo_indptr[i]), int(m.qo_indptr[i + 1])
            seq_len, q_len = int(m.seq_lens[i]), q1 - q0
            p0, p1 = int(m.kv_indptr[i]), int(m.kv_indptr[i + 1])
            keys = pages[0, p0:p1].flatten(0, 1)[:seq_len]
            values = pages[1, p0:p1].flatten(0, 1)[:seq_len]
            # query row j sits at absolute position seq_len - q_len + j and sees keys 0..that position
            mask = None
            if q_len > 1:
                rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
                mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows
            attn = F.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
            out[q0:q1] = attn.squeeze(0).transpose(0, 1)
        return out
