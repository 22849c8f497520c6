"""Writing a batch's new K/V rows into the paged cache at their slots (page * page_size + offset), and the rotary
embedding fused with that write.

On CUDA one Triton kernel writes K and V of every row (one launch per layer instead of two); elsewhere, and for
layouts the kernel does not take, two index_copy_ calls do the same. `rope_write_kv` takes a row's fused QKV
projection and, in one launch per layer, rotates Q and K by the row's position (from a cos/sin table), writes the
rotated K and V to the cache and returns Q: it replaces the compiled rotary kernels and the write, four launches a
layer at decode. Where q and k are normalised per head before the rotation (Qwen3's q/k RMSNorm), the same launch
does that too. Its torch reference (`apply_rope`) runs elsewhere.
"""
from __future__ import annotations

import torch

from appliance.attention.pdl import launch_options


def _triton_kernel():
    from .kv_write_kernels import write_kv_kernel  # defers Triton
    return write_kv_kernel


def _triton_rope_kernel():
    from .kv_write_kernels import rope_write_kv_kernel  # defers Triton
    return rope_write_kv_kernel


def apply_rope(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
               eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused QKV projection [T, (H + 2 Hkv) D] into q [T, H, D], k and v [T, Hkv, D], q and k rotated
    (rotate-half) by the rows of cos_sin [positions, 2, D] (cos, sin) at `positions` [T]; with q_norm and k_norm
    (weights [D]), each head of q and k is RMS-normalised first (`rms_norm`)."""
    dim = cos_sin.shape[-1]
    kv_heads = (qkv.shape[-1] // dim - num_heads) // 2
    q, k, v = qkv.view(qkv.shape[0], -1, dim).split([num_heads, kv_heads, kv_heads], dim=1)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    rows = cos_sin[positions]
    cos, sin = rows[:, 0].unsqueeze(1), rows[:, 1].unsqueeze(1)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: normalised in fp32, rounded to x's dtype, then weighted."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (non-interleaved) rotary embedding of x [..., D] by cos and sin (broadcast to x)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                  kv: torch.Tensor, slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Rotate q and k of a fused QKV projection (as `apply_rope`, normalised first where q_norm and k_norm are
    given), store k and v at their slots of one layer's cache kv [2, pages, page_size, Hkv, D]; returns q [T, H, D]
    (contiguous). The halves of each cos_sin row are equal, as rotate-half rope makes them (the kernel reads the
    first)."""
    if qkv.is_cuda and rope_kernel_takes(qkv, cos_sin, num_heads, kv, q_norm, k_norm):
        return launch_rope_write_kv(qkv, positions, cos_sin, num_heads, kv, slot_mapping, q_norm, k_norm, eps)
    q, k, v = apply_rope(qkv, positions, cos_sin, num_heads, q_norm, k_norm, eps)
    write_kv(k, v, kv, slot_mapping)
    return q.contiguous()


def rope_kernel_takes(qkv: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, kv: torch.Tensor,
                      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> bool:
    """Whether the Triton rotary kernels (this one, and the decode attention that folds it in) take these tensors:
    one dtype, rows of unit stride, a contiguous cache, table and norm weights, a power-of-two half head."""
    half = cos_sin.shape[-1] // 2
    norms = (q_norm, k_norm) if q_norm is not None and k_norm is not None else ()
    return (qkv.dtype == kv.dtype == cos_sin.dtype and qkv.stride(-1) == 1 and kv.is_contiguous()
            and cos_sin.is_contiguous() and half & (half - 1) == 0 and num_heads % kv.shape[-2] == 0
            and qkv.shape[0] > 0 and all(w.is_contiguous() and w.dtype == qkv.dtype for w in norms))


def launch_rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                         kv: torch.Tensor, slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                         k_norm: torch.Tensor | None = None, eps: float = 0.0,
                         q_out: torch.Tensor | None = None) -> torch.Tensor:
    """`rope_write_kv` by the Triton kernel, whatever the device (Triton's interpreter runs it on a CPU); q into
    `q_out` ([T, H, D], contiguous) where given."""
    dim, kv_heads = cos_sin.shape[-1], kv.shape[-2]
    group = num_heads // kv_heads
    norm = q_norm is not None and k_norm is not None
    q = qkv.new_empty(qkv.shape[0], num_heads, dim) if q_out is None else q_out
    _triton_rope_kernel()[(qkv.shape[0], kv_heads)](
        qkv, positions, cos_sin, slot_mapping, q, kv[0], kv[1], q_norm if norm else qkv, k_norm if norm else qkv,
        qkv.stride(0), cos_sin.shape[0], float(eps), HEADS=num_heads, KV_HEADS=kv_heads, GROUP=group,
        GROUP_PAD=1 << (group - 1).bit_length(), HALF=dim // 2, NORM=norm, **launch_options(qkv.device, qkv.shape[0]))
    return q


def _rows_packed(t: torch.Tensor) -> bool:
    """[T, H, D] whose (H, D) part of each row is contiguous (rows may be strided, as slices of a fused QKV)."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store rows of k/v [T, Hkv, D] at their slots of one layer's cache kv [2, pages, page_size, Hkv, D]."""
    if (kv.is_cuda and k.dtype == kv.dtype and v.dtype == kv.dtype and _rows_packed(k) and _rows_packed(v)
            and kv.is_contiguous() and k.shape[0] > 0):
        row = k.shape[1] * k.shape[2]
        block = 1 << (row - 1).bit_length()
        _triton_kernel()[(k.shape[0],)](k, v, kv[0], kv[1], slot_mapping, k.stride(0), v.stride(0), ROW=row,
                                        BLOCK=block)
        return
    kv[0].view(-1, *kv.shape[3:]).index_copy_(0, slot_mapping, k.to(kv.dtype))
    kv[1].view(-1, *kv.shape[3:]).index_copy_(0, slot_mapping, v.to(kv.dtype))
