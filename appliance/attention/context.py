"""The forward context and the attention entry point of model code.

Model code calls `paged_attention(q, k, v)`, or `rope_paged_attention(qkv, positions, cos_sin, num_heads, ...)` where
the rotary embedding (and Qwen3's q/k norms before it) runs inside attention (fused with the K/V write where the
backend can: `forward_rope`). Which batch the rows belong to, which layer's KV pages to use and which backend runs
comes from the forward context the runner sets around a forward (and advances layer by layer), as in vLLM. Under
torch.compile each call is an opaque custom op (`muxd::paged_attention`, `muxd::rope_paged_attention`), so the
compiled code between attentions carries no layer index and one compiled graph serves every layer.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch

from appliance.attention.kv_write import apply_rope
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

    # optional: forward_rope(qkv, positions, cos_sin, num_heads, kv, metadata, q_norm, k_norm, eps) -> output
    # [T, H, D], the q/k norms (where given), rotary embedding and K/V write fused (kv_write.rope_write_kv); without
    # it, `apply_rope` and then `forward`


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_cache: torch.Tensor  # [layers, 2, pages, page_size, Hkv, D]
    layer: int = 0          # the layer whose attention runs next; the model advances it
    # while a piecewise CUDA-graph capture runs (engine/prefill_graphs.py), attention calls cut(attend, rows, *rest):
    # the capture ends its graph, runs attend(*rows, *rest) (this batch's attention; `rows`, the inputs of one row
    # per token, moved to the capture's own buffers) and begins the next graph
    cut: Callable[..., torch.Tensor] | None = None


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


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _padded(lambda n, ctx: ctx.backend.forward(q[:n], k[:n], v[:n], ctx.kv_cache[ctx.layer], ctx.metadata),
                   q.shape[0])


def _attend_rope(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    def attend(n: int, ctx: ForwardContext) -> torch.Tensor:
        backend, kv, metadata = ctx.backend, ctx.kv_cache[ctx.layer], ctx.metadata
        fused = getattr(backend, "forward_rope", None)
        if fused is not None:
            return fused(qkv[:n], positions[:n], cos_sin, num_heads, kv, metadata, q_norm, k_norm, eps)
        q, k, v = apply_rope(qkv[:n], positions[:n], cos_sin, num_heads, q_norm, k_norm, eps)
        return backend.forward(q, k, v, kv, metadata)

    return _padded(attend, qkv.shape[0])


def rotates_in_attention(attend: Callable[..., torch.Tensor]) -> bool:
    """Whether a call that a capture's `cut` receives is attention that rotates q and k itself (its rows: a fused
    QKV projection and the positions; the rest: cos_sin, num_heads, q_norm, k_norm, eps)."""
    return attend is _attend_rope


def _padded(attend: Callable[[int, ForwardContext], torch.Tensor], rows: int) -> torch.Tensor:
    """attend(tokens, context) for the batch's tokens; rows past them pad the GEMMs to a cheaper size (runner): they
    have no KV and a zero output."""
    ctx = current_context()
    tokens = ctx.metadata.num_tokens
    if rows < tokens:
        raise RuntimeError(f"attention got {rows} rows for a batch of {tokens} tokens")
    out = attend(tokens, ctx)
    return out if rows == tokens else torch.nn.functional.pad(out, (0, 0, 0, 0, 0, rows - tokens))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    cut = current_context().cut
    return _attend(q, k, v) if cut is None else cut(_attend, (q, k, v))


def _rope_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    cut = current_context().cut
    if cut is None:
        return _attend_rope(qkv, positions, cos_sin, num_heads, q_norm, k_norm, eps)
    return cut(_attend_rope, (qkv, positions), cos_sin, num_heads, q_norm, k_norm, eps)


@torch.library.custom_op("muxd::paged_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # KV pages are written as a side effect the compiler never sees: no compiled code reads or writes them
    return _attention(q, k, v)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("muxd::rope_paged_attention", mutates_args=())
def _rope_attention_op(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _rope_attention(qkv, positions, cos_sin, num_heads, q_norm, k_norm, eps)


@_rope_attention_op.register_fake
def _(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], num_heads, cos_sin.shape[-1])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the current layer for the current forward context's batch (q [T,H,D], k/v [T,Hkv,D] -> [T,H,D])."""
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v)
    return _attention(q, k, v)  # eager: skip the dispatcher


def rope_paged_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                         q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                         eps: float = 0.0) -> torch.Tensor:
    """`paged_attention` of a fused QKV projection [T, (H + 2 Hkv) D] whose q and k the rotary embedding has not
    rotated yet: rows of cos_sin [positions, 2, D] (cos, sin) at `positions` [T] rotate them, each head of q and k
    RMS-normalised first by q_norm and k_norm (weights [D]) where given (kv_write.apply_rope)."""
    if torch.compiler.is_compiling():
        return _rope_attention_op(qkv, positions, cos_sin, num_heads, q_norm, k_norm, eps)
    return _rope_attention(qkv, positions, cos_sin, num_heads, q_norm, k_norm, eps)
