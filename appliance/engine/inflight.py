"""Prefill layers launched on a partition's prefill stream and not reported yet: a request's continued layers ordered
after its previous ones, completion by events (`poll`), waiting for them, and the log of finished launches' GPU time
the planner learns from. The executor launches them (engine/executor.py); this owns them until they have run.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from appliance.engine.launched import PrefillLaunch, PrefillObservation
from appliance.engine.plan import PrefillWork
from appliance.engine.timeline import Timeline

Done = tuple[PrefillWork, int | None, tuple | None]  # a work, its first token, its log-probability entry


class PrefillsInFlight:
    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.launches: list[PrefillLaunch] = []  # in launch order
        self._last: dict[str, PrefillLaunch] = {}  # each request's latest prefill launch
        self._made_on: dict[str, torch.cuda.Stream | None] = {}  # the stream of each request's latest prefill layers
        self.finished: deque[PrefillObservation] = deque(maxlen=1024)  # the latest finished prefill launches
        self.finished_seen = 0  # how many were ever appended (a reader keeps its own mark)
        self._spare: list[torch.Tensor] = []  # pinned read-back blocks no launch holds

    def readback(self, count: int) -> torch.Tensor:
        """A pinned host block of at least `count` token ids for a launch's sampled tokens, reused once the launch that
        held it has been polled (a fresh pinned allocation per launch would be a host allocation on the launch path,
        which cannot reuse a block whose copy is still queued behind prefill layers)."""
        for i, block in enumerate(self._spare):
            if block.numel() >= count:
                return self._spare.pop(i)
        return torch.empty(max(count, 64), dtype=torch.long, pin_memory=True)

    def continue_on(self, works: list[PrefillWork], stream: torch.cuda.Stream | None,
                    use_partials_on: Callable[[str, torch.cuda.Stream | None], None]) -> None:
        """Continued chunks launched on `stream` wait for their previous layers launched on another stream, and
        keep those layers' activations from reuse there until `stream` has read them (`use_partials_on`)."""
        for w in works:
            last = self._last.get(w.request_id)
            if last is not None and last.event is not None and last.stream is not stream:
                stream.wait_event(last.event)
            if self._made_on.get(w.request_id, stream) is not stream:
                use_partials_on(w.request_id, stream)
            self._made_on[w.request_id] = stream

    def add(self, launch: PrefillLaunch) -> None:
        self.launches.append(launch)
        for w in launch.works:
            self._last[w.request_id] = launch

    @property
    def latest(self) -> PrefillLaunch | None:
        return self.launches[-1] if self.launches else None

    def running_on(self, partition: str) -> list[PrefillLaunch]:
        """The launches on `partition` whose layers may still be running."""
        return [l for l in self.launches if l.partition == partition and not l.done()]

    def running_works(self) -> tuple[PrefillWork, ...]:
        """The works of every launch whose layers may still be running."""
        return tuple(w for launch in self.launches if not launch.done() for w in launch.works)

    def poll(self, split_decodes: int) -> list[Done]:
        """Works whose layers have all run since the last call, in launch order, with the sampled token of each chunk
        that ends its prompt and its log-probability entry (None for the others); `split_decodes`: the decode steps
        run on a split partition so far (a launch with some after its own ran beside decode)."""
        done: list[Done] = []
        pending = []
        for launch in self.launches:
            if not launch.done():
                pending.append(launch)
                continue
            tokens = {}
            if launch.tokens is not None:
                tokens = dict(zip(launch.ids, launch.tokens[:len(launch.ids)].tolist()))
                self._spare.append(launch.tokens)  # its copy has run: the block can take another launch's tokens
            done += [(w, tokens.get(w.request_id), launch.logprobs.get(w.request_id)) for w in launch.works]
            for w in launch.works:
                if self._last.get(w.request_id) is launch:
                    del self._last[w.request_id]
            if launch.event is not None:
                now = time.perf_counter()
                if launch.began is not None:
                    self.finished.append(PrefillObservation(
                        launch.prefill_sms, tuple(launch.works), launch.began.elapsed_time(launch.event),
                        split_decodes > launch.decodes_before, launch.launched_at, now))
                    self.finished_seen += 1
                self.timeline.span("prefill", f"{launch.partition} prefill", launch.launched_at, now,
                                   works=len(launch.works),
                                   layers=f"{launch.works[0].layer_start}-{launch.works[0].layer_end}")
                if launch.ids:  # these prompts are done: their requests join the decode batch
                    self.timeline.instant("merge", f"{launch.partition} prefill", now, requests=len(launch.ids))
        self.launches = pending
        return done

    def since(self, mark: int) -> tuple[list[PrefillObservation], int]:
        """The launches finished since a reader's `mark` (at most the latest the log keeps) and its next mark."""
        new = min(self.finished_seen - mark, len(self.finished))
        return (list(self.finished)[len(self.finished) - new:] if new > 0 else []), self.finished_seen

    def wait(self) -> None:
        """Block until the oldest launch has finished."""
        if self.launches and self.launches[0].event is not None:
            self.launches[0].event.synchronize()

    def settle(self, request_id: str) -> None:
        """Block until every launched kernel of the request has run."""
        for launch in self.launches:
            if launch.event is not None and any(w.request_id == request_id for w in launch.works):
                launch.event.synchronize()

    def drop(self) -> None:
        """Forget every launch (the engine is being replaced)."""
        self.launches.clear()
        self._last.clear()
        self._made_on.clear()

    def forget(self, request_id: str) -> None:
        """Drop what is kept of a request that left (none of its layers is in flight by then)."""
        self._last.pop(request_id, None)
        self._made_on.pop(request_id, None)
