"""The Triton kernels behind `kv_write`: the K/V write at slots and the rotary embedding fused with it (with the
per-head q/k RMSNorm where a model has one). Imported only where they run, so Triton stays optional elsewhere."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + row * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + row * stride_v + offs, mask=mask)
    tl.store(kc_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(vc_ptr + slot * ROW + offs, v, mask=mask)


@triton.jit
def head_rms_norm(x1, x2, w_ptr, d, eps, dtype: tl.constexpr, HALF: tl.constexpr):
    # RMSNorm of each head from its two halves, rounded as the layers' RMSNorm: normalised, weighted, each in dtype
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
    x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1, x2


@triton.jit
def rope_write_kv_kernel(qkv_ptr, pos_ptr, table_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr,
                         stride_qkv, positions, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
                         PDL: tl.constexpr = False):
    # one program per (row, KV head): the group's query heads, then its K and V head
    if PDL:  # launched early (attention/pdl.py): wait for the kernel before, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, kv_head = tl.program_id(0), tl.program_id(1)
    dim = 2 * HALF
    dtype = q_ptr.dtype.element_ty
    pos = tl.minimum(tl.load(pos_ptr + row).to(tl.int64), positions - 1)
    d = tl.arange(0, HALF)
    cos = tl.load(table_ptr + pos * 2 * dim + d).to(tl.float32)[None, :]  # table [positions, 2, dim]
    sin = tl.load(table_ptr + pos * 2 * dim + dim + d).to(tl.float32)[None, :]
    src = qkv_ptr + row * stride_qkv
    g = tl.arange(0, GROUP_PAD)[:, None]
    heads = kv_head * GROUP + g
    mask = (g < GROUP) & (d[None, :] < HALF)
    x1 = tl.load(src + heads * dim + d[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(src + heads * dim + HALF + d[None, :], mask=mask).to(tl.float32)
    if NORM:
        x1, x2 = head_rms_norm(x1, x2, qw_ptr, d, eps, dtype, HALF)
    dst = q_ptr + row * HEADS * dim + heads * dim + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    k_src = src + (HEADS + kv_head) * dim + d[None, :]
    k1 = tl.load(k_src).to(tl.float32)
    k2 = tl.load(k_src + HALF).to(tl.float32)
    if NORM:
        k1, k2 = head_rms_norm(k1, k2, kw_ptr, d, eps, dtype, HALF)
    k_dst = kc_ptr + (slot * KV_HEADS + kv_head) * dim + d[None, :]
    tl.store(k_dst, (k1 * cos - k2 * sin).to(kc_ptr.dtype.element_ty))
    tl.store(k_dst + HALF, (k2 * cos + k1 * sin).to(kc_ptr.dtype.element_ty))
    full = tl.arange(0, 2 * HALF)
    v = tl.load(src + (HEADS + KV_HEADS + kv_head) * dim + full)
    tl.store(vc_ptr + (slot * KV_HEADS + kv_head) * dim + full, v)
