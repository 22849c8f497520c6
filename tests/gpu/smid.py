"""A Triton kernel that records the SM each of its programs ran on (%smid): which SMs a stream's kernels can use."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _smid_kernel(out_ptr):
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out_ptr + tl.program_id(0), smid)


def launch_probe(programs: int = 1 << 16) -> torch.Tensor:
    """Launch the probe on the current stream; returns its output (read it after that stream has finished)."""
    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    _smid_kernel[(programs,)](out)
    return out


def read_probe(out: torch.Tensor) -> set[int]:
    assert (out >= 0).all(), "some programs did not record their SM"
    return set(out.unique().tolist())


def sms_used(stream: torch.cuda.Stream | None, programs: int = 1 << 16) -> set[int]:
    """The set of SM ids the programs of one launch on `stream` ran on."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        out = launch_probe(programs)
    stream.synchronize()  # torch.cuda.synchronize() does not wait for green-context streams
    return read_probe(out)
