"""Engine: validates and admits requests, and runs steps (plan -> launch -> read the previous step's tokens ->
update -> detokenize -> outputs).

The loop is overlapped (`--async-scheduling`, on by default): the host plans and launches step N+1 while the device
runs step N, then reads step N's tokens, so the host's work between steps hides behind the device's. A request whose
latest token is not read yet decodes from it on the device (engine/launched.py); one that finishes at step N had at
most one more step launched, whose token is dropped. A row whose sample needs its latest token on the host (a
grammar's next mask, a bad word of several tokens, a think block's budget near its end: `Request.needs_output_now`;
a penalty's counts stay on the device) has its step's forward launched first and is sampled once step N is read
(Executor.finish_sampling). With it off, every step is read before the next is planned.

Single-threaded; `AsyncEngine` (async_engine.py) drives it from a background thread for the server. The synchronous
`generate` is the small Python API for scripts and tests. `engine/factory.py` builds one (`build_engine`); the
constructor only wires the parts together.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from appliance.config import Config
from appliance.engine.admission import Admission
from appliance.engine.detokenizer import Detokenizer
from appliance.engine.executor import Executor
from appliance.engine.grammar import GrammarCompiler
from appliance.engine.kv_cache import KVCache, PagePool
from appliance.engine.launched import LaunchedStep, prefill_launches
from appliance.engine.plan import StepPlan
from appliance.engine.request import Request, RequestOutput, SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.model_zoo.llama import DecoderForCausalLM
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.predictor.predictor import Predictor
from appliance.predictor.shapes import DecodeLoad, decode_load, prefill_items
from appliance.slo.contract import Contract

log = logging.getLogger("muxd.engine")


@dataclass
class Completion:
    """Result of the synchronous API for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int


class Engine:
    """The parts of a serving engine, built by `build_engine`: model, tokenizer, KV cache and page pool, scheduler
    (with its planner), executor, and the contract and predictor the planner uses."""

    def __init__(self, config: Config, model: DecoderForCausalLM, tokenizer: Tokenizer | None, kv_cache: KVCache,
                 pool: PagePool, scheduler: Scheduler, executor: Executor, contract: Contract,
                 predictor: Predictor | None, max_model_len: int) -> None:
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.kv_cache, self.pool, self.scheduler, self.executor = kv_cache, pool, scheduler, executor
        self.runner, self.partitions = executor.runner, executor.partitions
        self.contract, self.predictor, self.max_model_len = contract, predictor, max_model_len
        self.admission = Admission(self)
        self.startup: dict[str, float] = {}  # what build_engine measured and decided while starting
        self.compiled = False
        self.max_graph_batch = 0  # largest decode batch captured as a CUDA graph
        self.prefill_graph_rows = 0  # prefill launches of up to this many tokens replay piecewise graphs
        self.eos_token_ids = set(tokenizer.eos_token_ids if tokenizer else model.config.eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, sorted(self.eos_token_ids)) \
            if tokenizer is not None else None
        self._detok: dict[str, Detokenizer] = {}
        self._counter = itertools.count()
        self._prefills_mark = 0  # the executor's prefill launches already handed to the planner
        self.num_preemptions = 0
        self.async_scheduling = config.runtime.async_scheduling  # plan step N+1 while step N runs
        self._launched: LaunchedStep | None = None  # the step whose tokens the next step() reads
        self._eager: set[str] = set()  # requests whose next sample needs their latest token on the host
        self._deferred: list = []  # finished prefill works merged by the next step (see _defer)
        self._step_s = 0.0  # the host time of the latest step() call

    # ---- requests ---------------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, add_special_tokens: bool = True) -> Request:
        """Tokenize and validate; raises RequestError naming the bad field. Touches no engine state."""
        return self.admission.make_request(prompt, params, request_id, add_special_tokens)

    def next_request_id(self) -> str:
        return f"req-{next(self._counter)}"

    def slo_class(self, name: str | None) -> str | None:
        return self.admission.slo_class(name)

    def submit(self, request: Request) -> str:
        """Queue a validated request, after the admission checks (engine/admission.py)."""
        self.admission.check(request)
        if self.tokenizer is not None:
            sampling = request.sampling
            self._detok[request.request_id] = Detokenizer(self.tokenizer, request.prompt_token_ids, sampling.stop,
                                                          sampling.include_stop_str, sampling.skip_special_tokens)
        if request.reads_output:
            self._eager.add(request.request_id)
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self.submit(self.make_request(prompt, params, request_id))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free all its pages now; False if it is not (or no longer) here.

        Kernels already launched for it run to their end first, so its pages never go to another request while
        they may still be written."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self.executor.settle(request_id)
        self.scheduler.finish(request, "abort", aborted=True)  # the next plan releases its executor state
        self._forget(request_id)
        self._release_if_idle()
        return True

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._eager.discard(request_id)

    def _release_if_idle(self) -> None:
        """With nothing left to run there is no next plan: read the step still running (its tokens all belong to
        requests that left) and release the state of who left now, and the allocator's unused blocks where they
        exceed the memory budget (memory_guard.py)."""
        if not self.scheduler.has_work():
            if self._launched is not None:
                step, self._launched = self._launched, None
                self._process(step)
            self.executor.release(self.scheduler.released())
            self.executor.idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def free_device_memory(self) -> None:
        """Give back the KV cache and the captured graphs; the model and tokenizer stay loaded. After a failed step,
        before a new engine is built around the same weights (engine/supervisor.py); this one serves no more."""
        self._launched = None
        self.executor.drop_graphs()
        self.kv_cache.data = self.kv_cache.data.new_empty(0)

    # ---- steps ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: merge prefills that finished, plan and launch a step, then read the tokens of the step
        launched before it (overlapped: while this one runs) and of this one in the synchronous loop. A row whose
        sampling needs the token before it on the host (a grammar's mask, a penalty) is sampled once that token is
        read, while the step's forward runs. With nothing to launch, wait for in-flight prefill."""
        began = time.monotonic()
        done, self._deferred = self._deferred + self.executor.poll(), []
        outputs = self._merge(done)
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        previous, self._launched = self._launched, None
        launched = self.executor.start(plan, self.scheduler.requests,
                                       hold_sampling=previous is not None and self._needs_tokens(previous, plan))
        if self.executor.last_launch_ms is not None:  # the host time of this step's prefill launches
            groups = prefill_launches(plan)
            self.scheduler.planner.observe_launch(len(groups), sum(end - start for (start, end), _ in groups),
                                                  self.executor.last_launch_ms, self.executor.last_launch_graphs)
        if not plan.empty:
            if (plan.mixed and plan.prefill) or launched.beside:  # (what the planner learns from: see _observe)
                launched.load = decode_load(self.scheduler.requests, plan.decode)
            self.scheduler.launched(plan, launched.completed, launched.row_of())
        if previous is not None:
            outputs += self._process(previous)
        if launched.held is not None:
            self.executor.finish_sampling(launched)
        if not plan.empty:
            if launched.rows and self.async_scheduling and self.executor.overlaps:
                self._launched = launched
            else:
                outputs += self._process(launched)
        elif previous is None:
            if self.executor.has_inflight():
                self.executor.wait()
                outputs += self._merge(self.executor.poll())
                self._release_if_idle()
                return outputs
            if self.scheduler.has_work() and not outputs:
                raise RuntimeError(f"planner {self.scheduler.planner.name!r} planned nothing with "
                                   f"{len(self.scheduler.requests)} requests pending")
            return outputs
        outputs += self._merge(self._defer(self.executor.poll()))
        self._release_if_idle()
        self._step_s = time.monotonic() - began
        return outputs

    def _defer(self, done: list) -> list:
        """Prefill works found finished after this step was launched, less those left to the next step. With a step
        in flight (the overlapped loop) a prompt's first token reported now would be followed by its second two steps
        later (its row can join the step after the one just launched only), which the contract counts as one long
        gap between tokens. Such a work is merged by the next step instead: its first token goes out with that
        step's outputs, one step before its second, unless waiting that step would make its first token late."""
        if self._launched is None or not done:
            return done
        now, merge = self.scheduler.clock(), []
        for entry in done:
            work, token = entry[0], entry[1]
            r = self.scheduler.requests.get(work.request_id)
            first = token is not None and r is not None and not r.output_token_ids
            if first and now + self._step_s <= self._ttft_due(r):
                self._deferred.append(entry)
            else:
                merge.append(entry)
        return merge

    def _ttft_due(self, r: Request) -> float:
        """When the contract wants the request's first token (on the scheduler's clock)."""
        return r.arrival_time + self.contract.slo_for(r.slo_class).ttft_target_ms(r.num_uncached_prompt_tokens) / 1e3

    def _needs_tokens(self, previous: LaunchedStep, plan: StepPlan) -> bool:
        """The plan samples a row whose logits processing needs its token of the step before, still on the device
        (a grammar's next mask, a bad word's last token, a think block's budget near its end)."""
        if not self._eager:
            return False
        rows, requests = set(previous.rows), self.scheduler.requests
        return any(rid in self._eager and rid in rows and requests[rid].needs_output_now for rid in plan.decode)

    def _process(self, step: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens and report them; the token of a request that left since it was launched
        (finished at the step before, aborted) is dropped."""
        tokens = self.executor.collect(step)
        self._observe(step.plan, step.load)
        requests = self.scheduler.requests
        rows = [(r, token, end) for r, token, end in zip(step.requests, tokens, step.ends)
                if requests.get(r.request_id) is r]
        self.scheduler.accept(rows)
        return [self._output(r, token, step.logprobs.get(r.request_id)) for r, token, _ in rows]

    def _observe(self, plan: StepPlan, load: DecodeLoad | None = None) -> None:
        """Hand a decode step that ran beside prefill layers, prefill layers that ran on a partition beside decode or
        on all SMs after it, and a mixed step, to the planner (online refinement of its contention models); `load`:
        the decode batch's as launched (default: as it is now)."""
        planner = self.scheduler.planner

        def batch() -> DecodeLoad:
            return load if load is not None else decode_load(self.scheduler.requests, plan.decode)

        finished, self._prefills_mark = self.executor.prefills_since(self._prefills_mark)
        for obs in finished:
            if obs.beside_decode:  # (on all SMs nothing runs beside it: the predictor keeps to partitions)
                planner.observe_prefill(prefill_items(obs.works), obs.layers, obs.prefill_sms, obs.ms)
        mixed_ms = self.executor.last_mixed_ms
        if plan.mixed and plan.prefill and mixed_ms is not None:
            planner.observe_mixed(prefill_items(plan.prefill), batch(), mixed_ms)
        after_ms = self.executor.last_after_ms
        if plan.prefill_after_decode and plan.prefill and after_ms is not None:
            first = plan.prefill[0]
            planner.observe_full(prefill_items(plan.prefill), first.layer_end - first.layer_start, after_ms)
        seen = self.executor.last_decode
        if seen is not None and seen.concurrent:
            planner.observe_decode(batch(), seen.decode_sms, prefill_items(seen.concurrent), seen.ms)

    def _merge(self, done: list) -> list[RequestOutput]:
        """Record prefill works whose layers have all run; a prompt's last chunk brings its first token."""
        return [self._output(r, token, entry) for work, tok, entry in done
                for r, token in self.scheduler.complete_prefill(work, tok)]

    def _output(self, r: Request, token: int, logprob_entry: tuple | None = None) -> RequestOutput:
        """Report a token the host has just read: log-probabilities, the grammar's matcher, detokenization, stop
        conditions (the request finishes here, its pages freed at once)."""
        sp = r.sampling
        detok = self._detok.get(r.request_id)
        runner = self.runner
        logprob = logprob_entry[0].get(logprob_entry[1]) if logprob_entry is not None else None
        num_prompt, num_output = len(r.prompt_token_ids), len(r.output_token_ids)
        prompt_logprobs = runner.take_prompt_logprobs(r.request_id, num_prompt) \
            if sp.prompt_logprobs is not None and num_output == 1 else None
        # the grammar allowed only this token or a stop token; a complete output ends here whatever ignore_eos says
        grammar_done = r.matcher is not None and (not r.matcher.accept(token) or r.matcher.terminated)
        eos = not sp.ignore_eos and token in self.eos_token_ids
        stop_token = grammar_done or token in sp.stop_token_ids or eos
        stop_string = detok.push(token, visible=not stop_token) if detok else False
        reason, stop_reason = None, None
        if stop_token or stop_string:  # what ended it, as vLLM's stop_reason: a stop token or string, not EOS
            reason = "stop"
            stop_reason = detok.matched if stop_string else token if not (eos or grammar_done) else None
        elif num_output >= sp.max_tokens or num_prompt + num_output >= self.max_model_len:
            reason = "length"
        text = ""
        if detok:
            if reason and not stop_string:
                detok.flush()
            text = detok.delta(finished=reason is not None)
        if reason:
            self.scheduler.finish(r, reason)
            self._forget(r.request_id)
        return RequestOutput(
            request_id=r.request_id, new_token_ids=[token], new_text=text, finished=reason is not None,
            finish_reason=reason, num_prompt_tokens=num_prompt, num_cached_tokens=r.num_cached_tokens or 0,
            num_output_tokens=num_output, text=detok.text if (detok and reason) else None,
            logprobs=[logprob] if logprob is not None else None, prompt_logprobs=prompt_logprobs,
            stop_reason=stop_reason,
            queued_s=max(0.0, r.scheduled_time - r.arrival_time) if reason and r.scheduled_time is not None else None)

    # ---- lifetime ---------------------------------------------------------------------------------------------
    def on_fatal(self, callback) -> None:
        """Have `callback(error)` called, from another thread, when the engine can no longer run (a rank of a
        tensor-parallel engine died); steps raise RankError from then on."""
        self.executor.on_fatal(callback)

    def close(self) -> None:
        """Stop the processes the engine started (the other ranks of a tensor-parallel engine)."""
        self.executor.close()

    # ---- synchronous API --------------------------------------------------------------------------------------
    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts to completion (continuously batched) and return them in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, plist)]
        for r in requests:
            self.submit(r)
        texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
        while any(not r.status.done for r in requests):
            for out in self.step():
                if out.request_id in texts:  # other requests may be in flight too
                    texts[out.request_id].append(out.new_text)
        return [Completion(r.request_id, r.prompt_token_ids, list(r.output_token_ids), "".join(texts[r.request_id]),
                           r.finish_reason, r.num_cached_tokens or 0) for r in requests]
