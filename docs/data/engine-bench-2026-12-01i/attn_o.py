"""Experiment: the one-row attention's merge folded into the output projection.

One kernel per layer replaces `decode_merge` and the output projection's GEMV: program (n block, KV head group)
merges its group's query heads from the split kernel's partials and multiplies them by the group's columns of W_o,
writing fp32 partial products [groups, 1, out] that the next norm sums (as SplitKLinear's partials).

`install()` patches SelfAttention.forward for one compiled row; everything else falls back to the usual path.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from appliance.attention import context as actx
from appliance.attention import triton_decode as td
from appliance.attention.kv_write import rope_kernel_takes
from appliance.attention.pdl import launch_options
from appliance.model_zoo import layers

ROWS = int(os.environ.get("ATTN_O_ROWS", "256"))        # output rows a program
BLOCK_N = int(os.environ.get("ATTN_O_BLOCK_N", "32"))    # output rows a loop step
CHUNK = int(os.environ.get("ATTN_O_CHUNK", "16"))        # splits a merge step
WARPS = int(os.environ.get("ATTN_O_WARPS", "8"))
STAGES = int(os.environ.get("ATTN_O_STAGES", "1"))
used_fused = [0]


@triton.jit
def merge_o(po_ptr, plse_ptr, seqlen_ptr, w_ptr, out_ptr, N, K, G: tl.constexpr, D: tl.constexpr,
            PAGE: tl.constexpr, PPB: tl.constexpr, SPLITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
            CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    c = tl.program_id(0)
    grp = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(seqlen_ptr)
    npages = (seq_len + PAGE - 1) // PAGE
    per = tl.maximum((npages + SPLITS - 1) // SPLITS, PPB)
    used = (npages + per - 1) // per
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    s = tl.arange(0, SPLITS)
    hq = grp * G + g  # the group's query heads [G]
    lse = tl.load(plse_ptr + hq[:, None] * SPLITS + s[None, :], mask=(s < used)[None, :], other=float("-inf"))
    mx = tl.where(used > 0, tl.max(lse, 1), 0.0)  # [G]
    total = tl.sum(tl.where((s < used)[None, :], tl.exp2(lse - mx[:, None]), 0.0), 1)
    x = tl.zeros([G, D], tl.float32)
    sc = tl.arange(0, CHUNK)
    for s0 in range(0, SPLITS, CHUNK):
        live = (s0 + sc) < used
        lc = tl.load(plse_ptr + hq[:, None] * SPLITS + (s0 + sc)[None, :], mask=live[None, :], other=float("-inf"))
        w = tl.where(live[None, :], tl.exp2(lc - mx[:, None]), 0.0)  # [G, CHUNK]
        o = tl.load(po_ptr + ((hq[:, None] * SPLITS + (s0 + sc)[None, :]) * D)[:, :, None] + d[None, None, :],
                    mask=live[None, :, None], other=0.0)  # [G, CHUNK, D]
        x += tl.sum(o * w[:, :, None], 1)
    x = x / tl.where(total == 0.0, 1.0, total)[:, None]
    x = x.to(w_ptr.dtype.element_ty).to(tl.float32)  # rounded as the merge's output is
    nl = tl.arange(0, BLOCK_N)
    cols = (hq[:, None] * D + d[None, :])  # [G, D]
    end = tl.minimum(c * ROWS + ROWS, N)
    n = c * ROWS + nl  # each step's weights are read a step ahead
    ahead = tl.load(w_ptr + n[:, None, None] * K + cols[None, :, :], mask=(n < end)[:, None, None], other=0.0)
    for n0 in range(c * ROWS, c * ROWS + ROWS, BLOCK_N):
        wt = ahead
        n = n0 + nl
        nn = n + BLOCK_N
        ahead = tl.load(w_ptr + nn[:, None, None] * K + cols[None, :, :], mask=(nn < end)[:, None, None], other=0.0)
        y = tl.sum(tl.sum(wt.to(tl.float32) * x[None, :, :], 2), 1)
        tl.store(out_ptr + grp * N + n, y, mask=n < end)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def _fused(qkv, positions, cos_sin, num_heads, weight, groups):
    """The fused path where the one-row Triton decode serves this call, else None."""
    ctx = actx.current_context()
    tri = getattr(ctx.backend, "triton", None)
    kv = ctx.kv_cache[ctx.layer]
    if (ctx.cut is not None or not isinstance(tri, td.TritonDecode) or tri.batch != 1 or qkv.shape[0] != 1
            or not tri.fuses_rope or tri.head_dim != cos_sin.shape[-1] or num_heads != tri.num_heads
            or not rope_kernel_takes(qkv, cos_sin, num_heads, kv) or groups != tri.num_kv_heads):
        return None
    _, _, partial_rope = td._build()
    b, page, d = 1, kv.shape[2], tri.head_dim
    launch = launch_options(qkv.device, b)
    partial_rope[(b, tri.num_kv_heads, tri.splits)](
        qkv, positions, cos_sin, ctx.metadata.slot_mapping, qkv, qkv, kv[0], kv[1],
        tri.indptr, tri.indices, tri.seq_lens, tri.partial_out, tri.partial_lse, tri.scale_log2, 0.0,
        qkv.stride(0), cos_sin.shape[0], kv.stride(1), kv.stride(2), kv.stride(3), HEADS=tri.num_heads,
        KV_HEADS=tri.num_kv_heads, G=tri.group, GP=max(16, 1 << (tri.group - 1).bit_length()), D=d, PAGE=page,
        PPB=tri.pages_per_block, SPLITS=tri.splits, NORM=False, num_warps=tri.num_warps,
        num_stages=tri.num_stages, **launch)
    n_out, k = weight.shape
    out = torch.empty(groups, 1, n_out, dtype=torch.float32, device=qkv.device)
    merge_o[(triton.cdiv(n_out, ROWS), groups)](
        tri.partial_out, tri.partial_lse, tri.seq_lens, weight, out, n_out, k, G=tri.group, D=d, PAGE=page,
        PPB=tri.pages_per_block, SPLITS=tri.splits, ROWS=ROWS, BLOCK_N=BLOCK_N, CHUNK=min(CHUNK, tri.splits),
        num_warps=WARPS, num_stages=STAGES, **launch)
    used_fused[0] += 1
    return out


@torch.library.custom_op("muxd_exp::rope_attention_o", mutates_args=())
def rope_attention_o(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                     weight: torch.Tensor, groups: int) -> torch.Tensor:
    out = _fused(qkv, positions, cos_sin, num_heads, weight, groups)
    if out is not None:
        return out
    att = actx._rope_attention(qkv, positions, cos_sin, num_heads, None, None, 0.0)
    return layers.partial_products(att.reshape(att.shape[0], -1), weight, groups)


@rope_attention_o.register_fake
def _(qkv, positions, cos_sin, num_heads, weight, groups):
    return qkv.new_empty(groups, qkv.shape[0], weight.shape[0], dtype=torch.float32)


def install():
    orig = layers.SelfAttention.forward

    def forward(self, positions, x):
        if (x.shape[0] == 1 and x.is_cuda and torch.compiler.is_compiling() and self.rotary.cos_sin is not None
                and not self.qk_norm and self.o_proj.bias is None and type(self.o_proj) is layers.SplitKLinear):
            qkv = self.qkv_proj(x)
            return rope_attention_o(qkv, positions, self.rotary.cos_sin, self.num_heads, self.o_proj.weight,
                                    self.num_kv_heads)
        return orig(self, positions, x)

    layers.SelfAttention.forward = forward
