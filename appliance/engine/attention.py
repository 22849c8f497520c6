"""Paged attention: the backend interface, the forward context that carries batch metadata into the model, and the
torch-native reference backend.

Model code calls `paged_attention(q, k, v, layer)`; which sequences the rows belong to, where their KV pages are and
which backend runs comes from the forward context the runner sets around each forward. This keeps attention opaque to
the model (and, later, to the compiler) as in vLLM's forward context.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F

from appliance.errors import ConfigError


@dataclass
class AttentionMetadata:
    """Where each sequence of a flat token batch reads and writes KV.

    Rows of q/k/v are grouped by sequence: sequence i owns rows query_start[i]:query_start[i+1]; those rows are its
    tokens at positions seq_lens[i]-query_lens[i] .. seq_lens[i]-1 (everything before is a cached prefix).
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] int64: page * page_size + offset for each row
    page_size: int

    @property
    def query_start(self) -> list[int]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class AttentionBackend(Protocol):
    """Computes attention for one layer of a flat token batch and writes the batch's K/V into the paged cache."""

    name: str

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Called once per forward before any layer runs (planning work that all layers share)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], caches [pages, page_size, Hkv, D] -> output [T, H, D]."""


class TorchAttention:
    """Reference backend: scatter K/V by slot, gather each sequence's pages, scaled_dot_product_attention.

    Runs anywhere torch runs; one SDPA call per sequence, so it is for CPU and for checking faster backends.
    """

    name = "torch"

    def prepare(self, metadata: AttentionMetadata) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        page_size = metadata.page_size
        out = torch.empty_like(q)
        start = 0
        for q_len, seq_len, pages in zip(metadata.query_lens, metadata.seq_lens, metadata.block_tables):
            n_pages = -(-seq_len // page_size)
            idx = torch.tensor(pages[:n_pages], device=k_cache.device, dtype=torch.long)
            keys = k_cache[idx].flatten(0, 1)[:seq_len]
            values = v_cache[idx].flatten(0, 1)[:seq_len]
            query = q[start:start + q_len]
            # query row i sits at absolute position seq_len - q_len + i and sees keys 0..that position
            mask = None
            if q_len > 1:
                rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
                mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows
            attn = F.scaled_dot_product_attention(
                query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
            out[start:start + q_len] = attn.squeeze(0).transpose(0, 1)
            start += q_len
        return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the batch's K/V rows at their slots (page * page_size + offset) of one layer's cache."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_cache: torch.Tensor  # [layers, 2, pages, page_size, Hkv, D]


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make `ctx` the batch that `paged_attention` calls inside this block refer to."""
    global _context
    previous, _context = _context, ctx
    ctx.backend.prepare(ctx.metadata)
    try:
        yield
    finally:
        _context = previous


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Attention of one layer for the current forward context's batch (q [T,H,D], k/v [T,Hkv,D] -> [T,H,D])."""
    ctx = _context
    if ctx is None:
        raise RuntimeError("paged_attention called outside forward_context(); the runner sets it around forwards")
    cache = ctx.kv_cache[layer]
    return ctx.backend.forward(q, k, v, cache[0], cache[1], ctx.metadata)


BACKENDS = {"torch": TorchAttention}


def make_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]()
