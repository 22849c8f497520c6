"""The prefill batches of the `mux` planner: which waiting prompts prefill together, in what order (Bullet's
reordering, deadlines.py), when a more urgent prompt pauses the running batch at a layer or chunk boundary
(MuxWise), whether the KV pool admits a prompt, and how long a new prompt would wait behind them (for shedding).
How each step shares the GPU between decode and the running batch is mux.py's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from appliance.engine.planners.deadlines import Deadlines, reorder
from appliance.engine.request import Request, RequestStatus
from appliance.engine.scheduler import Scheduler
from appliance.predictor.predictor import Predictor
from appliance.predictor.shapes import PrefillItem

if TYPE_CHECKING:
    from appliance.engine.planners.mux import MuxOptions, MuxStats

PAUSE_CANDIDATES = 8  # waiting prompts, most urgent first, considered for pausing the running batch


class MuxBatches:
    """The running batch, a paused one, and the rules that form, pause and admit them."""

    def __init__(self, predictor: Predictor, options: "MuxOptions", stats: "MuxStats",
                 deadlines: Callable[[Scheduler], Deadlines]) -> None:
        self.predictor, self.options, self.stats, self.deadlines = predictor, options, stats, deadlines
        self.batch: list[str] = []   # prompts prefilled together, layer by layer, with layers still to launch
        self.paused: list[str] = []  # a batch paused at a layer boundary; it resumes when the current one ends
        self.chunked: set[str] = set()  # prompts that ran a mixed chunk: started, pausable between chunks
        self.prefill_sms = predictor.sm_count  # of the last step, for predictions outside a step
        self._pause_seen: tuple = ()

    def start(self, sched: Scheduler, now: float) -> None:
        """A new batch: the paused one back, else the waiting prompts in serve order while they fit its token budget
        and the KV pool, and while joining leaves no more prompts late (planned deadlines) than serving the joiner
        right after the batch would (every member's first token comes when the whole batch has run: a short prompt
        batched with long ones waits for them all)."""
        if self.paused:
            self.batch, self.paused = self.paused, []
            return
        dl, p = self.deadlines(sched), self.predictor
        budget = self.options.max_prefill_tokens
        items: list[PrefillItem] = []
        due: list[float] = []  # the members' deadlines
        took = 0.0  # seconds the batch's prefill takes so far
        # pages the running requests may still take (each admitted prompt adds its own); a sum over every running
        # request, so only when a prompt waits
        reserve = self.reserve(sched) if sched.waiting else 0
        for r in self.order(sched, now):
            if sched.num_running >= sched.max_num_seqs:
                break
            item = dl.item(r)
            deadline = dl.deadline(r)
            if items and item.new > budget:
                break
            if items:  # (for a first member, once it is admitted: a full pool may turn the whole queue away)
                takes = p.prefill_ms([*items, item], self.prefill_sms) / 1e3  # the batch's prefill with it
                alone = p.prefill_ms([item], self.prefill_sms) / 1e3
                late_together = sum(now + takes > d for d in due) + (now + takes > deadline)
                late_apart = sum(now + took > d for d in due) + (now + took + alone > deadline)
                if late_apart < late_together:
                    break
            # a prompt the KV pool cannot hold yet does not block the ones behind it (it stays first in line)
            if self.admit(sched, r, reserve):
                if not items:
                    takes = p.prefill_ms([item], self.prefill_sms) / 1e3
                reserve += self.growth(sched, r)
                self.batch.append(r.request_id)
                items.append(item)
                due.append(deadline)
                took = takes
                budget -= item.new

    def maybe_pause(self, sched: Scheduler, now: float) -> None:
        """MuxWise: the most urgent waiting prompt pauses the running batch at its next layer boundary when it
        would miss its TTFT behind the batch, makes it when run first, and no request of the batch that would make
        its own misses it (one late either way does not count). The pausing batch is never paused itself. "Would
        miss" is judged with both prefill times `pause_margin` longer than predicted: a prompt predicted to finish
        just inside its deadline behind a long batch is late whenever the batch runs a little slow, and pausing
        for it costs the batch nothing its own deadline cannot spare (`spares`)."""
        if not sched.waiting:
            return
        batch = [sched.requests[rid] for rid in self.batch]
        if min(r.prefill_layer for r in batch) == 0 and not any(
                r.request_id in sched.inflight or r.request_id in self.chunked for r in batch):
            return  # not started: nothing to pause, it simply waits its turn (judged again once it has started)
        # the verdict changes only when the queue or the batch does (time moves deadlines and the batch's
        # remaining time alike)
        seen = (len(sched.waiting), sched.waiting[-1].request_id, tuple(self.batch),
                sum(r.num_computed_tokens for r in batch))  # (computed tokens move on at chunk and pass ends)
        if seen == self._pause_seen:
            return
        self._pause_seen = seen
        dl, p = self.deadlines(sched), self.predictor
        current, later = self.left_ms(sched, batch, self.prefill_sms)
        remaining = (current + later) / 1e3
        for w in self.order(sched, now)[:PAUSE_CANDIDATES]:
            own = p.prefill_ms([dl.item(w)], self.prefill_sms) / 1e3
            deadline = dl.deadline(w)
            behind = (remaining + own) * (1 + self.options.pause_margin)
            if not (own < remaining and now + behind > deadline >= now + own):
                continue  # long, or fine behind the batch, or late anyway
            if not self.spares(dl, batch, now, own, remaining):
                return  # the batch cannot spare the time of the most urgent candidate
            if self.admit(sched, w):
                break
        else:
            return
        self.paused, self.batch = self.batch, [w.request_id]
        self.stats.pauses += 1

    def left_ms(self, sched: Scheduler, batch: list[Request], sms: int) -> tuple[float, float]:
        """Prefill time the batch has left on `sms` SMs: (the layers its current pass has not run, every later
        pass in full). A prompt longer than `chunk_tokens` prefills in passes of that many tokens, each through every
        layer: the layers run so far are of the current pass only."""
        dl, p, cap = self.deadlines(sched), self.predictor, self.options.chunk_tokens
        current, later = [], []
        for r in batch:
            item = dl.item(r)
            this_pass = item.new if cap is None else min(item.new, cap)
            current.append(PrefillItem(this_pass, item.reused))
            if item.new > this_pass:
                later.append(PrefillItem(item.new - this_pass, item.reused + this_pass))
        done = min(r.prefill_layer for r in batch) / p.num_layers
        return p.prefill_ms(current, sms) * (1 - done), p.prefill_ms(later, sms) if later else 0.0

    @staticmethod
    def spares(dl: Deadlines, batch: list[Request], now: float, own: float, remaining: float) -> bool:
        """Whether a batch with `remaining` seconds of prefill left can wait `own` seconds: no member that would meet
        the contract's deadline without the wait misses its planned deadline with it. A member late by the contract
        either way does not count; one late only by the controller's tighter plan does (judged by the plan alone, a
        tight TTFT controller would count most long members late and let short prompts pause them again and
        again)."""
        return not any(now + remaining <= dl.deadline(r, planned=False) and now + own + remaining > dl.deadline(r)
                       for r in batch)

    def admit(self, sched: Scheduler, r: Request, reserve: int | None = None) -> bool:
        """Admit `r` only when the pool keeps room for every running request to grow by its remaining output (up
        to `growth_tokens`): a decode request preempted for pages would stall for a whole recomputation. reserve:
        `reserve(sched)` where the caller has it (a loop over the queue sums the running requests once)."""
        pool, horizon = sched.pool, self.options.growth_tokens
        reserve = self.reserve(sched) if reserve is None else reserve
        hit = self.deadlines(sched).item(r).reused // pool.page_size
        need = pool.pages_for(r.num_tokens + min(r.sampling.max_tokens, horizon)) - hit
        return pool.num_free_pages - need >= reserve and sched.admit(r)

    def growth(self, sched: Scheduler, q: Request) -> int:
        """Pages running request q may still take: for its remaining output, up to `growth_tokens`."""
        more = min(q.sampling.max_tokens - len(q.output_token_ids), self.options.growth_tokens)
        return max(0, sched.pool.pages_for(q.num_tokens + more) - len(q.page_table.pages))

    def reserve(self, sched: Scheduler) -> int:
        """Pages the running requests may still take (`growth` summed)."""
        return sum(self.growth(sched, q) for q in sched.prefilling) + sum(self.growth(sched, q) for q in sched.decoding)

    def order(self, sched: Scheduler, now: float) -> list[Request]:
        """Waiting prompts in serve order (by class priority, then reordered by predicted time: deadlines.py)."""
        dl = self.deadlines(sched)
        waiting = list(sched.waiting)
        if not self.options.reorder:
            return sorted(waiting, key=lambda r: dl.slo(r).priority)
        costs: dict[str, float] = {}
        deadlines: dict[str, float] = {}

        def cost(r: Request) -> float:
            if r.request_id not in costs:
                costs[r.request_id] = self.predictor.prefill_ms([dl.item(r)], self.prefill_sms) / 1e3
            return costs[r.request_id]

        def deadline(r: Request) -> float:
            if r.request_id not in deadlines:
                deadlines[r.request_id] = dl.deadline(r)
            return deadlines[r.request_id]

        return reorder(waiting, now, cost, deadline, lambda r: dl.slo(r).priority,
                       lambda r: dl.deadline(r, planned=False))

    def tidy(self, sched: Scheduler) -> None:
        """Forget batch members that left prefill (finished, aborted, preempted for pages) or have every layer of
        their last pass launched (its last layers are in flight; the next batch may start behind them). A member
        with prompt tokens left after the pass it launched stays: its next pass follows at once (a long prompt
        keeps the prefill lane from pass to pass as it would in one; a more urgent prompt still pauses it)."""
        def live(rid: str) -> bool:
            r = sched.requests.get(rid)
            return r is not None and r.status is RequestStatus.PREFILLING

        self.paused = [rid for rid in self.paused if live(rid)]
        self.chunked = {rid for rid in self.chunked if live(rid)}
        self.batch = [rid for rid in self.batch
                      if live(rid) and sched.pass_layer(sched.requests[rid]) < self.predictor.num_layers]
        if not self.batch and self.paused:
            self.batch, self.paused = self.paused, []
        if not self.batch:  # prompts between passes, or admitted by another planner before this one: adopt those
            # at the first one's layer while their tokens fit the batch's budget (a pass's activations stay within
            # what the engine sized its memory for; the rest follow in later batches)
            pending = [(r, layer) for r, layer in sched.pending_prefills() if r.request_id not in self.paused]
            tokens = 0
            for r, layer in pending:
                new = r.num_tokens - r.num_computed_tokens
                if layer != pending[0][1] or (self.batch and tokens + new > self.options.max_prefill_tokens):
                    continue
                self.batch.append(r.request_id)
                tokens += new

    def wait_before(self, sched: Scheduler, request: Request, own: float) -> float:
        """Seconds `request` (whose own prefill takes `own` seconds) would wait for the GPU's prefill: what the
        running batch (and a paused one) still has to compute, then the prompts queued ahead of it."""
        dl, p = self.deadlines(sched), self.predictor
        now, sms = sched.clock(), self.prefill_sms
        prio, deadline = dl.slo(request).priority, dl.deadline(request)
        wait = 0.0
        for group in (self.batch, self.paused):  # what the running (and a paused) batch still has to compute
            batch = [sched.requests[rid] for rid in group if rid in sched.requests]
            if batch:
                current, later = self.left_ms(sched, batch, sms)
                remaining = current + later
                # a short prompt that would miss its deadline behind the running batch pauses it when the batch
                # keeps its own deadlines (as maybe_pause decides): it then waits for no more than a layer of it
                done = min(r.prefill_layer for r in batch)
                started = done > 0 or any(r.request_id in sched.inflight for r in batch)
                if (group is self.batch and self.options.prefill_pause and not self.paused and started
                        and own * 1e3 < remaining and now + remaining / 1e3 + own > deadline
                        and self.spares(dl, batch, now, own, remaining / 1e3)):
                    remaining = current / max(1, p.num_layers - done)
                wait += remaining
        # the prompts queued ahead of it (a higher priority, or its own with an earlier deadline when the planner
        # reorders by deadline, else arrived earlier), prefilled together in batches as `start` forms them
        ahead = [r for r in sched.waiting if dl.slo(r).priority < prio or (dl.slo(r).priority == prio and (
            dl.deadline(r) <= deadline if self.options.reorder else True))]
        batch, tokens = [], 0
        for r in ahead:
            item = dl.item(r)
            if batch and tokens + item.new > self.options.max_prefill_tokens:
                wait += p.prefill_ms(batch, sms)
                batch, tokens = [], 0
            batch.append(item)
            tokens += item.new
        wait = (wait + (p.prefill_ms(batch, sms) if batch else 0.0)) / 1e3
        return wait
