"""The overlapped step loop (`--async-scheduling`) against the synchronous one on the CPU engine: the same code path
runs (a step's tokens are read one engine step later, the next step decodes from placeholders), and every request's
outputs are the same token for token — across policies, with stop tokens and strings, max_tokens ending at every
step, aborts at every step, preemption under a small KV cache, logprobs, seeds and n > 1, grammars and penalties
(read at once) — and no page is left behind."""
from __future__ import annotations

import json
import math
from typing import Callable

import pytest
import torch
from spies import step_through

from appliance.config import Config
from appliance.engine.batch import placeholder, resolve, span_tokens
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.grammar import GrammarSpec
from appliance.engine.plan import PrefillWork
from appliance.engine.request import Request, SamplingParams, ThinkingLimit
from appliance.engine.steplog import StepLog

POLICIES = [("serial", {}), ("chunked", {"chunk_budget": 12}), ("layerwise", {}), ("mux", {}), ("pdmux", {})]


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def engine_for(path, overlap: bool, **kw) -> Engine:
    kw.setdefault("num_gpu_blocks_override", 64)
    return build_engine(Config.flat(model=path, async_scheduling=overlap, **kw))


def drive(engine: Engine, arrivals: dict[int, list[Request]],
          aborts: dict[int, list[str]] | None = None) -> dict[str, list[tuple]]:
    """Step the engine, submitting `arrivals[k]` and aborting `aborts[k]` before engine step k; every request's
    outputs as (token ids, finished, reason, logprobs)."""
    def record(o) -> tuple:
        lps = tuple((lp.token_id, lp.logprob, lp.rank, tuple(lp.top)) for lp in o.logprobs) if o.logprobs else None
        return tuple(o.new_token_ids), o.finished, o.finish_reason, o.text, lps

    outs = step_through(engine, arrivals, aborts, record)
    assert_clean(engine)
    return outs


def same(a, b) -> bool:
    """Outputs equal, log-probabilities within 1e-4: a batch of another shape may round the last bits differently
    (rounding both to 5 decimals still differs where a value sits on a rounding boundary)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=0.0, abs_tol=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_clean(engine: Engine) -> None:
    assert not engine.scheduler.requests and engine._launched is None
    assert engine.pool.num_free_pages == engine.pool.num_pages
    assert not engine.runner.batches._mirrors and not engine.executor.has_inflight()
    assert not engine.runner.penalties._slot  # every penalised request's row given back


def both(path, make: Callable[[Engine], dict[int, list[Request]]], aborts=None, **kw):
    """(synchronous, overlapped) outputs of the same arrivals. The overlapped engine must have overlapped: read steps
    after launching the next, whose inputs held placeholders; `dropped` counts the tokens it dropped (of requests that
    had finished or were aborted by then)."""
    results = []
    for overlap in (False, True):
        engine = engine_for(path, overlap, **kw)
        seen, placeholders, accepted = [], [], []
        collect, to_device, accept = engine.executor.collect, engine.runner.batches.to_device, engine.scheduler.accept
        engine.executor.collect = lambda step: seen.append(step) or collect(step)

        def spy(host, to_device=to_device, placeholders=placeholders):
            batch = to_device(host)
            placeholders.append(batch.placeholders)
            return batch

        engine.runner.batches.to_device = spy
        engine.scheduler.accept = lambda rows: accepted.append(len(rows)) or accept(rows)
        results.append(drive(engine, make(engine), aborts))
        assert any(s.overlapped for s in seen) == overlap, "a step was read after the next one was launched"
        assert not overlap or any(placeholders) or engine.runner.graphs is not None
        both.dropped = sum(len(s.rows) for s in seen) - sum(accepted)
    return results


@pytest.fixture(scope="module")
def stop_token(llama_checkpoint) -> tuple[int, int]:
    """(token, n): a token of the greedy output after prompt(2, 9) that first appears as its n-th token (n >= 3):
    as a stop token it ends that request there."""
    path, _ = llama_checkpoint
    greedy = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    tokens = engine_for(path, False).generate(prompt(2, 9), greedy)[0].token_ids
    n = next(i for i in range(2, 9) if tokens[i] not in tokens[:i])
    return tokens[n], n + 1


def mixed_requests(stop: tuple[int, int]) -> Callable[[Engine], dict[int, list[Request]]]:
    """Greedy, seeded, logprobs, a stop token, min_tokens, an n=3 group sharing a prompt, staggered arrivals."""
    def make(engine: Engine) -> dict[int, list[Request]]:
        greedy = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
        stopped = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, stop_token_ids=[stop[0]])
        shared = prompt(7, 21)
        specs = [
            (prompt(3, 33), SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)),
            (prompt(4, 17), SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)),
            (prompt(5, 25), SamplingParams(max_tokens=8, temperature=1.2, seed=5, logprobs=0, min_tokens=3)),
        ] + [(shared, SamplingParams(max_tokens=5, temperature=1.0, seed=100 + i, ignore_eos=True)) for i in range(3)]
        first = [engine.make_request(prompt(1, 40), greedy), engine.make_request(prompt(2, 9), stopped)]
        later = [engine.make_request(p, sp) for p, sp in specs]
        return {0: first, 3: later[:3], 5: later[3:]}
    return make


@pytest.mark.parametrize("policy, extra", POLICIES)
def test_overlapped_equals_synchronous_across_policies(llama_checkpoint, stop_token, policy, extra):
    path, _ = llama_checkpoint
    sync, overlapped = both(path, mixed_requests(stop_token), policy=policy, **extra)
    assert same(overlapped, sync), (overlapped, sync)
    stopped = sync["req-1"]
    assert stopped[-1][2] == "stop" and len(stopped) == stop_token[1]


def test_max_tokens_ending_at_every_step(llama_checkpoint):
    path, _ = llama_checkpoint

    def make(engine):
        return {0: [engine.make_request(prompt(20 + n, 11 + n), SamplingParams(max_tokens=n, temperature=0,
                                                                              ignore_eos=True))
                    for n in range(1, 10)]}

    sync, overlapped = both(path, make)
    assert same(overlapped, sync), (overlapped, sync)
    assert sorted(sum(len(o[0]) for o in outs) for outs in sync.values()) == list(range(1, 10))


def test_stop_strings_and_eos(text_checkpoint):
    """Stop strings that end the output at different tokens, and the model's EOS, end it at the same token."""
    probe = engine_for(text_checkpoint, False, max_model_len=256)
    text = probe.generate("The quick brown fox", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].text
    cuts = sorted({text[i:i + 3] for i in range(2, len(text) - 3, 4) if text[i:i + 3].strip()})[:6]
    assert cuts

    def make(engine):
        reqs = [engine.make_request("The quick brown fox", SamplingParams(max_tokens=30, temperature=0, stop=[c]))
                for c in cuts]
        reqs.append(engine.make_request("Hello, world", SamplingParams(max_tokens=30, temperature=0)))  # EOS counts
        return {0: reqs}

    sync, overlapped = both(text_checkpoint, make, max_model_len=256)
    assert same(overlapped, sync), (overlapped, sync)
    assert sum(outs[-1][2] == "stop" for outs in sync.values()) >= len(cuts)
    assert both.dropped >= 1  # the tokens of the step launched before a stop was read


def test_aborts_at_every_step(llama_checkpoint):
    """Aborting one request before any engine step: the others are unchanged, and what the aborted one got is a
    prefix of its whole output (the overlapped loop reports each token a step later)."""
    path, _ = llama_checkpoint
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True)]

    def make(engine):
        return {0: [engine.make_request(prompt(30 + i, 14 + 5 * i), params[i % 2], f"r{i}") for i in range(4)]}

    engines = {overlap: engine_for(path, overlap, policy="layerwise") for overlap in (False, True)}
    pending = []  # the aborted request's tokens still on the device when the overlapped engine aborted it
    abort = engines[True].abort
    engines[True].abort = lambda rid: pending.append(
        getattr(engines[True].scheduler.requests.get(rid), "num_pending", 0)) or abort(rid)
    full = drive(engines[False], make(engines[False]))
    for k in range(14):
        for overlap, engine in engines.items():
            got = drive(engine, make(engine), {k: ["r1"]})
            assert {rid: outs for rid, outs in got.items() if rid != "r1"} == \
                {rid: outs for rid, outs in full.items() if rid != "r1"}, (k, overlap)
            tokens = [t for o in got.get("r1", []) for t in o[0]]
            assert tokens == [t for o in full["r1"] for t in o[0]][:len(tokens)], (k, overlap)
    assert any(pending)


def test_preemption_under_a_small_kv_cache(llama_checkpoint):
    """Twelve pages for eight requests of 3-5 pages: preemption, also of requests whose latest token is still on the
    device; every output equals the synchronous loop's (and the solo runs')."""
    path, _ = llama_checkpoint
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(8)]
    pending = []

    def make(engine):
        inner = engine.scheduler.preempt
        engine.scheduler.preempt = lambda r: (pending.append(r.num_pending), inner(r))[1]
        return {0: [engine.make_request(prompt(10 + i, 18 + 3 * i), params[i]) for i in range(8)]}

    sync, overlapped = both(path, make, num_gpu_blocks_override=12, enable_prefix_caching=False)
    assert same(overlapped, sync), (overlapped, sync)
    assert any(pending) and len(pending) >= 2  # preempted at all, and once with a pending token
    solo = engine_for(path, True)
    for i in range(0, 8, 2):
        assert [t for o in sync[f"req-{i}"] for t in o[0]] == \
            solo.generate(prompt(10 + i, 18 + 3 * i), params[i])[0].token_ids


def test_grammar_and_penalties_sample_once_the_token_before_is_read(text_checkpoint):
    """A grammar's matcher needs the latest token before the next sample: the next step's forward is launched first
    and its rows (a penalised one beside it too) sampled once that token is read (the loop still overlaps); outputs
    equal the synchronous loop's."""
    pytest.importorskip("xgrammar")
    read_at_once, held = [], []

    def make(engine):
        collect, finish = engine.executor.collect, engine.executor.finish_sampling
        engine.executor.collect = lambda step: read_at_once.append(
            ("r-json" in step.rows or "r-pen" in step.rows, step.overlapped)) or collect(step)
        engine.executor.finish_sampling = lambda step: held.append(tuple(step.held.ids)) or finish(step)
        plain = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)  # (it runs on alone, overlapped)
        return {0: [engine.make_request("Hello, world", plain, "r-plain"),
                    engine.make_request("Tell me", SamplingParams(max_tokens=12, temperature=0,
                                                                  grammar=GrammarSpec("json_object")), "r-json")],
                2: [engine.make_request("The quick", SamplingParams(max_tokens=10, temperature=0.9, seed=4,
                                                                    presence_penalty=1.5, frequency_penalty=0.5,
                                                                    repetition_penalty=1.3), "r-pen")]}

    sync, overlapped = both(text_checkpoint, make, max_model_len=256)
    assert same(overlapped, sync), (overlapped, sync)
    overlapping = read_at_once[len(read_at_once) // 2:]  # (the second half: the overlapped engine's)
    assert any(constrained and over for constrained, over in overlapping)
    assert any("r-json" in ids for ids in held) and any("r-pen" in ids for ids in held)


def test_penalised_rows_are_never_held_and_survive_preemption(llama_checkpoint):
    """A penalty's token counts live on the device, so penalised rows sample without their latest token on the host:
    the overlapped loop holds no sampling for them. Under a small KV cache they are preempted (their counts given back
    and counted again from the host's lists when they resume); every output equals the synchronous loop's and, for
    some, their runs alone."""
    path, _ = llama_checkpoint
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.4),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True, frequency_penalty=0.9),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, presence_penalty=1.2,
                             repetition_penalty=0.7),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    held, preempted = [], []

    def make(engine):
        finish, inner = engine.executor.finish_sampling, engine.scheduler.preempt
        engine.executor.finish_sampling = lambda step: held.append(step) or finish(step)
        engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), inner(r))[1]
        return {0: [engine.make_request(prompt(10 + i, 18 + 3 * i), params[i % 4], f"r{i}") for i in range(8)]}

    sync, overlapped = both(path, make, num_gpu_blocks_override=12, enable_prefix_caching=False)
    assert same(overlapped, sync), (overlapped, sync)
    assert not held and preempted
    solo = engine_for(path, True)
    for i in (0, 2):
        assert [t for o in sync[f"r{i}"] for t in o[0]] == \
            solo.generate(prompt(10 + i, 18 + 3 * i), params[i])[0].token_ids
    free = engine_for(path, True)  # the penalties change the output at all
    assert free.generate(prompt(10, 18), params[3])[0].token_ids != [t for o in sync["r0"] for t in o[0]]


def test_a_think_blocks_budget_holds_sampling_only_near_its_end(llama_checkpoint):
    """A think block's budget forces its end only once the block has spent it: the overlapped loop samples such a row
    without its latest token on the host until that may happen (the few steps around the budget's end, and each
    forced token), and its output equals the synchronous loop's: the end forced at the budget (one token and a
    two-token end), a block opened by its start sequence, a budget of none."""
    path, _ = llama_checkpoint
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    free = engine_for(path, True).generate(prompt(5, 20), SamplingParams(**greedy))[0].token_ids
    spare = [t for t in range(3, 250) if t not in free][:2]
    limits = [ThinkingLimit(8, (), (spare[0],), inside=True), ThinkingLimit(6, (), tuple(spare), inside=True),
              ThinkingLimit(4, tuple(free[2:4]), (spare[1],)), ThinkingLimit(0, (), (spare[0],), inside=True)]
    held: list[set[str]] = []

    def make(engine):
        finish = engine.executor.finish_sampling
        engine.executor.finish_sampling = lambda step: held.append(set(step.held.ids)) or finish(step)
        return {0: [engine.make_request(prompt(5, 20), SamplingParams(**greedy, thinking=lim), f"t{i}")
                    for i, lim in enumerate(limits)]}

    sync, overlapped = both(path, make)
    assert same(overlapped, sync), (overlapped, sync)
    tokens = {rid: [t for o in outs for t in o[0]] for rid, outs in sync.items()}
    assert tokens["t0"][:9] == free[:8] + [spare[0]] and tokens["t1"][6:8] == spare
    assert tokens["t2"][:4] == free[:4] and tokens["t2"][8] == spare[1]  # opened after free[2:4], 4 tokens inside
    assert tokens["t3"][0] == spare[0]
    assert 0 < len(held) < 24 - 8  # held near each budget's end, not at every step the block was open


def test_held_sampling_with_aborts_and_grammar_ends_at_every_step(text_checkpoint):
    """A constrained and a penalised request aborted before each engine step in turn, and a short grammar ending at
    a step whose next forward is already launched: the others are unchanged, the aborted ones got a prefix of their
    output, and no page or state is left behind (drive checks)."""
    pytest.importorskip("xgrammar")

    def make(engine):
        return {0: [engine.make_request("Tell me", SamplingParams(max_tokens=10, temperature=0,
                                                                  grammar=GrammarSpec("json_object")), "r-json"),
                    engine.make_request("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                        "r-plain"),
                    engine.make_request("Say", SamplingParams(max_tokens=40, temperature=0,
                                                              grammar=GrammarSpec("json_schema", json.dumps(
                                                                  {"type": "boolean"}))), "r-bool")],
                1: [engine.make_request("The quick", SamplingParams(max_tokens=9, temperature=0.9, seed=4,
                                                                    presence_penalty=1.5, min_tokens=3), "r-pen")]}

    engines = {overlap: engine_for(text_checkpoint, overlap, max_model_len=256) for overlap in (False, True)}
    ended = []  # held rows whose grammar had ended by the time they were sampled
    finish = engines[True].executor.finish_sampling
    engines[True].executor.finish_sampling = lambda step: ended.append(any(
        r.matcher is not None and r.matcher.terminated for r in step.held.requests.values())) or finish(step)
    full = drive(engines[False], make(engines[False]))
    assert full["r-bool"][-1][2] == "stop" and sum(len(o[0]) for o in full["r-bool"]) < 40  # the grammar ended it
    for k in range(12):
        for overlap, engine in engines.items():
            got = drive(engine, make(engine), {k: ["r-json", "r-pen"]})
            assert {rid: v for rid, v in got.items() if rid in ("r-plain", "r-bool")} == \
                {rid: v for rid, v in full.items() if rid in ("r-plain", "r-bool")}, (k, overlap)
            for rid in ("r-json", "r-pen"):
                tokens = [t for o in got.get(rid, []) for t in o[0]]
                assert tokens == [t for o in full[rid] for t in o[0]][:len(tokens)], (k, overlap, rid)
    assert any(ended) and not all(ended)


def test_a_grammar_after_thinking_frees_the_output_until_its_end(text_checkpoint):
    """A grammar waiting for the end of a think block (`GrammarSpec.after`) masks nothing until the output has
    written those tokens, then holds: the output is the free one up to them, then a boolean; in both loops."""
    pytest.importorskip("xgrammar")
    engine = engine_for(text_checkpoint, False, max_model_len=256)
    free = engine.generate(["Tell me"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    end = tuple(free[2:4])  # what the free output writes at its third and fourth tokens stands for </think>
    boolean = GrammarSpec("json_schema", json.dumps({"type": "boolean"}), after=end)

    def make(engine):
        return {0: [engine.make_request("Tell me", SamplingParams(max_tokens=30, temperature=0, grammar=boolean),
                                        "r-think")]}

    sync, overlapped = both(text_checkpoint, make, max_model_len=256)
    assert same(overlapped, sync), (overlapped, sync)
    tokens = [t for o in sync["r-think"] for t in o[0]]
    assert tokens[:4] == list(free[:4]) and sync["r-think"][-1][2] == "stop"
    assert engine.tokenizer.decode(tokens[4:]).strip() in ("true", "false")


def test_a_pending_token_is_a_placeholder_read_on_the_device():
    r = Request("r", [5, 6, 7], SamplingParams())
    r.output_token_ids = [8]
    r.num_pending, r.pending_row = 1, 2
    assert r.num_tokens == 5 and r.num_output_tokens == 2
    assert span_tokens(r, 2, 5) == [7, 8, placeholder(2)]
    buffer = torch.tensor([40, 41, 42, 43])
    assert resolve(torch.tensor([7, placeholder(2), placeholder(0)]), buffer).tolist() == [7, 42, 40]
    r.num_pending = 2  # only the latest step's token can be read on the device
    with pytest.raises(RuntimeError, match="not known on the host"):
        span_tokens(r, 4, 6)


def test_the_step_log_records_wall_and_device_time(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = engine_for(path, True, policy="serial")
    log = StepLog(engine).attach()
    for n in (12, 30, 7):
        engine.add_request(prompt(n, n), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    log.detach()
    decode = [s for s in log.steps if s["decode"]]
    assert decode and all(s["launch_ms"] > 0 and s["device_ms"] is None for s in decode)  # (no device on a CPU)
    assert any(s["overlapped"] for s in decode)
    assert_clean(engine)


def test_a_first_token_found_after_the_launch_waits_a_step_where_its_ttft_allows(llama_checkpoint):
    """A prompt whose last layers are found finished after the step was launched (a partition's prefill stream)
    could only join the step after next: with a step in flight its first token is left to the next step, which
    reports it one step before its second, unless that would make it late; without one, or for a chunk that does not
    end the prompt, or a recomputation after preemption, nothing waits."""
    path, _ = llama_checkpoint
    engine = engine_for(path, True, policy="serial")
    r = engine.make_request(prompt(1, 20), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.submit(r)
    layers = engine.model.config.num_layers
    last = [(PrefillWork(r.request_id, 0, 20, 0, layers), 7, None)]
    assert engine._defer(last) == last and not engine._deferred  # no step in flight
    engine._launched = in_flight = object()
    assert engine._defer(last) == [] and engine._deferred == last
    engine._deferred = []
    middle = [(PrefillWork(r.request_id, 0, 20, 0, layers // 2), None, None)]
    assert engine._defer(middle) == middle and not engine._deferred
    engine._step_s = 1e6  # waiting a step would miss the first token's TTFT target
    assert engine._defer(last) == last and not engine._deferred
    engine._step_s = 0.0
    r.output_token_ids = [5]  # a recomputation: its first token went out long ago
    assert engine._defer(last) == last and not engine._deferred
    r.output_token_ids = []
    assert engine._launched is in_flight
    engine._launched = None
    while engine.has_unfinished():
        engine.step()
    assert_clean(engine)
