"""The forward context and the attention entry point of model code.

Model code calls `paged_attention(q, k, v)`. Which batch the rows belong to, which layer's KV pages to use and which
backend runs comes from the forward context the runner sets around a forward (and advances layer by layer), as in
vLLM. Under torch.compile the call is an opaque custom op (`muxd::paged_attention`), so the compiled code between
attentions carries no layer index and one compiled graph serves every layer.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch

from appliance.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Computes attention for one layer of a flat token batch and writes the batch's K/V into the paged cache."""

    name: str
    supports_cuda_graph: bool

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Called once per forward, before any layer runs: planning work that all layers share (host only)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv [2, pages, page_size, Hkv, D] (this layer) -> output [T, H, D]."""


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_cache: torch.Tensor  # [layers, 2, pages, page_size, Hkv, D]
    layer: int = 0          # the layer whose attention runs next; the model advances it
    cut: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # replaces attention
    # while a piecewise CUDA-graph capture runs (engine/prefill_graphs.py)


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` the batch that `paged_attention` calls inside this block refer to (and plan it once)."""
    global _context
    previous, _context = _context, ctx
    ctx.backend.prepare(ctx.metadata)
    try:
        yield ctx
    finally:
        _context = previous


def current_context() -> ForwardContext:
    """The forward context in effect (an error outside one)."""
    if _context is None:
        raise RuntimeError("paged_attention called outside forward_context(); the runner sets it around forwards")
    return _context


def set_layer(layer: int) -> None:
    """Point the current forward context at `layer`'s KV pages (called by the model before each layer)."""
    if _context is not None:
        _context.layer = layer


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    ctx = current_context()
    if ctx.cut is not None:
        return ctx.cut(q, k, v)
    rows, tokens = q.shape[0], ctx.metadata.num_tokens
    if rows == tokens:
        return ctx.backend.forward(q, k, v, ctx.kv_cache[ctx.layer], ctx.metadata)
    if rows < tokens:
        raise RuntimeError(f"attention got {rows} rows for a batch of {tokens} tokens")
    # rows past the batch's tokens pad the GEMMs to a cheaper size (runner): no KV, zero output
    out = ctx.backend.forward(q[:tokens], k[:tokens], v[:tokens], ctx.kv_cache[ctx.layer], ctx.metadata)
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, rows - tokens))


@torch.library.custom_op("muxd::paged_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # KV pages are written as a side effect the compiler never sees: no compiled code reads or writes them
    return _attention(q, k, v)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the current layer for the current forward context's batch (q [T,H,D], k/v [T,Hkv,D] -> [T,H,D])."""
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v)
    return _attention(q, k, v)  # eager: skip the dispatcher
