"""Tensor parallelism on a CPU: two ranks over gloo (rank 0 in this process, rank 1 started by the engine) generate
what one rank does, token for token (the engine's loop overlapped and not, rows sampled at once and held), for Llama
(a vocabulary the ranks split unevenly), Qwen2 (biases, GQA groups of 7 over 4 KV heads split 2 ways) and Qwen3 (one
KV head, replicated on both ranks); the profiler's and the engine bench's steps run on both ranks; a rank that dies
ends the engine with a RankError naming it, never a hang; and the ranks leave the process group together."""
from __future__ import annotations

import os
import signal
import threading
from unittest import mock

import pytest
import torch
from tiny_models import build_tiny_checkpoint

from appliance.bench.ceilings import Ceilings
from appliance.bench.engine_bench import EngineBench
from appliance.config import Config
from appliance.engine import step_wire
from appliance.engine.batch import span_tokens
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.errors import RankError
from appliance.profile.grid import Point
from appliance.profile.timer import StepTimer

SHAPES = {
    "llama": dict(vocab_size=251),
    "qwen2": dict(num_attention_heads=28, num_key_value_heads=4, head_dim=8),
    "qwen3": dict(num_key_value_heads=1),
}
PREFIX = list(range(3, 23))  # a full page shared by two prompts: the second reuses its cached KV


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    for family, shape in SHAPES.items():
        build_tiny_checkpoint(family, root / family, num_layers=2, **shape)
    return root


def _generate(path, tp: int, policy: str, max_tokens: int = 6, **extra):
    """Greedy outputs (and one penalised, seeded row with a bad word of two tokens: it is sampled once the token before
    it is read), preemptions, how many tokens rank 0 sent the other ranks as placeholders (sampled by a step still
    running: the overlapped loop; the other ranks read them from their token buffers), and the plans of the steps
    whose sampling was held."""
    settings = dict(max_model_len=64, max_num_batched_tokens=32, dist_timeout=60, **extra)
    engine = build_engine(Config.flat(model=str(path), tensor_parallel_size=tp, policy=policy, **settings))
    placeholders, held = 0, []

    def spans(*args):
        nonlocal placeholders
        ids = span_tokens(*args)
        placeholders += sum(i < 0 for i in ids)
        return ids

    finish = engine.executor.finish_sampling
    engine.executor.finish_sampling = lambda step: held.append(step.plan) or finish(step)
    try:
        # the penalised row decodes while the prompts after it are prefilled
        prompts = [PREFIX + [40, 41, 42], list(range(30, 60)), PREFIX + [50, 51], [7, 8, 9, 10, 11, 12, 13]]
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        params = [greedy, SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=4, presence_penalty=1.5,
                                         repetition_penalty=1.3, bad_words_token_ids=[[61, 62]], ignore_eos=True),
                  greedy, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=1)]
        with mock.patch.object(step_wire, "span_tokens", spans):
            done = engine.generate(prompts, params)
        return [c.token_ids for c in done], engine.num_preemptions, placeholders, held
    finally:
        engine.close()


@pytest.mark.parametrize("family,policy,extra", [
    ("llama", "layerwise", {}),  # prefill split over steps: activations wait between layer ranges on every rank
    ("qwen2", "chunked", {"chunk_budget": 8}),  # mixed steps: prompt chunks beside decode rows
    ("qwen3", "serial", {"num_gpu_blocks_override": 5, "max_tokens": 24}),  # a pool so small that requests are
    # preempted
    ("llama", "serial", {"async_scheduling": False}),  # the synchronous loop: every token known when sent
])
def test_two_ranks_generate_what_one_does(checkpoints, family, policy, extra):
    """Two ranks generate what one does, the penalised, seeded row too (its bad word of two tokens reads the output
    on the host): rank 0 launches the next forward first (and
    the step's prefill layers: layerwise) and samples that row after it (held); the other rank takes those tokens into
    its token buffer at the same point of its step, after the same collectives."""
    one, preempted_one, _, _ = _generate(checkpoints / family, 1, policy, **extra)
    two, preempted_two, placeholders, held = _generate(checkpoints / family, 2, policy, **extra)
    assert two == one
    assert preempted_two == preempted_one
    if "num_gpu_blocks_override" in extra:
        assert preempted_one > 0  # the preempted requests were sent to rank 1 again, whole
    # overlapped (the default), decode steps are launched before the tokens they continue from are read, and the
    # bad word's row's sampling is held
    overlapped = extra.get("async_scheduling", True)
    assert (placeholders > 0) == overlapped
    assert bool(held) == overlapped
    if policy == "layerwise":  # prefill layers launched between the held forward and its sampling
        assert any(plan.prefill and not plan.mixed for plan in held)


def test_the_profiler_and_the_engine_bench_time_steps_that_every_rank_runs_and_the_ranks_leave_together(
        checkpoints, monkeypatch, capfd):
    """The profiler's and the engine bench's steps run on both ranks. (`muxd serve --log-level info -tp 2`: every
    rank's start-up stages, each line naming its rank.) On close the ranks leave the process group together, as NCCL's
    teardown needs: the other rank exits by itself, not killed after waiting in the leaving barrier for a rank 0 that
    would leave only once it had gone."""
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)  # the other ranks log at rank 0's level
    try:
        engine = build_engine(Config.flat(model=str(checkpoints / "qwen2"), tensor_parallel_size=2,
                                          max_model_len=64, dist_timeout=60))
    finally:
        root.setLevel(level)
    healthy: list[bool] = []  # (what rank 0 must do before it leaves: drop its graphs, which hold collectives)
    engine.executor.group.before_leaving(healthy.append)
    try:
        timer = StepTimer(engine, reps=1, decode_steps=1)
        sms = timer.sm_count
        for point in (Point("prefill", sms, new=24), Point("decode", sms, batch=2, context=20),
                      Point("mixed", sms, new=8, batch=2, context=20)):
            assert timer.measure(point) > 0
        monkeypatch.setattr("torch.cuda.synchronize", lambda: None)  # the bench's timing fence; nothing on a CPU
        with pytest.raises(ValueError, match="link between its GPUs"):
            EngineBench(engine, Ceilings("cpu", 1e9, 1e9))
        bench = EngineBench(engine, Ceilings("cpu", 1e9, 1e9, link_bytes_per_s=1e8), iters=2, warmup=1)
        decode, prefill = bench.decode(2, 20), bench.prefill(16, 8)
        assert decode.ms > 0 and prefill.ms > 0
        # each floor adds what rank 0 sends in the step's collectives at the link's rate: the embedding's and the
        # layers' all-reduces (on two ranks a whole tensor: half reduce-scattered, half gathered) and its half of the
        # logits
        cfg, elem = engine.model.config, next(engine.model.parameters()).element_size()
        sent = ((2 * cfg.num_layers + 1) * 2 * cfg.hidden_size + 2 * -(-cfg.vocab_size // 2)) * elem
        assert decode.floor_ms == pytest.approx((bench.costs.decode_bytes(2, 20) / 1e9 + sent / 1e8) * 1e3)
        assert engine.pool.num_free_pages == engine.pool.num_pages  # every request they seated was released
    finally:
        engine.close()
    assert "INFO rank 1 muxd.engine: policy: serial (the default on CPU)" in capfd.readouterr().err
    assert healthy == [True] and [p.exitcode for p in engine.executor.group.procs] == [0]
    assert not torch.distributed.is_initialized()


def test_a_rank_that_dies_ends_the_engine_with_its_error(checkpoints):
    engine = build_engine(Config.flat(model=str(checkpoints / "llama"), tensor_parallel_size=2, policy="serial",
                                      max_model_len=96, dist_timeout=60))
    lost: list[BaseException] = []
    called = threading.Event()
    engine.on_fatal(lambda exc: (lost.append(exc), called.set()))
    try:
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        engine.add_request(list(range(3, 30)), params)
        engine.step()
        os.kill(engine.executor.group.procs[0].pid, signal.SIGKILL)
        with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            while engine.has_unfinished():
                engine.step()
        assert called.wait(60) and isinstance(lost[0], RankError)
        with pytest.raises(RankError):  # and so it stays
            engine.step()
    finally:
        healthy: list[bool] = []
        engine.executor.group.before_leaving(healthy.append)
        engine.close()
    assert healthy == [False]  # (told so: no waiting for work a dead rank will never finish)
