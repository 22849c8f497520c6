"""muxd's GEMM for steps of a few rows (`--decode-blas triton`): the decoder's projections as one opaque op,
`muxd::linear`, that runs a Triton kernel reading each weight once for all rows (skinny_kernels.py) where a launch
has 2 to `rows()` rows, and F.linear otherwise.

`install(model)` routes the layers' QKV, output, gate/up and down projections of a single-rank model through the
op for more than one row (one row keeps F.linear, which the single-token compiled graph turns into its tuned
reductions); the decode graph capture turns the kernel on for its batches (`enabled`, with programmatic dependent
launch where the engine's `--pdl` is on); everywhere else the op is F.linear. Not yet measured in the engine: opt-in.
Autotuning runs on the first launch of each shape, which the capture's warm-up makes, outside capture.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16  # the kernel's row tile: launches of more rows take F.linear

_rows = 0  # launches of 2.._rows rows take the kernel (0: none)
_pdl = False  # ... launched with programmatic dependent launch


def rows() -> int:
    return _rows


@contextlib.contextmanager
def enabled(max_rows: int = MAX_ROWS, pdl: bool = False) -> Iterator[None]:
    """Inside: launches of 2..max_rows rows (at most MAX_ROWS) take the kernel; with pdl, launched with
    programmatic dependent launch (Hopper and later: its first weight reads overlap the end of the kernel before)."""
    global _rows, _pdl
    before, _rows, _pdl = (_rows, _pdl), min(max_rows, MAX_ROWS), pdl
    try:
        yield
    finally:
        _rows, _pdl = before


def skinny_linear(x: torch.Tensor, w: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """F.linear(x, w) without bias for x [M <= 16, K] with contiguous rows and w [N, K] row-major; autotuned on CUDA,
    its first tiling elsewhere (Triton's interpreter). pdl: launched with programmatic dependent launch."""
    import triton  # defers Triton

    from appliance.model_zoo.skinny_kernels import CONFIGS, skinny_kernel  # defers Triton

    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or x.stride(1) != 1 or w.stride(1) != 1 or w.shape[1] != k:
        raise ValueError(f"skinny_linear takes up to {MAX_ROWS} contiguous rows of a [N, {k}] weight, got "
                         f"x {tuple(x.shape)}, w {tuple(w.shape)}")
    out = x.new_empty(m, n)
    args = (x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0))
    if x.is_cuda:
        skinny_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            *args, M_PAD=MAX_ROWS, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    else:
        tiling = CONFIGS[0].kwargs
        skinny_kernel.fn[(triton.cdiv(n, tiling["BLOCK_N"]),)](*args, M_PAD=MAX_ROWS, PDL=False, **tiling)
    return out


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and 2 <= x.shape[0] <= _rows and x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16))


@torch.library.custom_op("muxd::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if _takes(x, weight):
        out = skinny_linear(x, weight, pdl=_pdl)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[0] == 1:  # one row: F.linear (the single-token graph's reductions)
        return F.linear(x, module.weight, module.bias)
    return _linear_op(x, module.weight, module.bias)


def install(model: nn.Module) -> int:
    """Route every decoder layer's projections (plain nn.Linear and its subclasses that keep its forward) through
    `muxd::linear`; returns how many."""
    count = 0
    for layer in model.model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if type(proj).forward is nn.Linear.forward:
                proj.forward = functools.partial(_forward, proj)
                count += 1
    return count
