"""Writing a batch's new K/V rows into the paged cache at their slots (page * page_size + offset).

On CUDA one Triton kernel writes K and V of every row (one launch per layer instead of two); elsewhere, and for
layouts the kernel does not take, two index_copy_ calls do the same.
"""
from __future__ import annotations

import torch

_kernel = None


def _triton_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, ROW: tl.constexpr,
                            BLOCK: tl.constexpr):
            row = tl.program_id(0)
            slot = tl.load(slot_ptr + row).to(tl.int64)
            offs = tl.arange(0, BLOCK)
            mask = offs < ROW
            k = tl.load(k_ptr + row * stride_k + offs, mask=mask)
            v = tl.load(v_ptr + row * stride_v + offs, mask=mask)
            tl.store(kc_ptr + slot * ROW + offs, k, mask=mask)
            tl.store(vc_ptr + slot * ROW + offs, v, mask=mask)

        _kernel = write_kv_kernel
    return _kernel


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
