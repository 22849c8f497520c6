"""The executor: carries out StepPlans on the GPU's SM partitions, or on a null partition (CPU, or multiplexing off:
everything in the order of one stream) — one code path either way.

`start` launches the decode step on the chosen partition's decode stream first (a CUDA-graph replay), then the
planned prefill layers on its prefill stream, and returns without waiting: the sampled tokens go to the runner's token
buffer and are copied to the host behind an event (engine/launched.py), and `collect` reads them, after the engine
has launched the next step (the overlapped loop) or at once (`launch`, the synchronous one). A launch is ordered after
the step before it on every stream it uses while that step's tokens are unread, so pages freed meanwhile are reused
only after the kernels that may still touch them. A prefill launch on a partition records an event after its last
layer; `poll()` reports the works whose events have fired, so prefill may finish iterations later and decode never
waits for it. A request's continued prefill on another stream first waits for its previous event.
With a profiled GEMM table (`pad_prefills`), a prefill launch runs its layers on the cheapest row bucket of its
partition at or above its token count (predictor/gemm_table.py). Launches of up to `graph_rows` tokens replay
piecewise CUDA graphs captured per partition at the buckets up to that size (engine/prefill_graphs.py).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from appliance.attention import AttentionBackend, make_backend
from appliance.engine.graphs import DecodeGraphs, quiet_capture
from appliance.engine.inflight import Done, PrefillsInFlight
from appliance.engine.launched import (
    Decisions,
    DecodeObservation,
    HeldRows,
    LaunchedStep,
    PrefillLaunch,
    PrefillObservation,
    mark,
    prefill_launches,
)
from appliance.engine.memory_guard import ReserveGuard
from appliance.engine.partitions import Partition, PartitionSet
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.prefill_graphs import PrefillGraphs
from appliance.engine.request import Request
from appliance.engine.runner import ModelRunner
from appliance.engine.timeline import Timeline
from appliance.predictor.gemm_table import GemmTable, bucket_sizes


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class Executor:
    def __init__(self, runner: ModelRunner, partitions: PartitionSet | None = None,
                 timeline: Timeline | None = None) -> None:
        self.runner = runner
        self.partitions = partitions or PartitionSet.null()
        self.timeline = timeline or Timeline()
        self._graphs: dict[str, DecodeGraphs | None] = {}
        self._prefill_backends: dict[str, AttentionBackend] = {}
        self.inflight = PrefillsInFlight(self.timeline)  # prefill launched on partitions, not reported yet
        self.current: Partition = self.partitions.full
        self.switches = 0
        self.layers_launched = 0
        self.last_decode: DecodeObservation | None = None  # the latest decode step, for online refinement
        self.last_mixed_ms: float | None = None  # the latest step's time when it was a mixed step (online refinement)
        self.last_after_ms: float | None = None  # device time of its prefill layers after decode (online refinement)
        self._previous: LaunchedStep | None = None  # the latest step with tokens to read back
        self._tokens_at = 0.0  # when the latest collected step's tokens reached the host
        self.last_launch_ms: float | None = None  # host time the latest step spent launching prefill layers
        self.last_launch_graphs = False  # whether every one of those launches (or its mixed forward) replayed graphs
        self._split_decodes = 0  # decode steps run on a split partition
        self._gemm: GemmTable | None = None
        self._max_rows = 0
        self._null_sms = 0
        self._prefill_graphs: dict[str, PrefillGraphs] = {}  # per partition, all at the same row counts
        self.serial_prefills = False  # each prefill launch after the previous one, whichever streams they run on
        self.memory_guard: ReserveGuard | None = None  # (CUDA, the KV cache sized by the memory budget)
        self.overlaps = True  # a step's tokens may be read after the next step is launched (see Engine.step)
        # time each split's one-row graph against its two-row graph at capture and keep the faster (off where
        # ranks must replay the same graphs: a choice made by one rank's timings could differ from another's)
        self.choose_one_row = True
        self.one_row_graphs: dict[str, dict[str, float | bool]] = {}  # partition -> the timings and the choice

    def pad_prefills(self, table: GemmTable | None, max_rows: int, null_sms: int = 0) -> None:
        """Run each prefill launch on `table`'s cheapest row bucket for its partition (None: on its tokens), never
        on more than `max_rows` rows (the activations reserved); `null_sms`: the SM count the null partition (no
        streams) stands for in the table."""
        self._gemm, self._max_rows, self._null_sms = table, max_rows, null_sms

    def pad_rows(self, prefill_sms: int) -> Callable[[int], int] | None:
        """What a prefill launch on a partition of `prefill_sms` SMs pads its token count to (None: no padding):
        the table's cheapest bucket, else the smallest prefill graph that holds it."""
        table, sms = self._gemm, prefill_sms or self._null_sms
        if table is not None and sms in table.ms:
            def pad(tokens: int) -> int:
                rows = table.padded_rows(tokens, sms)
                return rows if rows <= self._max_rows else tokens
            return pad
        if not self._prefill_graphs:
            return None
        return next(iter(self._prefill_graphs.values())).padded

    @torch.inference_mode()
    def capture_prefill(self, graph_rows: int) -> None:
        """Piecewise prefill graphs at the row buckets up to `graph_rows` (the GEMM table's, where one is set) on
        every partition's prefill stream, each with its own pool (they may run at once); no-op without CUDA graphs
        or for 0 rows."""
        runner = self.runner
        self._prefill_graphs.clear()
        if graph_rows < 1 or runner.device.type != "cuda" or not runner.backend.supports_cuda_graph:
            return
        limit = min(graph_rows, self._max_rows) if self._max_rows else graph_rows
        rows = self._gemm.rows if self._gemm is not None else bucket_sizes(limit)
        sizes = tuple(r for r in rows if r <= limit)
        if not sizes:
            return

        def metadata_for(size: int):
            return runner.scratch_batch([size]).metadata

        with quiet_capture():  # (one collection for every partition's captures)
            for p in self.partitions.partitions:
                backend = self._prefill_backends.get(p.name, runner.backend)
                # a split's prefill launches pad to its GEMM table's targets alone (mixed steps, which pad to the
                # next captured size, run on all SMs): the other buckets would never replay
                kept = sizes
                if self._gemm is not None and p is not self.partitions.full:
                    targets = set(self._gemm.pad_targets(p.prefill_sms or self._null_sms))
                    kept = tuple(r for r in sizes if r in targets) or sizes
                graphs = PrefillGraphs(runner.model, runner.kv_cache, backend, list(kept), stream=p.prefill_stream)
                graphs.capture(metadata_for)
                self._prefill_graphs[p.name] = graphs

    @property
    def multiplexed(self) -> bool:
        return not self.partitions.full.is_null

    # ---- set-up -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """Decode graphs of these batch sizes on every partition's decode stream (one pool), and a prefill attention
        backend with its own workspace per partition (the two phases never share a plan or a workspace)."""
        runner = self.runner
        if not self.multiplexed:
            self._graphs[self.partitions.full.name] = runner.capture_graphs(sizes[-1], sizes=sizes)
            return
        pool = torch.cuda.graph_pool_handle()
        with quiet_capture():  # (one collection for every partition's captures)
            for p in self.partitions.partitions:
                graphs = runner.graph_set(sizes[-1], stream=p.decode_stream, pool=pool, sizes=sizes)
                if graphs is not None:
                    graphs.capture()
                    self._graphs[p.name] = graphs
                    if self.choose_one_row and p is not self.partitions.full:  # (all SMs: its tiles' graph)
                        choice = graphs.choose_one_row_graph()
                        if choice is not None:
                            self.one_row_graphs[p.name] = choice
                self._prefill_backends[p.name] = make_backend(runner.backend_name, runner.model.config,
                                                              runner.dtype, runner.device)
        runner.graphs = self._graphs.get(self.partitions.full.name)

    def drop_graphs(self) -> None:
        """Drop the captured graphs, prefill backends and in-flight launches (the engine is being replaced)."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._prefill_backends.clear()
        self.inflight.drop()
        self._previous = None
        self.runner.graphs = None

    def warm_kernels(self, logits_rows: int) -> None:
        """Before serving, launch on every partition's streams the kernels that an uncaptured launch picks by its
        size (ModelRunner.warm_kernels): on the prefill stream, one eager layer at each row bucket a prefill launch
        there pads to above its prefill graphs, and the LM head and the sampler up to `logits_rows` rows; on the
        decode stream, the sampler (its LM head runs in the decode graphs). No-op off CUDA."""
        runner = self.runner
        if runner.device.type != "cuda":
            return
        for p in self.partitions.partitions:
            graphs = self._prefill_graphs.get(p.name)
            above = graphs.sizes[-1] if graphs is not None else 0
            rows = [r for r in self._eager_buckets(p.prefill_sms or self._null_sms) if r > above]
            with _on(p.prefill_stream):
                runner.warm_kernels(rows, logits_rows, backend=self._prefill_backends.get(p.name))
            if p.decode_stream is not None and p.decode_stream != p.prefill_stream:
                with _on(p.decode_stream):
                    runner.warm_kernels([], logits_rows, head=False)
            # blocks cached for one stream serve no other: hand them back before the next partition's warm-up, so
            # that it peaks where one launch does (the activations the KV pool was sized around)
            torch.cuda.synchronize(runner.device)
            torch.cuda.empty_cache()

    def _eager_buckets(self, sms: int) -> tuple[int, ...]:
        """The row counts prefill launches on `sms` SMs pad to: the GEMM table's targets there; without a table,
        where they run unpadded, the bucket sizes (a sample of the sizes they run at)."""
        if not self._max_rows:
            return ()
        table = self._gemm
        rows = table.pad_targets(sms) if table is not None and sms in table.ms else bucket_sizes(self._max_rows)
        return tuple(r for r in rows if r <= self._max_rows)

    def graph_memory_bytes(self) -> int:
        return sum(g.memory_bytes for g in (*self._graphs.values(), *self._prefill_graphs.values()) if g is not None)

    @property
    def prefill_graph_launches(self) -> int:
        """Prefill launches that ran as piecewise graph replays."""
        return sum(g.launches for g in self._prefill_graphs.values())

    # ---- one iteration ----------------------------------------------------------------------------------------
    def partition_for(self, plan: StepPlan) -> Partition:
        """Decode SMs as planned while prefill runs; all SMs for a phase that runs alone (no bubbles)."""
        full = self.partitions.full
        if not self.multiplexed or not plan.decode or plan.decode_sms is None:
            return full
        if not plan.prefill and not self.inflight.launches:
            return full
        return self.partitions.for_decode(plan.decode_sms)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, requests: dict[str, Request],
               partition: Partition | None = None) -> dict[str, int]:
        """`start` the plan and `collect` it at once: the decode tokens, after the step has run (prefill launched
        on a partition completes later, through `poll()`). `partition` overrides the planned one (the profiler
        measures each partition alone)."""
        step = self.start(plan, requests, partition)
        tokens = self.collect(step)
        decode = set(plan.decode)
        return {rid: t for rid, t in zip(step.rows, tokens) if rid in decode}

    @torch.inference_mode()
    def start(self, plan: StepPlan, requests: dict[str, Request], partition: Partition | None = None,
              hold_sampling: bool = False) -> LaunchedStep:
        """Drop the state of the requests the plan released and launch the plan without waiting for it. Its
        sampled tokens stay on the device until `collect`; prefill layers launched on a partition's prefill stream
        complete through `poll()`, and those that run in stream order with the step (the null partition, a mixed
        step) are complete once launched (`LaunchedStep.completed`). `hold_sampling`: launch the decode (or mixed)
        forward only; its rows are sampled by `finish_sampling`, once the host has read the step before (a
        grammar's next mask or a penalty needs that token) while the forward runs."""
        self._forget(plan.released)
        self.last_launch_ms = None
        if plan.empty:
            return LaunchedStep(plan, time.perf_counter())
        return self.run(plan, requests, self.decide(plan, partition), hold_sampling)

    def decide(self, plan: StepPlan, partition: Partition | None = None) -> Decisions:
        """What the plan runs on: its partition, whether a mixed step may replay prefill graphs (not while a prefill
        launch still running there may be using their buffers) and the rows of each prefill launch."""
        part = partition or self.partition_for(plan)
        mixed_graphs = plan.mixed and part.name in self._prefill_graphs and not self.inflight.running_on(part.name)
        pad = None if plan.mixed else self.pad_rows(part.prefill_sms)
        rows = tuple(pad(sum(w.num_tokens for w in works)) if pad is not None else None
                     for _, works in prefill_launches(plan))
        return Decisions(part, mixed_graphs, rows)

    def _replays(self, part: Partition, rows: int | None) -> bool:
        """Whether a prefill launch decided to run on `rows` rows replays the partition's piecewise graphs."""
        graphs = self._prefill_graphs.get(part.name)
        return graphs is not None and rows is not None and self.runner.use_graphs and graphs.holds(rows)

    @torch.inference_mode()
    def run(self, plan: StepPlan, requests: dict[str, Request], decisions: Decisions,
            hold_sampling: bool = False) -> LaunchedStep:
        """Launch a (non-empty) plan as `decisions` say, without waiting for it (its decode or mixed rows unsampled
        with `hold_sampling`)."""
        step = LaunchedStep(plan, time.perf_counter())
        previous = self._previous
        if previous is not None and previous.collected:
            previous = self._previous = None
        if previous is not None:
            previous.overlapped = True
        part = decisions.partition
        if part is not self.current:
            self.switches += 1
            self.timeline.instant("partition switch", f"{part.name} decode", previous=self.current.name,
                                  decode_sms=part.decode_sms, prefill_sms=part.prefill_sms)
            self.current = part
        step.partition, step.decode_sms = part.name, part.decode_sms
        streams = [part.decode_stream] if plan.decode or plan.mixed else []
        streams += [part.prefill_stream] if plan.prefill and not plan.mixed and not plan.prefill_after_decode else []
        self._after(previous, streams)
        if plan.mixed:
            self._mixed(plan, requests, part, step, decisions.mixed_graphs, hold_sampling)
            self.last_launch_graphs = self.runner.last_replayed
        else:
            if plan.decode:
                step.ends = [requests[i].num_tokens for i in plan.decode]
                with _on(part.decode_stream):
                    step.marks = mark(self.runner.device)
                    ids, logits = self.runner.decode([requests[i] for i in plan.decode], self._graphs.get(part.name))
                    self._sample_or_hold(step, ids, logits, requests, part, hold_sampling)
            launching = time.perf_counter()
            groups = prefill_launches(plan)
            if len(groups) != len(decisions.prefill_rows):
                raise RuntimeError(f"{len(groups)} prefill launches but rows decided for "
                                   f"{len(decisions.prefill_rows)}")
            timed = plan.prefill_after_decode and bool(plan.decode) and len(groups) == 1
            if timed:  # prefill layers on all SMs after the decode rows: timed on their own (temporal steps)
                with _on(part.decode_stream):
                    step.after_marks = mark(self.runner.device)
            for ((start, end), works), rows in zip(groups, decisions.prefill_rows):
                self._launch_prefill(works, requests, start, end, part, step, rows, plan.prefill_after_decode)
            if timed and step.after_marks is not None:
                with _on(part.decode_stream):
                    mark(self.runner.device, step.after_marks)
            step.launch_s = time.perf_counter() - launching
            # counted after this step's prefill launches: they run beside this decode step too (on the other SMs)
            self._split_decodes += bool(plan.decode) and part is not self.partitions.full
            self.last_launch_ms = step.launch_s * 1e3 if plan.prefill else None
            self.last_launch_graphs = bool(groups) and all(self._replays(part, rows) for rows in decisions.prefill_rows)
            if part is not self.partitions.full:
                step.beside = self.inflight.running_works()
        if step.rows:
            if step.held is None:
                self._read_back(step, part)
            self._previous = step
        step.launched = time.perf_counter()
        return step

    def _read_back(self, step: LaunchedStep, part: Partition) -> None:
        with _on(part.decode_stream):  # after the decode rows (and, on the null partition, the prefill rows)
            step.host, step.event = self.runner.tokens.read_back(len(step.rows))
            step.stream = torch.cuda.current_stream() if step.event is not None else None

    def _sample_or_hold(self, step: LaunchedStep, ids: list[str], logits: torch.Tensor,
                        requests: dict[str, Request], part: Partition, hold: bool) -> None:
        """Sample the forward's rows now (and close the step's device marks), or keep them for `finish_sampling`
        with their place in the token buffer."""
        if not hold or not ids:
            self._sampled(step, ids, logits, requests)
            mark(self.runner.device, step.marks)
            return
        step.held = HeldRows(list(ids), logits, {i: requests[i] for i in ids},
                             [requests[i].num_output_tokens for i in ids], len(step.rows), part)
        step.rows += ids
        step.requests += [requests[i] for i in ids]
        step.ends += [None] * (len(step.rows) - len(step.ends))

    @torch.inference_mode()
    def finish_sampling(self, step: LaunchedStep) -> None:
        """Sample the rows a launch held (after its forward, on its stream) and start reading the step back. The
        requests are those of the launch: one that finished since gets a token that is dropped."""
        held, step.held = step.held, None
        with _on(held.partition.decode_stream):
            _, logprobs = self.runner.sample(held.ids, held.logits, held.requests, held.counts,
                                             out=self.runner.tokens.rows(held.offset, len(held.ids)))
            step.logprobs.update(logprobs)
            mark(self.runner.device, step.marks)
        self._read_back(step, held.partition)

    def collect(self, step: LaunchedStep) -> list[int]:
        """The step's sampled tokens on the host, in row order (waiting for them if they are not there yet); sets
        the observations of the step (`last_decode`, `last_mixed_ms`, `last_after_ms`) for the planner's online
        refinement."""
        if step.collected:
            raise RuntimeError("a launched step's tokens are collected once")
        if step.held is not None:
            raise RuntimeError("a step whose sampling is held is sampled (finish_sampling) before it is read")
        step.collected = True
        self.last_decode = self.last_mixed_ms = self.last_after_ms = None
        if not step.rows:
            return []
        if step.event is not None:
            waited = time.perf_counter()
            step.event.synchronize()
            self.runner.gpu_wait_s += time.perf_counter() - waited
        tokens = step.host.tolist()
        ended = time.perf_counter()
        if step.marks is not None:
            step.device_ms = step.marks[0].elapsed_time(step.marks[1])
        if step.after_marks is not None:
            self.last_after_ms = step.after_marks[0].elapsed_time(step.after_marks[1])
        ready = ended if step.event is not None else step.launched  # (without an event: complete when launched)
        step.wall_ms = (ready - max(step.started, self._tokens_at)) * 1e3
        self._tokens_at = ready
        plan = step.plan
        # launch to tokens on the host, as the profile measured a step; when the next step was launched first, that
        # includes a wait behind the previous step: then the kernels' own time
        since = (ready - step.started) * 1e3
        if plan.mixed:
            self.last_mixed_ms = step.device_ms if step.overlapped and step.device_ms is not None else since
            self.timeline.span("mixed", f"{step.partition} decode", step.started, ended, batch=len(plan.decode),
                               prefill_tokens=sum(w.num_tokens for w in plan.prefill))
        elif plan.decode:
            # the host's prefill launches ran while the decode kernels did: the step as the profile measured it (decode
            # alone on the host) is the wall time less them, or the decode kernels' own time when that is longer
            ms = since - step.launch_s * 1e3
            if step.device_ms is not None:
                ms = step.device_ms if step.overlapped else max(ms, step.device_ms)
            self.last_decode = DecodeObservation(step.decode_sms, ms, step.beside)
            self.timeline.span("decode", f"{step.partition} decode", step.started, ended, batch=len(plan.decode),
                               decode_sms=step.decode_sms)
        return tokens

    def _after(self, previous: LaunchedStep | None, streams: list[torch.cuda.Stream | None]) -> None:
        """Order this launch's streams after the step launched before it, while that one's tokens are not read: it
        may still write KV pages (of requests that finished, were aborted or preempted since, whose pages this
        launch may reuse; of chunks this launch continues) and the token buffer this launch reads. Its own stream
        keeps the order by itself."""
        if previous is None or previous.event is None:
            return
        for stream in streams:
            stream = stream if stream is not None else torch.cuda.current_stream()
            if stream != previous.stream:
                stream.wait_event(previous.event)

    def _sampled(self, step: LaunchedStep, ids: list[str], logits: torch.Tensor,
                 requests: dict[str, Request]) -> None:
        """Sample the rows `ids` into the token buffer after the step's rows so far."""
        if not ids:
            return
        _, logprobs = self.runner.sample(ids, logits, requests, out=self.runner.tokens.rows(len(step.rows), len(ids)))
        step.rows += ids
        step.requests += [requests[i] for i in ids]
        step.ends += [None] * (len(step.rows) - len(step.ends))
        step.logprobs.update(logprobs)

    def _mixed(self, plan: StepPlan, requests: dict[str, Request], part: Partition, step: LaunchedStep,
               use_graphs: bool, hold_sampling: bool = False) -> None:
        """A mixed (chunked-prefill) step is one forward on all SMs, in stream order with the step. With
        `use_graphs` it replays the partition's prefill graphs where one holds its rows (padded to the smallest that
        does), after any prefill launch of this process still using their buffers (one that another rank decided
        for)."""
        graphs = self._prefill_graphs.get(part.name) if use_graphs else None
        if graphs is not None and part.decode_stream is not None:
            for l in self.inflight.running_on(part.name):
                if l.event is not None:
                    part.decode_stream.wait_event(l.event)
        step.ends = [requests[i].num_tokens for i in plan.decode]
        with _on(part.decode_stream):
            step.marks = mark(self.runner.device)
            ids, logits = self.runner.forward(plan, requests, graphs.padded if graphs else None, graphs)
            self._sample_or_hold(step, ids, logits, requests, part, hold_sampling)
        step.completed = list(plan.prefill)

    def _launch_prefill(self, works: list[PrefillWork], requests: dict[str, Request], start: int, end: int,
                        part: Partition, step: LaunchedStep, rows: int | None = None,
                        after_decode: bool = False) -> None:
        """Layers [start, end) of the works on the partition's prefill stream (on the null partition, or
        `after_decode`: in order with the step, after its decode rows), on `rows` rows (None: their tokens)."""
        pad = None if rows is None else lambda _: rows
        stream = part.prefill_stream
        started = time.perf_counter()
        self.layers_launched += end - start
        if stream is None or after_decode:  # in stream order with the step, whose rows get the prompts it ends
            with _on(part.decode_stream):
                self.inflight.continue_on(works, part.decode_stream, self.runner.use_partials_on)
                ids, logits = self.runner.prefill(works, requests, start, end, None, pad,
                                                  self._prefill_graphs.get(part.name))
                self._sampled(step, ids, logits, requests)
            step.completed += works
            self.timeline.instant("prefill launch", f"{part.name} prefill", started, layers=f"{start}-{end}",
                                  tokens=sum(w.num_tokens for w in works))
            return
        with _on(stream):
            self.inflight.continue_on(works, stream, self.runner.use_partials_on)
            latest = self.inflight.latest if self.serial_prefills else None
            if latest is not None and latest.stream not in (None, stream):
                stream.wait_event(latest.event)  # one prefill communicator: its collectives in launch order
            began = torch.cuda.Event(enable_timing=True)
            began.record(stream)
            ids, logits = self.runner.prefill(works, requests, start, end, self._prefill_backends.get(part.name), pad,
                                              self._prefill_graphs.get(part.name))
            host, logprobs = None, {}
            if ids:  # read back without waiting: poll() reads them once the event has fired
                tokens, logprobs = self.runner.sample(ids, logits, requests)
                host = self.inflight.readback(len(ids))
                host[:len(ids)].copy_(tokens, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        launch = PrefillLaunch(works, ids, host, event, stream, part.name, started, began, part.prefill_sms,
                         self._split_decodes, logprobs)
        self.inflight.add(launch)
        self.timeline.instant("prefill launch", f"{part.name} prefill", started, layers=f"{start}-{end}",
                              tokens=sum(w.num_tokens for w in works))

    # ---- completion -------------------------------------------------------------------------------------------
    def poll(self) -> list[Done]:
        """Prefill works launched on a partition whose layers have all run since the last call, in launch order, with
        the sampled token of each chunk that ends its prompt and its log-probability entry (None for the others)."""
        return self.inflight.poll(self._split_decodes)

    @property
    def prefills(self):
        """The latest finished prefill launches (PrefillObservation), oldest first."""
        return self.inflight.finished

    @property
    def prefills_seen(self) -> int:
        """How many prefill launches ever finished (a reader of `prefills_since` keeps its own mark)."""
        return self.inflight.finished_seen

    def prefills_since(self, mark: int) -> tuple[list[PrefillObservation], int]:
        """The prefill launches finished since a reader's `mark` (at most the latest the log keeps) and its next
        mark."""
        return self.inflight.since(mark)

    def has_inflight(self) -> bool:
        return bool(self.inflight.launches)

    @property
    def num_inflight(self) -> int:
        """Prefill launches not reported by `poll()` yet."""
        return len(self.inflight.launches)

    def wait(self) -> None:
        """Block until the oldest in-flight prefill launch has finished (the engine has nothing else to run)."""
        self.inflight.wait()

    def settle(self, request_id: str) -> None:
        """Block until every launched kernel of the request has run: its pages may then go to another request."""
        self.inflight.settle(request_id)

    def idle(self) -> None:
        """The engine has no request left: give the caching allocator's unused blocks back where they exceed the
        memory budget (nothing to stall now; memory_guard.py)."""
        if self.memory_guard is not None:
            self.memory_guard.idle()

    def release(self, plan: StepPlan) -> None:
        """Forget the executor state of the requests the plan names as preempted or finished."""
        self._forget(plan.released)

    def _forget(self, request_ids: tuple[str, ...]) -> None:
        """Forget the requests' executor state (finished, preempted or aborted: none of their prefill kernels is in
        flight by then, the engine `settle`s an aborted request's; a decode step not read yet needs none of it)."""
        for rid in request_ids:
            self.inflight.forget(rid)
            self.runner.release(rid)

    # ---- lifetime ---------------------------------------------------------------------------------------------
    def on_fatal(self, callback: Callable[[BaseException], None]) -> None:
        """Have `callback` called when the executor can no longer run (a tensor-parallel rank died); one GPU has no
        such failure of its own."""

    def close(self) -> None:
        """Stop what the executor started (the other ranks of a tensor-parallel engine)."""
