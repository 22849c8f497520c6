"""A step as data: `StepPlan` (which requests decode, which prefill over which tokens and layers, on which SM
partition, and which requests left the engine since the last plan) and `PrefillWork`. Planners produce it, executors
carry it out."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillWork:
    """Compute KV for tokens [token_start, token_end) of a request through layers [layer_start, layer_end)."""

    request_id: str
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class StepPlan:
    """One step's work. With `mixed`, the decode rows and the prefill works (each over all layers) run as one
    forward over one flat token batch (Sarathi-style chunked prefill); otherwise decode and each layer range of
    prefill run as separate forwards.

    `decode_sms` / `prefill_sms` choose the SM partition of each phase (None: all SMs). With both set the phases run
    concurrently on disjoint partitions; executors without partitions (the CPU runner) ignore them. With
    `prefill_after_decode` the prefill layers run on all SMs after the decode rows, in the step's own stream, and
    complete with it (temporal multiplexing). `preempted` and
    `finished` name the requests that left, so the executor frees their state from the plan (a plan with nothing
    to run may still carry them).
    """

    decode: tuple[str, ...] = ()
    prefill: tuple[PrefillWork, ...] = ()
    mixed: bool = False
    decode_sms: int | None = None
    prefill_sms: int | None = None
    prefill_after_decode: bool = False
    preempted: tuple[str, ...] = ()  # requests preempted (pages taken back) while this step was planned
    finished: tuple[str, ...] = ()   # requests finished or aborted since the previous plan

    @property
    def released(self) -> tuple[str, ...]:
        """Requests whose executor state (activations of unfinished prefills, batch layout) goes now."""
        return self.preempted + self.finished

    @property
    def spatial(self) -> bool:
        """Decode and prefill on disjoint partitions (the multiplexed mode)."""
        return self.decode_sms is not None or self.prefill_sms is not None

    @property
    def empty(self) -> bool:
        """Nothing to run (there may still be state to release)."""
        return not self.decode and not self.prefill
