"""Paged attention for the model zoo and the engine: the backend interface, the forward context that carries a
batch's layout into the model, the torch reference backend (CPU) and the flashinfer backend (CUDA).
"""
from __future__ import annotations

from typing import Protocol

import torch

from appliance.attention import triton_decode
from appliance.attention.context import (
    AttentionBackend,
    ForwardContext,
    current_context,
    forward_context,
    paged_attention,
    rope_paged_attention,
    set_layer,
)
from appliance.attention.flashinfer_backend import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    FlashInferAttention,
    flashinfer_available,
    make_workspaces,
)
from appliance.attention.kv_write import rms_norm, rotate, write_kv
from appliance.attention.metadata import AttentionMetadata, page_layout
from appliance.attention.torch_backend import TorchAttention
from appliance.errors import ConfigError


class AttentionShape(Protocol):
    """What a backend needs to know of the model (a model_zoo ModelConfig has it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


BACKEND_NAMES = ("auto", "flashinfer", "torch")
DECODE_KERNELS = ("auto", "flashinfer", "triton")

__all__ = ["AttentionBackend", "AttentionShape", "AttentionMetadata", "DECODE_KERNELS", "ForwardContext",
           "TorchAttention", "current_context", "forward_context", "flashinfer_unsupported", "make_backend",
           "new_workspace", "page_layout", "paged_attention", "resolve_backend_name", "rms_norm",
           "rope_paged_attention", "rotate", "set_layer", "uses_triton_decode", "write_kv"]


def flashinfer_unsupported(cfg: AttentionShape, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why flashinfer cannot serve this model here (None when it can)."""

    if device.type != "cuda":
        return f"it needs a CUDA device; the model is on {device}"
    if dtype not in SUPPORTED_DTYPES:
        return f"it runs bfloat16 or float16, not {str(dtype).replace('torch.', '')}"
    if cfg.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {cfg.head_dim} is not one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
    if not flashinfer_available():
        return "flashinfer is not installed (pip install 'muxd[gpu]')"
    return None


def resolve_backend_name(name: str, cfg: AttentionShape, dtype: torch.dtype, device: torch.device) -> str:
    """'auto' -> flashinfer where it can serve the model, else torch; an explicit impossible choice is an error."""
    if name not in BACKEND_NAMES:
        raise ConfigError(f"attention backend {name!r} is unknown; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "torch":
        return name
    reason = flashinfer_unsupported(cfg, dtype, device)
    if name == "auto":
        return "torch" if reason else "flashinfer"
    if reason:
        raise ConfigError(f"--attention-backend flashinfer cannot serve this model: {reason}; "
                          "use --attention-backend torch or auto")
    return name


def uses_triton_decode(decode_kernel: str, cfg: AttentionShape, graph_batch_size: int | None,
                       page_size: int) -> bool:
    """Whether a CUDA-graph decode batch of `graph_batch_size` rows runs muxd's Triton decode kernels (the split-KV
    one up to `triton_decode.MAX_BATCH` rows, the balanced one beyond): with decode_kernel 'auto', where they take
    the model's shape; with 'triton', always (a shape they cannot take is an error); with 'flashinfer', never."""
    if decode_kernel not in DECODE_KERNELS:
        raise ConfigError(f"decode kernel {decode_kernel!r} is unknown; choose one of {', '.join(DECODE_KERNELS)}")
    if graph_batch_size is None or decode_kernel == "flashinfer":
        return False
    reason = triton_decode.unsupported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size)
    if reason and decode_kernel == "triton":
        raise ConfigError(f"--decode-kernel triton cannot serve this model: {reason}; use --decode-kernel auto")
    return reason is None


def make_backend(name: str, cfg: AttentionShape, dtype: torch.dtype, device: torch.device, *,
                 graph_batch_size: int | None = None, max_pages: int = 0, shared_workspace=None,
                 decode_kernel: str = "auto", page_size: int = 16) -> AttentionBackend:
    """A backend instance; `graph_batch_size` makes one whose decode path can be captured in a CUDA graph (with
    decode_kernel 'auto', muxd's Triton decode kernels where they take the model's shape). Backends given the same
    `shared_workspace` (from `new_workspace`) must never run concurrently."""
    name = resolve_backend_name(name, cfg, dtype, device)
    if name == "torch":
        return TorchAttention()

    return FlashInferAttention(cfg, dtype, device, graph_batch_size=graph_batch_size, max_pages=max_pages,
                               workspaces=shared_workspace,
                               triton_decode=uses_triton_decode(decode_kernel, cfg, graph_batch_size, page_size))


def new_workspace(name: str, device: torch.device):
    """A workspace that several backends of `name` may share (None for backends that need none)."""
    if name != "flashinfer":
        return None

    return make_workspaces(device)
