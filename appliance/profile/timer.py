"""`StepTimer`: measures one profile point (solo prefill, solo decode, decode beside a prefill, a mixed step) through
the engine's executor on its SM partitions, with the timing rules `muxd profile` relies on."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Sequence

import numpy as np
import torch

from appliance.attention import uses_triton_decode
from appliance.engine.engine import Engine
from appliance.engine.partitions import Partition
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.request import Request, SamplingParams
from appliance.errors import CapacityError, ConfigError
from appliance.predictor.decode_plan import DecodePlan
from appliance.predictor.gemm_table import GemmTable, bucket_sizes
from appliance.predictor.prefill_plan import PrefillPlan
from appliance.predictor.roofline import DEVICES
from appliance.profile.gemm_probe import measure_gemm_table
from appliance.profile.grid import Point

log = logging.getLogger("muxd.profile")
CPU_SM_COUNT = DEVICES["cpu"].sm_count  # what a CPU "partition" counts as (the CPU has no SM partitions)


class StepTimer:
    """Times one grid point on the engine's executor and partitions."""

    def __init__(self, engine: Engine, reps: int = 3, decode_steps: int = 8, contended_steps: int = 10) -> None:
        self.engine, self.executor = engine, engine.executor
        self.reps, self.decode_steps, self.contended_steps = reps, decode_steps, contended_steps
        parts = self.executor.partitions
        self.cuda = engine.kv_cache.data.is_cuda
        self.sm_count = parts.total_sms if self.executor.multiplexed else (
            torch.cuda.get_device_properties(engine.kv_cache.data.device).multi_processor_count if self.cuda
            else CPU_SM_COUNT)
        self.gpu_name = torch.cuda.get_device_name(engine.kv_cache.data.device) if self.cuda else "cpu"
        self._by_decode = {p.decode_sms: p for p in parts.splits}
        self._by_prefill = {p.prefill_sms: p for p in parts.splits}
        self.rng = np.random.default_rng(0)
        self._ids = 0

    @property
    def decode_partitions(self) -> list[int]:
        return sorted(self._by_decode)

    @property
    def decode_plan(self) -> DecodePlan | None:
        """What the decode attention kernels plan from, where the engine's decode graphs run muxd's Triton kernels or
        it decodes with flashinfer's tensor-core decode (the kernels the critical-path term models, decode_plan.py);
        None for any other decode."""
        runner, page_size = self.engine.runner, self.engine.kv_cache.page_size
        triton = runner.graphs is not None and uses_triton_decode(runner.decode_kernel, self.engine.model.config, 1,
                                                                  page_size)
        if not self.cuda or not (triton or getattr(runner.backend, "decode_tensor_cores", False)):
            return None
        sizes = tuple(runner.graphs.sizes) if runner.graphs is not None else ()
        return DecodePlan(self.sm_count, self.engine.model.config.num_kv_heads, page_size, sizes,
                          "triton" if triton else "flashinfer")

    @property
    def prefill_plan(self) -> PrefillPlan | None:
        """What the prefill attention kernel plans from, where the engine runs flashinfer's FA3 prefill (the kernel
        the critical-path term models, prefill_plan.py); None for any other prefill."""
        backend = self.engine.runner.backend
        if not self.cuda or getattr(backend, "prefill_kernel", None) != "fa3":
            return None
        return PrefillPlan(self.sm_count, self.engine.model.config.num_heads)

    @property
    def prefill_streams(self) -> dict[int, torch.cuda.Stream | None]:
        """Each prefill partition's SM count and stream (None: the null partition, which runs on the current
        stream)."""
        parts = self.executor.partitions
        return {self.sm_count: parts.full.prefill_stream, **{p.prefill_sms: p.prefill_stream for p in parts.splits}}

    def measure_gemm(self) -> GemmTable:
        """One layer's GEMM time at the row buckets up to the largest prefill batch, on every prefill partition."""
        table = measure_gemm_table(self.engine.model, self.prefill_streams,
                                   bucket_sizes(self.engine.config.scheduler.max_num_batched_tokens))
        return dataclasses.replace(table, graph_rows=self.engine.prefill_graph_rows)

    def pad_prefills(self, table: GemmTable | None) -> None:
        """Measure prefill as serving with this profile will run it: padded to `table`'s buckets (None: not)."""
        self.executor.pad_prefills(table, self.engine.config.scheduler.max_num_batched_tokens, self.sm_count)

    def measure(self, point: Point) -> float | None:
        """Milliseconds of the point's step (median of repetitions; a decode beside prefill: the 90th percentile
        of its steps, since the contention guard plans for the worst case); None when it could not be measured."""
        try:
            return self._measure(point)
        except CapacityError as exc:  # the pool's admission keeps more back than the grid's estimate
            log.warning("left out %s: %s", point.key, exc)
            return None

    def _measure(self, point: Point) -> float | None:
        if point.kind == "prefill":
            return self._prefill(point)
        if point.kind == "decode":
            return self._decode(point)
        if point.kind == "mixed":
            return self._mixed(point)
        return self._contended(point)

    # ---- partitions -------------------------------------------------------------------------------------------
    def _partition(self, phase: str, sms: int) -> Partition:
        """The partition whose `phase` ("decode" or "prefill") stream has `sms` SMs (all of them: `full`)."""
        if sms == self.sm_count:
            return self.executor.partitions.full
        table = self._by_decode if phase == "decode" else self._by_prefill
        if sms not in table:
            raise ConfigError(f"no {phase} partition of {sms} SMs; this GPU offers {sorted(table)}")
        return table[sms]

    # ---- requests ---------------------------------------------------------------------------------------------
    def _request(self, tokens: int, max_tokens: int = 1) -> Request:
        self._ids += 1
        vocab = self.engine.model.config.vocab_size
        r = Request(f"profile-{self._ids}", self.rng.integers(3, vocab, tokens).tolist(),
                    SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self.engine.scheduler.add(r)
        return r

    def _prefill_works(self, point: Point) -> tuple[list[Request], tuple[PrefillWork, ...]]:
        r = self._request(point.new + point.reused)
        if not self.engine.scheduler.admit(r):
            self.engine.abort(r.request_id)
            raise CapacityError(f"the KV pool cannot hold a prefill of {point.new + point.reused} tokens")
        r.num_computed_tokens = point.reused  # the cached prefix's KV is taken as computed
        layers = self.engine.model.config.num_layers
        return [r], (PrefillWork(r.request_id, point.reused, point.reused + point.new, 0, layers),)

    def _seat(self, batch: int, context: int) -> list[Request]:
        reqs = []
        for _ in range(batch):
            r = self._request(context, max_tokens=8)
            if not self.engine.scheduler.seat_decoding(r):
                self.engine.abort(r.request_id)
                self._clear(reqs)
                raise CapacityError(f"the KV pool cannot hold a decode batch of {batch} x {context} tokens")
            reqs.append(r)
        return reqs

    def _clear(self, reqs: Sequence[Request]) -> None:
        self._drain()
        for r in reqs:
            self.engine.abort(r.request_id)

    def _drain(self) -> None:
        while self.executor.has_inflight():
            self.executor.wait()
            self.executor.poll()

    # ---- steps ------------------------------------------------------------------------------------------------
    def _prefill(self, point: Point) -> float:
        reqs, works = self._prefill_works(point)
        return self._repeat(StepPlan(prefill=works), self._partition("prefill", point.sms), reqs)

    def _mixed(self, point: Point) -> float:
        """A chunked-prefill step: the chunk and the decode rows in one forward on all SMs, launch to tokens."""
        reqs = self._seat(point.batch, point.context)
        try:
            pre, works = self._prefill_works(point)
        except CapacityError:
            self._clear(reqs)
            raise
        plan = StepPlan(decode=tuple(r.request_id for r in reqs), prefill=works, mixed=True)
        return self._repeat(plan, self.executor.partitions.full, pre + reqs)

    def _repeat(self, plan: StepPlan, part: Partition, reqs: list[Request]) -> float:
        """Median wall time of `plan` run to completion, repeated (short steps more often); `reqs` are released."""
        times: list[float] = []
        reps = self.reps
        try:
            i = 0
            while len(times) < reps:  # the first run plans and warms; it is not counted
                start = time.perf_counter()
                self.executor.launch(plan, self.engine.scheduler.requests, partition=part)
                self._drain()
                seconds = time.perf_counter() - start
                if i == 0:  # short steps vary with the host: more repetitions, about a quarter second in all
                    reps = max(self.reps, min(4 * self.reps, int(0.25 / max(seconds, 1e-3))))
                else:
                    times.append(seconds * 1e3)
                i += 1
        finally:
            self._clear(reqs)
        return statistics.median(times)

    def _decode(self, point: Point) -> float:
        reqs = self._seat(point.batch, point.context)
        part = self._partition("decode", point.sms)
        plan = StepPlan(decode=tuple(r.request_id for r in reqs))
        times = []
        try:
            for i in range(self.decode_steps + 2):
                self.executor.launch(plan, self.engine.scheduler.requests, partition=part)
                if i >= 2:
                    times.append(self.executor.last_decode.ms)
        finally:
            self._clear(reqs)
        return statistics.median(times)

    def _contended(self, point: Point) -> float | None:
        """Decode steps on the split while its prefill stream is kept busy (prefills queued two deep); a step counts
        only when a prefill was still running while its tokens were awaited."""
        part = self._partition("decode", point.sms)
        if part is self.executor.partitions.full:
            raise ConfigError("a contended sample needs a split partition")
        reqs = self._seat(point.batch, point.context)
        pre, works = self._prefill_works(point)
        decode = StepPlan(decode=tuple(r.request_id for r in reqs))
        prefill = StepPlan(prefill=works)
        requests = self.engine.scheduler.requests
        times: list[float] = []
        try:
            self.executor.launch(decode, requests, partition=part)  # plans the decode wrapper for this batch
            self.executor.launch(prefill, requests, partition=part)  # and the prefill's
            self._drain()
            tries = 0
            while len(times) < self.contended_steps and tries < 20 * self.contended_steps:
                tries += 1
                self.executor.poll()
                while self.executor.num_inflight < 2:
                    self.executor.launch(prefill, requests, partition=part)
                self.executor.launch(decode, requests, partition=part)
                seen = self.executor.last_decode
                if seen.concurrent:  # a prefill was still running while the step's tokens were awaited
                    times.append(seen.ms)
        finally:
            self._clear(pre + reqs)
        if not times:  # the prefill never outlasted its launch (a model too small to keep the stream busy)
            log.warning("left out %s: no decode step overlapped its prefill", point.key)
            return None
        return float(np.percentile(times, 90))


# ---- the run ---------------------------------------------------------------------------------------------------
