"""A candidate GEMM for decode steps of a few rows (2-16), for `decode_gemm_bench.py --skinny` to time against
cuBLAS: out [M, N] = x [M, K] @ w [N, K]^T, each program one block of outputs over all M rows (padded to 16 for the
tensor cores), the weight streamed once in tiles of BLOCK_N x BLOCK_K, tiles autotuned per shape on first use;
optionally launched with programmatic dependent launch, its first weight tile read before it waits."""
from __future__ import annotations

import torch
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


def skinny_linear(x: torch.Tensor, w: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """F.linear(x, w) without bias for x of at most 16 rows (contiguous rows, w [N, K] row-major); pdl: launched
    with programmatic dependent launch (Hopper and later)."""
    m, k = x.shape
    n = w.shape[0]
    if m > 16 or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"skinny_linear takes up to 16 contiguous rows, got {tuple(x.shape)}")
    out = x.new_empty(m, n)
    skinny_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), M_PAD=16, PDL=pdl,
        **({"launch_pdl": True} if pdl else {}))
    return out
