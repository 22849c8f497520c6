"""The Triton kernel behind `skinny.skinny_linear`: out [M, N] = x [M, K] @ w [N, K]^T for a few rows, each program
one block of outputs over all M rows (padded to 16 for the tensor cores), the weight streamed once in tiles of
BLOCK_N x BLOCK_K (autotuned per shape on first use); optionally launched with programmatic dependent launch, its
first weight tile read before it waits. Imported only where it runs, so Triton stays optional elsewhere."""
from __future__ import annotations

import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
           for bn, bk, w, s in ((16, 256, 2, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 6),
                                (64, 128, 4, 4), (16, 128, 2, 8), (32, 512, 4, 3), (64, 256, 8, 3))]


@triton.autotune(configs=CONFIGS, key=["M", "N", "K", "PDL"])
@triton.jit
def skinny_kernel(x_ptr, w_ptr, o_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                  M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    kb = tl.arange(0, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    # each weight tile is read one step ahead; the first before waiting on the kernel before (weights are not what
    # it writes), so that with programmatic dependent launch the first reads overlap that kernel's end
    w = tl.load(w_ptr + n[:, None] * stride_wn + kb[None, :], mask=(n[:, None] < N) & (kb[None, :] < K), other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kb
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        ahead = k + BLOCK_K
        w_next = tl.load(w_ptr + n[:, None] * stride_wn + ahead[None, :],
                         mask=(n[:, None] < N) & (ahead[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
        w = w_next
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(o_ptr + m[:, None] * stride_om + n[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))
