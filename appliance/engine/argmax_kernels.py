"""Triton kernels of the sampler's row-wise argmax (`sampler.argmax_rows`): each program takes one slice of a row and
writes the slice's largest value and that value's first index; one program a row then picks the first slice holding
the row's largest value."""
import triton
import triton.language as tl


@triton.jit
def argmax_slices_kernel(x_ptr, x_stride, vocab, val_ptr, idx_ptr, slices, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # a NaN wins, as in torch.argmax
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * slices + part, value)
    tl.store(idx_ptr + row * slices + part, part * BLOCK + index)


@triton.jit
def argmax_pick_kernel(val_ptr, idx_ptr, slices, out_ptr, out_stride, SLICES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, SLICES)
    values = tl.load(val_ptr + row * slices + offs, mask=offs < slices, other=float("-inf"))
    part = tl.argmax(values, axis=0, tie_break_left=True)
    tl.store(out_ptr + row * out_stride, tl.load(idx_ptr + row * slices + part).to(tl.int64))
