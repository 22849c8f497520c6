"""What the executor launched and has not finished reading: a step whose sampled tokens the host has not read yet,
the device buffer they go to, prefill layers launched on a partition's stream, and what both are observed to take.

Every step writes the token ids it sampled, row after row (decode rows first, then the prompts it finished), into one
device buffer (`TokenBuffer`), then copies them to pinned host memory without waiting and records an event after the
copy. The next step may be launched before the host reads them: a request whose latest token is still on the device
enters that step as a placeholder for its row (engine/batch.py), and the forward takes the id from the buffer on the
device (inside the decode CUDA graph). The host reads a step's tokens (`Executor.collect`) once the next step is
launched; on a CPU the copy is done when it returns and the same code path runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import torch

from appliance.attention.pinned import HOST_WAITS
from appliance.engine.partitions import Partition
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.request import Request


@dataclass(frozen=True)
class Decisions:
    """What a step runs on, fixed before any kernel is launched (under tensor parallelism rank 0 decides and every
    rank follows, so that all run the same shapes): the partition, whether a mixed step may replay prefill graphs,
    and the rows of each prefill launch (one per layer range, in plan order; None: its tokens)."""

    partition: Partition
    mixed_graphs: bool = False
    prefill_rows: tuple[int | None, ...] = ()


def prefill_launches(plan: StepPlan) -> list[tuple[tuple[int, int], list[PrefillWork]]]:
    """The plan's prefill launches: consecutive works over the same layer range run as one."""
    return [(key, list(works)) for key, works in groupby(plan.prefill, key=lambda w: (w.layer_start, w.layer_end))]

class TokenBuffer:
    """The device buffer of the latest step's sampled token ids, and a ring of pinned host buffers they are read
    back into (a host buffer is reused only after the event of the copy into it has fired)."""

    def __init__(self, capacity: int, device: torch.device, slots: int = 3) -> None:
        self.capacity, self.device = capacity, device
        self._cuda = device.type == "cuda"
        with torch.inference_mode():  # written by sampling (inference mode), read inside captured graphs
            self.ids = torch.zeros(capacity, dtype=torch.long, device=device)
        self._host = [torch.empty(capacity, dtype=torch.long, pin_memory=self._cuda) for _ in range(slots)]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._slot = 0

    def rows(self, offset: int, count: int) -> torch.Tensor:
        """Rows [offset, offset + count) of the buffer, for sampling to write its tokens into directly."""
        if offset + count > self.capacity:
            raise RuntimeError(f"a step sampled {offset + count} tokens; the token buffer holds {self.capacity} "
                               "(one per running request: raise the runner's max_rows to --max-num-seqs)")
        return self.ids[offset:offset + count]

    def read_back(self, count: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying rows [0, count) to the host on the current stream: (the host tensor, the event after the copy;
        None on a CPU, where the copy is done)."""
        self._slot = (self._slot + 1) % len(self._host)
        event = self._events[self._slot]
        if event is not None:
            HOST_WAITS.wait(event)  # the step that last used this buffer was read two launches ago: at once
        host = self._host[self._slot][:count]
        host.copy_(self.ids[:count], non_blocking=self._cuda)
        if not self._cuda:
            return host, None
        event = self._events[self._slot] = torch.cuda.Event()
        event.record()
        return host, event


def mark(device: torch.device, marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None):
    """Timing events around a step's kernels on the current stream (none on a CPU): the first call records the start
    and returns the pair, the second records the end."""
    if device.type != "cuda":
        return None
    if marks is None:
        marks = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks[0].record()
    else:
        marks[1].record()
    return marks


@dataclass
class HeldRows:
    """Rows of a launched forward not sampled yet (Executor.finish_sampling): their ids, logits and requests as
    launched, each one's output count then (the engine counts the step's rows as pending once it is launched), where
    they go in the token buffer, and the partition whose stream samples them."""

    ids: list[str]
    logits: torch.Tensor
    requests: dict[str, Request]
    counts: list[int]
    offset: int
    partition: Partition


@dataclass(eq=False)
class LaunchedStep:
    """What a plan launched and how to read its tokens: the rows it sampled (request ids and requests, in the token
    buffer's order), each decode row's context at launch, the prefill works that ran with it (in stream order: they
    are complete once launched), their log-probabilities, the read-back and its event, and the timing the executor
    turns into observations once the tokens are read."""

    plan: StepPlan
    started: float
    rows: list[str] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    ends: list[int | None] = field(default_factory=list)  # a decode row's context at launch (None: a prompt's end)
    completed: list[PrefillWork] = field(default_factory=list)
    logprobs: dict[str, tuple[Any, int]] = field(default_factory=dict)
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    stream: torch.cuda.Stream | None = None  # where the read-back was queued (what a later launch orders after)
    marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # around the decode (or mixed) kernels
    after_marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # around prefill layers after decode
    partition: str = ""
    decode_sms: int = 0
    beside: tuple[PrefillWork, ...] = ()  # prefill works still running on another partition when it launched
    launch_s: float = 0.0  # host time spent launching prefill layers
    load: Any = None  # the decode load at launch (the engine's, for the planner's online refinement)
    launched: float = 0.0  # when its launch returned
    overlapped: bool = False  # another step was launched before its tokens were read
    collected: bool = False
    wall_ms: float | None = None  # from launch (or the previous step's tokens, if later) to its tokens on the host
    device_ms: float | None = None  # its decode (or mixed) kernels on the device, from the marks
    held: HeldRows | None = None  # rows whose sampling waits for the step before to be read

    def row_of(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.rows)}

    def done(self) -> bool:
        """Its tokens can be read without waiting."""
        return self.event is None or self.event.query()


@dataclass
class PrefillLaunch:
    """Prefill layers launched together on a partition's prefill stream: what they compute, the tokens of the chunks
    that end a prompt (the first len(ids) of a pinned host block, valid once the event has fired) and their
    log-probabilities, and the event after their last kernel."""

    works: list[PrefillWork]
    ids: list[str]
    tokens: torch.Tensor | None
    event: torch.cuda.Event | None
    stream: torch.cuda.Stream | None
    partition: str
    launched_at: float
    began: torch.cuda.Event | None = None  # recorded on the stream just before the first layer's kernels
    prefill_sms: int = 0
    decodes_before: int = 0  # split decode steps before its own step's (counted after its launch)
    logprobs: dict = field(default_factory=dict)

    def done(self) -> bool:
        return self.event is None or self.event.query()


@dataclass(frozen=True)
class PrefillObservation:
    """Prefill layers as they ran: the partition's prefill SMs, the works, their GPU time (from an event before the
    first layer to one after the last, on the prefill stream) and whether decode steps ran on the other SMs
    meanwhile; when it was launched and when the host saw it done (perf_counter seconds)."""

    prefill_sms: int
    works: tuple[PrefillWork, ...]
    ms: float
    beside_decode: bool
    launched_at: float = 0.0
    seen_at: float = 0.0

    @property
    def layers(self) -> int:
        return self.works[0].layer_end - self.works[0].layer_start


@dataclass(frozen=True)
class DecodeObservation:
    """A decode step as it ran: its partition's decode SMs, its time (launch to tokens on the host, less the host
    time spent launching prefill layers in between; its kernels' own time when the next step was launched before its
    tokens were read) and the prefill works running beside it (empty: it ran alone)."""

    decode_sms: int
    ms: float
    concurrent: tuple[PrefillWork, ...]
