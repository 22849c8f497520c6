"""Weight-streaming GEMM for few rows: y[M, N] = x[M, K] @ w[N, K]^T, split-K with an in-kernel reduction.

Grid (N tiles, SPLIT_K). Each program reads its K range of one weight tile; with SPLIT_K > 1 it stores an fp32
partial, bumps the tile's counter, and the last program of the tile sums the partials in split order and writes y.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def skinny_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_tiles = tl.cdiv(K, BK)
    per = tl.cdiv(k_tiles, SPLIT_K)
    k0 = pid_k * per
    k1 = tl.minimum(k0 + per, k_tiles)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for kt in range(k0, k1):
        kk = kt * BK + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = ws_ptr + (pid_n * SPLIT_K * BM * BN) + rm[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(tile + pid_k * BM * BN, acc)
        tl.debug_barrier()
        seen = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
        if seen == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BM, BN], tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(tile + s * BM * BN, cache_modifier=".cg")
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty),
                     mask=out_mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


class Skinny:
    """One projection's launch at a fixed tiling; workspace and counters of its own."""

    def __init__(self, n, k, bm, bn, bk, split_k, stages, warps, device):
        self.n, self.k, self.bm, self.bn, self.bk, self.split = n, k, bm, bn, bk, split_k
        self.stages, self.warps = stages, warps
        tiles = triton.cdiv(n, bn)
        self.ws = torch.empty(tiles * split_k * bm * bn if split_k > 1 else 1, dtype=torch.float32, device=device)
        self.lock = torch.zeros(tiles, dtype=torch.int32, device=device)

    def __call__(self, x, w, y=None):
        m = x.shape[0]
        assert m <= self.bm
        if y is None:
            y = x.new_empty(m, self.n)
        grid = (triton.cdiv(self.n, self.bn), self.split)
        skinny_kernel[grid](x, w, y, self.ws, self.lock, m, self.n, self.k, x.stride(0), w.stride(0), y.stride(0),
                            BM=self.bm, BN=self.bn, BK=self.bk, SPLIT_K=self.split, num_stages=self.stages,
                            num_warps=self.warps)
        return y
