"""engine/memory_guard.py: the memory budget as vLLM reads --gpu-memory-utilization (this process's share, whatever
others hold), and ReserveGuard: the caching allocator's unused blocks given back when the engine falls idle with its
reserve over that budget, less often while tensors in use exceed it; the engine asks it when its last request leaves,
never between the steps of running requests."""
from __future__ import annotations

import logging

import torch

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.memory_guard import MemoryBudget, ReserveGuard
from appliance.engine.request import SamplingParams


class Allocator:
    """A stand-in caching allocator: `live` bytes in tensors, `cached` in unused blocks."""

    def __init__(self, live: int, cached: int = 0) -> None:
        self.live, self.cached, self.empties = live, cached, 0

    def reserved(self) -> int:
        return self.live + self.cached

    def empty_cache(self) -> None:
        self.empties += 1
        self.cached = 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_is_this_processs_share_whatever_others_hold(caplog):
    # a GPU of 100 units; the weights (20) loaded, the CUDA context (1) made; by the KV sizing, warm-up left 2 more
    # in the allocator and 1 outside it (compiled modules); 5 set aside for activations
    alone = MemoryBudget(total=100, utilization=0.9, others=1)  # measured at free 79, reserved 20
    assert alone.allocator_limit(free=76, reserved=22) == 89  # 90 less the 1 this process added outside since
    assert alone.kv_bytes(free=76, reserved=22, reserve=5) == 62  # 89 - 22 - 5
    # a second server beside one that holds 45: it gets its own 45, as a second vLLM server at 0.45 does
    beside = MemoryBudget(total=100, utilization=0.45, others=46)  # measured at free 34, reserved 20
    assert beside.allocator_limit(free=31, reserved=22) == 44
    assert beside.kv_bytes(free=31, reserved=22, reserve=5) == 17
    # more than the device has free (the other server holds more than 0.55): what is free, and a warning
    crowded = MemoryBudget(total=100, utilization=0.45, others=66)
    with caplog.at_level(logging.WARNING, logger="muxd.memory"):
        assert crowded.kv_bytes(free=11, reserved=22, reserve=5) == 6
    assert "other processes hold" in caplog.records[-1].getMessage()


def test_the_reserve_over_the_limit_is_given_back_when_idle():
    alloc, clock = Allocator(live=60, cached=30), Clock()
    guard = ReserveGuard(100, alloc.reserved, alloc.empty_cache, clock)
    assert not guard.idle() and alloc.empties == 0  # 90 of 100
    alloc.cached = 55
    assert guard.idle() and alloc.empties == 1 and alloc.reserved() == 60
    assert guard.releases == 1 and guard.released_bytes == 55
    alloc.cached = 70
    assert guard.idle() and alloc.empties == 2 and guard.released_bytes == 125  # no wait after a useful release


def test_tensors_in_use_over_the_limit_warn_once_and_back_off(caplog):
    alloc, clock = Allocator(live=120, cached=10), Clock()
    guard = ReserveGuard(100, alloc.reserved, alloc.empty_cache, clock, first_wait_s=1.0, most_s=4.0)
    asked = []
    with caplog.at_level(logging.INFO, logger="muxd.memory"):
        for tick in range(0, 40):
            clock.now = tick * 0.5
            alloc.cached = 10
            if guard.idle():
                asked.append(clock.now)
    # releasing cannot help: the waits double up to most_s (1, 2, 4, 4, ...)
    assert asked[:5] == [0.0, 1.0, 3.0, 7.0, 11.0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--kv-cache-memory" in warnings[0].getMessage()
    alloc.live = 50  # the long prompts left: under the limit, the waits end
    clock.now += 4.0
    assert not guard.idle()
    alloc.cached = 60
    assert guard.idle() and alloc.reserved() == 50


def test_the_engine_asks_the_guard_only_when_its_last_request_leaves(llama_checkpoint):
    path, _ = llama_checkpoint
    prompts = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40, 17)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(guarded: bool):
        engine = build_engine(Config.flat(model=str(path), num_gpu_blocks_override=64))
        assert engine.executor.memory_guard is None  # (CPU, a KV size given: no budget to keep)
        alloc = Allocator(live=10, cached=1000)
        busy = []

        def reserved() -> int:
            busy.append(engine.scheduler.has_work())
            return alloc.reserved()
        if guarded:
            engine.executor.memory_guard = ReserveGuard(100, reserved, alloc.empty_cache)
        outs = [c.token_ids for c in engine.generate(prompts, params)]
        return outs, busy, alloc.empties

    plain, _, _ = run(False)
    outs, busy, empties = run(True)
    assert outs == plain
    assert busy and not any(busy) and empties == 1  # asked once idle, never with a request running


def test_metrics_show_the_allocator_against_its_budget(llama_checkpoint):
    from prometheus_client.parser import text_string_to_metric_families

    from appliance.engine.async_engine import AsyncEngine
    from appliance.server.metrics import Metrics

    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=str(path), num_gpu_blocks_override=64))
    alloc = Allocator(live=60, cached=90)
    engine.executor.memory_guard = ReserveGuard(100, alloc.reserved, alloc.empty_cache)
    engine.executor.memory_guard.idle()  # over: one release
    alloc.cached = 30
    aengine = AsyncEngine(engine)  # (publishes its figures at once)

    def served(stats) -> dict[str, float]:
        text = Metrics("m").render(stats).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("muxd:gpu_allocator")}
    assert served(aengine.stats) == {"muxd:gpu_allocator_reserved_bytes": 90.0,
                                     "muxd:gpu_allocator_budget_bytes": 100.0,
                                     "muxd:gpu_allocator_releases_total": 1.0}
    engine.executor.memory_guard = None  # (a CPU engine, or a KV size given): the gauges read 0
    aengine._publish_stats()
    assert set(served(aengine.stats).values()) == {0.0}
