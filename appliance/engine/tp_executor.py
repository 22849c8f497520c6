"""The executors of a tensor-parallel engine, one per rank.

Rank 0's `LeaderExecutor` decides each step as the single-GPU executor does, sends it to the other ranks
(step_wire.py) and runs it; every other rank's `FollowerExecutor` runs the same step on its share of the model, on
the same SM partition and the same shapes, so that each collective has all ranks. Prefill launches and prefill graphs
use the prefill process group, everything else decode's, and prefill launches keep their launch order across streams
(a communicator's collectives must run in the order every rank issued them). A follower samples nothing: rank 0
samples, and sends the tokens it writes into its token buffer to the others' buffers (a broadcast after sampling), so
the engine's loop overlaps here too: a step launched before rank 0 has read the tokens of the one before names each
such token by its row of the buffer (engine/batch.py), on every rank, and every rank reads it there on the device. A
follower reads back a step's tokens after launching the next, as rank 0 does.
"""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from appliance.engine.executor import Executor
from appliance.engine.launched import Decisions, LaunchedStep
from appliance.engine.partitions import PartitionSet
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.ranks import SHUTDOWN, RankGroup
from appliance.engine.request import Request
from appliance.engine.runner import ModelRunner, Sampled
from appliance.engine.step_wire import IDLE, STEP, WireDecoder, WireEncoder
from appliance.model_zoo.parallel import phase, share_from_first


class _Phases(Executor):
    """Prefill's collectives on prefill's process group, one prefill launch after another."""

    def __init__(self, runner: ModelRunner, partitions: PartitionSet | None = None) -> None:
        super().__init__(runner, partitions)
        self.serial_prefills = True
        self.choose_one_row = False  # every rank replays the graph of the same size

    def _launch_prefill(self, *args: Any, **kwargs: Any) -> None:
        with phase("prefill"):
            super()._launch_prefill(*args, **kwargs)

    def capture_prefill(self, graph_rows: int) -> None:
        with phase("prefill"):
            super().capture_prefill(graph_rows)

    def drop_collectives(self, healthy: bool = True) -> None:
        """Destroy the CUDA graphs (each holds the collectives it captured) before this rank leaves the process group:
        NCCL's teardown, an abort's too, waits until no graph holds one. `healthy`: wait for the launched work first
        (after a rank died it may never finish; a graph still running is freed when it ends)."""
        if healthy and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        self.drop_graphs()
        gc.collect()


class LeaderExecutor(_Phases):
    """Rank 0: every step (and every release of requests) goes to the other ranks before it runs here."""

    def __init__(self, runner: ModelRunner, partitions: PartitionSet | None, group: RankGroup) -> None:
        super().__init__(runner, partitions)
        self.group = group
        self.wire = WireEncoder()
        group.before_leaving(self.drop_collectives)

    def _forget(self, request_ids: tuple[str, ...]) -> None:
        payload = self.wire.release(request_ids)
        if payload is not None:
            self.group.send(payload)
        super()._forget(request_ids)

    def idle(self) -> None:
        self.group.send(self.wire.idle())
        super().idle()

    def run(self, plan: StepPlan, requests: dict[str, Request], decisions: Decisions,
            hold_sampling: bool = False) -> LaunchedStep:
        self.group.send(self.wire.step(plan, requests, self.partitions.partitions.index(decisions.partition),
                                       decisions.mixed_graphs, self.runner.use_graphs, decisions.prefill_rows,
                                       hold_sampling))
        with self.group.guard():
            return super().run(plan, requests, decisions, hold_sampling)

    def collect(self, step: LaunchedStep) -> list[int]:
        with self.group.guard():
            return super().collect(step)

    def finish_sampling(self, step: LaunchedStep) -> None:
        with self.group.guard():  # (its broadcast: the other ranks wait for these tokens since their forward)
            super().finish_sampling(step)

    def on_fatal(self, callback: Callable[[BaseException], None]) -> None:
        self.group.on_failure(callback)

    def close(self) -> None:
        self.group.close()


class FollowerExecutor(_Phases):
    """A rank other than 0: runs what rank 0 sends until it says stop (or is gone)."""

    def follow(self, conn: Any) -> bool:
        """Run rank 0's steps; True when rank 0 said stop (and so leaves the group now too), False when it is gone."""
        wire = WireDecoder()
        previous: LaunchedStep | None = None  # read back after the next step is launched, as on rank 0
        while True:
            try:
                payload = conn.recv_bytes()
            except EOFError:  # rank 0 is gone
                return False
            if payload == SHUTDOWN:
                if previous is not None:
                    self.collect(previous)
                self.drop_collectives()
                return True
            step = wire.read(payload)
            for rid in step.plan.finished:
                self.settle(rid)  # this rank's kernels may still write the pages rank 0 has freed
            self._forget(step.plan.finished)
            if step.kind == STEP:
                self.runner.use_graphs = step.use_graphs
                launched = self.run(step.plan, wire.requests, Decisions(self.partitions.partitions[step.partition],
                                                                        step.mixed_graphs, step.prefill_rows),
                                    step.hold_sampling)
                if launched.held is not None:  # rank 0's tokens come after the step's prefill launches, as there
                    self.finish_sampling(launched)
                if previous is not None:
                    self.collect(previous)
                    previous = None
                if launched.rows:
                    previous = launched
                else:
                    self.collect(launched)
            elif step.kind == IDLE:
                self.idle()
            self.poll()


class LeaderRunner(ModelRunner):
    """Rank 0's runner: samples, and sends what it writes into the token buffer to the other ranks."""

    def sample(self, ids: list[str], logits: torch.Tensor, requests: dict[str, Request],
               counts: list[int] | None = None, out: torch.Tensor | None = None) -> Sampled:
        tokens, logprobs = super().sample(ids, logits, requests, counts, out)
        if out is not None and ids:
            share_from_first(out)
        return tokens, logprobs


class FollowerRunner(ModelRunner):
    """A follower's runner: the same forwards (the LM head's all-gather included), no sampling: the token buffer
    gets rank 0's tokens (a prefill's first token, sampled apart from it, reaches this rank with the next step)."""

    def sample(self, ids: list[str], logits: torch.Tensor, requests: dict[str, Request],
               counts: list[int] | None = None, out: torch.Tensor | None = None) -> Sampled:
        if out is None:
            return torch.zeros(len(ids), dtype=torch.long, device=self.device), {}
        return (share_from_first(out) if ids else out), {}

    def _record_prompt_logprobs(self, r: Request, w: PrefillWork, logits: torch.Tensor) -> None:
        pass
