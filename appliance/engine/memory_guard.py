"""The process's share of GPU memory: `MemoryBudget` (--gpu-memory-utilization as vLLM reads it) and `ReserveGuard`,
which gives the CUDA caching allocator's unused blocks back when the engine falls idle over that budget.

The budget is `utilization` of the device's memory for this process, whatever other processes hold: what was in use
when the engine began to build (other processes, this process's CUDA context) is not counted against it, so two
servers at 0.45 share a GPU, as two vLLM servers do.

The KV cache is sized so that the process stays within --gpu-memory-utilization with room for the largest step's
activations. The caching allocator keeps freed blocks for the stream that allocated them, and the SM partitions
prefill and decode on streams of their own, so as prompts of other lengths come and go the blocks it keeps add up
past that room (measured on an H200, 8B, mux: 1.6 GiB over the budget with live tensors inside it, once long
prompts prefill in passes of max_num_batched_tokens). Giving them back (`torch.cuda.empty_cache`) waits for the
device and took about 40 ms there under load; done once a second it stalled the loop, so the guard releases only
when the engine has no request left (nothing to stall), and where even that cannot bring the reserve under the
limit (tensors in use above it) it says so once and asks less often. Each rank's executor holds one; under
tensor parallelism rank 0 tells the others when its engine falls idle (step_wire.IDLE).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("muxd.memory")

GiB = float(1 << 30)


@dataclass(frozen=True)
class MemoryBudget:
    total: int  # the device's memory
    utilization: float
    others: int  # in use when measured, outside this process's allocator (other processes, the CUDA context)

    @classmethod
    def measure(cls, device, utilization: float) -> "MemoryBudget":
        """Measured now, before the engine allocates anything but the weights."""
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return cls(total, utilization, total - free - torch.cuda.memory_reserved(device))

    def allocator_limit(self, free: int, reserved: int) -> int:
        """What this process's allocator may reserve, given the device's `free` memory and the allocator's
        `reserved` now: the budget less what the process has come to hold outside the allocator since measured
        (libraries' handles and modules, graphs)."""
        outside = max(0, self.total - free - reserved - self.others)
        return int(self.utilization * self.total) - outside

    def kv_bytes(self, free: int, reserved: int, reserve: int) -> int:
        """The KV cache's bytes: what the allocator may reserve beyond what it holds and `reserve` (the largest
        step's activations, sampling, graphs), and no more than the device has free beside `reserve` (other
        processes may hold more than the budget leaves them)."""
        budget = self.allocator_limit(free, reserved) - reserved - reserve
        if budget > free - reserve:
            log.warning("--gpu-memory-utilization %.2f leaves this process %.2f GiB, but the device has %.2f GiB free "
                        "(other processes hold %.2f GiB): the KV cache takes what is free", self.utilization,
                        self.utilization * self.total / GiB, free / GiB, self.others / GiB)
            budget = free - reserve
        return budget


class ReserveGuard:
    def __init__(self, limit: int, reserved: Callable[[], int], release: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic, first_wait_s: float = 1.0, most_s: float = 60.0) -> None:
        """`limit`: the bytes the allocator may reserve; `reserved()`: what it reserves now; `release()`: give the
        unused blocks back. While releasing is futile, the next try waits `first_wait_s`, then twice as long each
        time, up to `most_s`."""
        self.limit, self._reserved, self._release, self.clock = limit, reserved, release, clock
        self.first_wait_s, self.most_s = first_wait_s, most_s
        self._wait = 0.0
        self._next = clock()
        self.releases = 0  # times the reserve was given back
        self.released_bytes = 0
        self.release_seconds = 0.0  # time spent giving them back (waiting for the device included)
        self._warned = False

    def reserved_bytes(self) -> int:
        """What the allocator reserves now."""
        return self._reserved()

    def idle(self) -> bool:
        """The engine has no request left: release the unused blocks when the reserve is over the limit; whether it
        did."""
        now = self.clock()
        if now < self._next:
            return False
        before = self._reserved()
        if before <= self.limit:
            self._wait = 0.0
            return False
        start = self.clock()
        self._release()
        after = self._reserved()
        took = self.clock() - start
        self.releases += 1
        self.released_bytes += max(0, before - after)
        self.release_seconds += took
        log.info("idle with %.2f GiB reserved by the caching allocator, over the %.2f GiB the memory budget leaves it: "
                 "gave %.2f GiB of unused blocks back in %.1f ms", before / GiB, self.limit / GiB,
                 (before - after) / GiB, took * 1e3)
        if after > self.limit:  # tensors still in use exceed it: releasing again soon would not help
            self._wait = min(max(self._wait * 2, self.first_wait_s), self.most_s)
            if not self._warned:
                self._warned = True
                log.warning("the caching allocator still holds %.2f GiB in use, over the %.2f GiB the memory "
                            "budget (--gpu-memory-utilization) leaves beside the KV cache; set a smaller KV cache "
                            "(--kv-cache-memory)", after / GiB, self.limit / GiB)
        else:
            self._wait = 0.0
        self._next = now + self._wait
        return True


def cuda_reserve_guard(device, budget: MemoryBudget) -> ReserveGuard:
    """A guard for this process's allocator on `device`, its limit what `budget` leaves the allocator now."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return ReserveGuard(budget.allocator_limit(free, torch.cuda.memory_reserved(device)),
                        lambda: torch.cuda.memory_reserved(device), torch.cuda.empty_cache)
