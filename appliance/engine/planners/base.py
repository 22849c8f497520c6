"""The planner interface every policy implements (`plan`, plus the hooks the engine calls on every planner) and
the small mechanisms the built-in planners share (admission in arrival order, prefill chunk ends, decode slots).
A planner decides; it never touches tensors or CUDA."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

from appliance.engine.plan import StepPlan
from appliance.engine.request import Request, RequestStatus
from appliance.predictor.shapes import DecodeLoad, PrefillItem

if TYPE_CHECKING:  # the scheduler calls its planner; the planner reads the scheduler
    from appliance.engine.scheduler import Scheduler


class Planner:
    """A scheduling policy. `plan` decides each step; the other hooks have do-nothing defaults, so a planner
    overrides only what it uses."""

    name = "planner"

    def plan(self, sched: "Scheduler") -> StepPlan:
        """Decide this step; may call sched.admit / sched.reserve_decode, must not touch tensors."""
        raise NotImplementedError

    def admission_check(self, sched: "Scheduler", request: Request) -> float | None:
        """None to accept a new request; else the Retry-After (seconds) of refusing it to keep the contract."""
        return None

    def observe_decode(self, load: DecodeLoad, decode_sms: int, concurrent: Sequence[PrefillItem],
                       measured_ms: float) -> None:
        """A decode step the executor timed beside prefill work on another partition."""

    def observe_prefill(self, items: list[PrefillItem], layers: int, prefill_sms: int, measured_ms: float) -> None:
        """Prefill layers the executor timed on a partition beside decode."""

    def observe_mixed(self, items: list[PrefillItem], load: DecodeLoad, measured_ms: float) -> None:
        """A mixed (chunked-prefill) step the executor timed on all SMs."""

    def observe_full(self, items: list[PrefillItem], layers: int, measured_ms: float) -> None:
        """Prefill layers the executor timed on all SMs after a decode step (a temporal step)."""

    def observe_launch(self, launches: int, layers: int, measured_ms: float, graphs: bool = False) -> None:
        """Host time the executor spent launching a step's prefill layers (`launches` launches, `layers` in all;
        `graphs`: every launch replayed piecewise graphs)."""

    def observe_tokens(self, gaps: list[tuple[Request, float]], first: list[tuple[Request, float]]) -> None:
        """Tokens as the engine emitted them: each gap since the request's previous token, and each first token's
        time since arrival (seconds on the scheduler's clock)."""

    def control_state(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Closed-loop state per SLO class and metric (headroom, observed tail), for /metrics; empty: none."""
        return {}

    def headrooms(self) -> dict[str, float]:
        """The TBT headroom each SLO class plans with now (the step log's figure, read every step); empty: none."""
        return {}

    def snapshot(self) -> dict[str, Any] | None:
        """What the planner decided and learned so far, for result JSONs and metrics (None: nothing to report)."""
        return None


def admit_fcfs(sched: Scheduler, token_budget: int) -> list[Request]:
    """Admit waiting requests in arrival order while pages, seats and the prompt-token budget allow (at least one)."""
    admitted: list[Request] = []
    while sched.waiting:
        r = sched.waiting[0]
        if admitted and r.num_tokens > token_budget:
            break
        if not sched.admit(r):
            break
        token_budget -= r.num_tokens - r.num_computed_tokens
        admitted.append(r)
    return admitted


def chunk_end(r: Request, max_tokens: int) -> int:
    """End of the request's next prefill chunk: at most max_tokens new tokens, so that a long prompt's activations
    stay within what the engine sized its memory for (the chunk's end stays fixed while its layers run)."""
    return min(r.num_tokens, r.num_computed_tokens + max_tokens)


def reserve_all(sched: Scheduler, requests: Iterable[Request]) -> tuple[str, ...]:
    """Reserve a decode slot for each request, oldest first, skipping those preempted on the way and those whose
    last token is already sampled (still pending: they finish once it is read)."""
    batch = []
    for r in sorted(requests, key=lambda r: r.start_seq):
        if r.status is RequestStatus.DECODING and not r.exhausted and sched.reserve_decode(r):
            batch.append(r.request_id)
    return tuple(batch)
