"""The matrix-vector products of one-row decode steps, without attention: 32 layers of an 8B decoder (QKV, output,
gate/up, down; random weights, no layer finds its weights in L2), each way timed as one CUDA graph against the
weights' bytes over the copy bandwidth measured in the same run:
- Inductor's single-token reductions under muxd's compile options (max-autotune, PDL), the four products alone and
  with the layer's two RMSNorms and residual adds (as the decoder layer has them);
- a Triton GEMV of this script's own, launched with PDL: `BLOCK_N` rows a program, `BLOCK_K` columns a step, the
  first weight tile loaded before the PDL wait (`early`) and the next kernel let launch right after it; the plain
  chain, and the chain with each RMSNorm's statistic summed inside the projection after it (the norm's scale is one
  number a row: applied once after the sum; with `folded`, the norm's weights taken as already multiplied into the
  projection's) and the residual adds in the output and down projections' epilogues.
`--check` compares the Triton chains with float32 PyTorch (under TRITON_INTERPRET=1 on a CPU).

    PYTHONPATH=. python tests/gpu/gemv_chain_bench.py [--layers 32] [--iters 50] [--configs "4,512,4;2,1024,4"]
        [--norms-only] [--check]

`--configs`: BLOCK_N,BLOCK_K,warps of the Triton GEMV, separated by semicolons.
"""
from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from appliance.bench.ceilings import time_cuda

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _input(x_ptr, nw_ptr, k, cols, HALF: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr,
           FOLDED: tl.constexpr):
    """The product's input at columns k + cols, in fp32: silu(gate) * up (ACT), or x times the norm's weights
    (NORM, unless FOLDED), or x; and x * x for the norm's statistic (only NORM uses it)."""
    if ACT:
        g = tl.load(x_ptr + k + cols).to(tl.float32)
        x = g / (1 + tl.exp(-g)) * tl.load(x_ptr + HALF + k + cols).to(tl.float32)
        return x, x
    x = tl.load(x_ptr + k + cols).to(tl.float32)
    if not NORM:
        return x, x
    if FOLDED:
        return x, x * x
    return x * tl.load(nw_ptr + k + cols).to(tl.float32), x * x


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, K: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ACT: tl.constexpr, RES: tl.constexpr, PDL: tl.constexpr,
                EARLY: tl.constexpr, NORM: tl.constexpr = False, FOLDED: tl.constexpr = False):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    wp = w_ptr + rows[:, None] * K + cols[None, :]
    if EARLY:
        w = tl.load(wp)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not EARLY:
        w = tl.load(wp)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K - BLOCK_K, BLOCK_K):  # the next tile loads while this one is used
        w_next = tl.load(wp + k + BLOCK_K)
        x, sq = _input(x_ptr, nw_ptr, k, cols, HALF, ACT, NORM, FOLDED)
        if NORM:
            ss += sq
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    x, sq = _input(x_ptr, nw_ptr, K - BLOCK_K, cols, HALF, ACT, NORM, FOLDED)
    if NORM:
        ss += sq
    acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if NORM:  # RMSNorm's scale is one number for the row: applied once, after the sum
        y = y * tl.rsqrt(tl.sum(ss, axis=0) / K + 1e-5)
    if RES:
        y += tl.load(res_ptr + rows).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))


def gemv(x, w, out, res=None, act=False, cfg=(8, 512, 4), pdl=True, early=True, norm=None, folded=False):
    n, k = w.shape
    bn, bk, warps = cfg
    kw = {} if INTERPRET else {"num_warps": warps, "launch_pdl": pdl}
    gemv_kernel[(n // bn,)](x, w, out, res if res is not None else out, norm if norm is not None else out, K=k,
                            HALF=k, BLOCK_N=bn, BLOCK_K=bk, ACT=act, RES=res is not None,
                            PDL=pdl and not INTERPRET, EARLY=early, NORM=norm is not None, FOLDED=folded, **kw)
    return out


def layer_eager(h, W):
    qkv = torch.nn.functional.linear(h, W["qkv"])
    o = torch.nn.functional.linear(qkv[..., :h.shape[-1]], W["o"]) + h
    g = torch.nn.functional.linear(o, W["gu"])
    half = g.shape[-1] // 2
    m = torch.nn.functional.silu(g[..., :half]) * g[..., half:]
    return torch.nn.functional.linear(m, W["d"]) + o


def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def layer_norms(h, res, W):
    """As muxd's decoder layer less attention: residual add and RMSNorm before QKV and before gate/up."""
    res = h + res
    qkv = torch.nn.functional.linear(rms(res, W["n1"]), W["qkv"])
    res = torch.nn.functional.linear(qkv[..., :h.shape[-1]], W["o"]) + res
    g = torch.nn.functional.linear(rms(res, W["n2"]), W["gu"])
    half = g.shape[-1] // 2
    return torch.nn.functional.linear(torch.nn.functional.silu(g[..., :half]) * g[..., half:], W["d"]), res


def make_layers(n, hidden, inter, qkv_out, device, dtype=torch.bfloat16):
    def w(o, i):
        return (torch.randn(o, i, device=device, dtype=torch.float32) / i ** 0.5).to(dtype)
    return [{"qkv": w(qkv_out, hidden), "o": w(hidden, hidden), "gu": w(2 * inter, hidden), "d": w(hidden, inter)}
            for _ in range(n)]


class NormChain:
    """layer_norms as four GEMVs: each RMSNorm's statistic inside the projection after it, the residual adds in the
    output and down projections' epilogues (which write the residual stream)."""

    def __init__(self, layers, hidden, inter, qkv_out, device, cfg, pdl=True, early=True, folded=False):
        self.layers, self.cfg, self.pdl, self.early, self.folded = layers, cfg, pdl, early, folded
        dt = torch.bfloat16
        self.qkv = torch.empty(qkv_out, device=device, dtype=dt)
        self.g = torch.empty(2 * inter, device=device, dtype=dt)
        self.r = [torch.empty(hidden, device=device, dtype=dt) for _ in range(2)]

    def __call__(self, r):
        kw = dict(cfg=self.cfg, pdl=self.pdl, early=self.early)
        for W in self.layers:
            gemv(r, W["qkv"], self.qkv, norm=W["n1"], folded=self.folded, **kw)
            r2 = self.r[0] if r is not self.r[0] else self.r[1]
            gemv(self.qkv, W["o"], r2, res=r, **kw)
            gemv(r2, W["gu"], self.g, norm=W["n2"], folded=self.folded, **kw)
            r = self.r[1] if r2 is self.r[0] else self.r[0]
            gemv(self.g, W["d"], r, res=r2, act=True, **kw)
        return r


class TritonChain:
    def __init__(self, layers, hidden, inter, qkv_out, device, cfg, pdl, early):
        self.layers, self.cfg, self.pdl, self.early = layers, cfg, pdl, early
        dt = torch.bfloat16
        self.qkv = torch.empty(qkv_out, device=device, dtype=dt)
        self.o = torch.empty(hidden, device=device, dtype=dt)
        self.g = torch.empty(2 * inter, device=device, dtype=dt)
        self.out = [torch.empty(hidden, device=device, dtype=dt) for _ in range(2)]

    def __call__(self, h):
        kw = dict(cfg=self.cfg, pdl=self.pdl, early=self.early)
        for i, W in enumerate(self.layers):
            gemv(h, W["qkv"], self.qkv, **kw)
            gemv(self.qkv, W["o"], self.o, res=h, **kw)  # the first `hidden` of qkv (K = hidden)
            gemv(self.o, W["gu"], self.g, **kw)
            d_out = self.out[i % 2]
            gemv(self.g, W["d"], d_out, res=self.o, act=True, **kw)
            h = d_out
        return h


def check(device):
    torch.manual_seed(0)
    hidden, inter, qkv_out = 256, 512, 384
    layers = make_layers(2, hidden, inter, qkv_out, device)
    h = torch.randn(hidden, device=device).to(torch.bfloat16)
    ref = h.float()
    for W in layers:
        ref = layer_eager(ref, {k: v.float() for k, v in W.items()})
    for W in layers:
        W["n1"] = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
        W["n2"] = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    x, r = h.float(), torch.zeros(hidden, device=device)
    for W in layers:
        x, r = layer_norms(x, r, {k: v.float() for k, v in W.items()})
    want = x + r
    got = NormChain(layers, hidden, inter, qkv_out, device, (4, 128, 4))(h.clone())
    err = ((got.float() - want).norm() / want.norm()).item()
    print("check norm chain", f"relative error {err:.2e}")
    assert err < 5e-2, err
    for cfg in [(8, 128, 4), (4, 256, 4), (2, 64, 2)]:
        got = TritonChain(layers, hidden, inter, qkv_out, device, cfg, pdl=True, early=True)(h)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        print("check", cfg, f"relative error {err:.2e}")
        assert err < 5e-2, err  # bf16 rounding compounds over the chain (each kernel alone: 0.3 %)


def timed(fn, iters):
    """Median ms of one replay of fn() captured as a CUDA graph."""
    fn()  # warm (cuBLAS handles, Triton compiles) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_cuda(g.replay, iters=iters, warmup=5) * 1e3


def copy_rate():
    """Read + write bytes a second of a 1 GiB copy."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / time_cuda(lambda: b.copy_(a))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--norms-only", action="store_true")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--configs", default="4,512,4;8,1024,8")
    a = p.parse_args()
    if a.check:
        return check("cpu" if INTERPRET else "cuda")
    from torch._inductor import list_mode_options

    hidden, inter, qkv_out = 4096, 14336, 6144
    layers = make_layers(a.layers, hidden, inter, qkv_out, "cuda")
    nbytes = sum(t.numel() * t.element_size() for W in layers for t in W.values())  # before the norms' weights
    rate = copy_rate()
    floor = nbytes / rate * 1e3
    print(f"copy {rate / 1e12:.2f} TB/s; {a.layers} layers, {nbytes / 1e9:.2f} GB of weights, floor {floor:.3f} ms")
    h = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    rows = []
    opts = {**list_mode_options("max-autotune-no-cudagraphs"), "triton.enable_pdl": True}
    one = torch.compile(layer_eager, dynamic=False, options=opts)
    with torch.no_grad():
        rows.append(("inductor (muxd's options, PDL)", timed(lambda: [one(h, W) for W in layers], a.iters)))
        for W in layers:
            W["n1"] = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
            W["n2"] = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        normed = torch.compile(layer_norms, dynamic=False, options=opts)

        def norm_chain():
            x, r = h, h
            for W in layers:
                x, r = normed(x, r, W)
            return x

        rows.append(("inductor with the two RMSNorms (+ residual adds)", timed(norm_chain, a.iters)))
        for text in a.configs.split(";"):
            cfg = tuple(int(v) for v in text.split(","))
            hh = h[0].clone()
            for folded in (False, True):
                nc = NormChain(layers, hidden, inter, qkv_out, "cuda", cfg, folded=folded)
                rows.append((f"triton {cfg} norms' statistics inside{' (weights folded)' if folded else ''}",
                             timed(lambda: nc(hh), a.iters)))
        rows.append(("cuBLAS eager", timed(lambda: [layer_eager(h, W) for W in layers], a.iters)))
        hv = h[0]
        for text in a.configs.split(";") if not a.norms_only else []:
            cfg = tuple(int(v) for v in text.split(","))
            for pdl, early in ((True, True), (True, False), (False, False)):
                chain = TritonChain(layers, hidden, inter, qkv_out, "cuda", cfg, pdl, early)
                rows.append((f"triton {cfg} pdl={pdl} early={early}", timed(lambda: chain(hv), a.iters)))
    for name, ms in rows:
        print(f"{name:60s} {ms:7.3f} ms  {ms / floor:5.3f}x  {(ms - floor) / (4 * a.layers) * 1e3:6.2f} us/kernel over")


if __name__ == "__main__":
    main()
