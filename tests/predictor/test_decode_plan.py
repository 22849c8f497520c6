"""The decode kernel's waves as a latency feature: the plan replayed for a batch, its fit beside the cached tokens,
and profile files that carry it (or refuse a critical-path coefficient without it)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from appliance.attention import triton_decode
from appliance.engine.graphs import capture_sizes
from appliance.errors import ConfigError
from appliance.predictor.decode_plan import DecodePlan
from appliance.predictor.profile import read_profile
from appliance.predictor.shapes import DecodeLoad, Sample
from appliance.predictor.solo import fit_error, fit_solo

H200 = DecodePlan(total_sms=132, kv_heads=8, page_size=16, graph_sizes=tuple(capture_sizes(256)))


def load(batch: int, context: int) -> DecodeLoad:
    return DecodeLoad(batch, batch * (context - 1))  # a request of `context` tokens reads context - 1 cached ones


def test_a_batch_that_leaves_its_last_wave_half_empty_costs_two_whole_waves():
    # 22 requests of 15,096 tokens (944 pages): one chunk each (two would exceed 264 / 8 = 33 per head), padded to
    # the graph of 24; 192 CTAs on a 64-SM partition's 128 slots: two waves of a whole request
    assert H200.critical_tokens(load(22, 15096), 64) == 2 * 944 * 16
    # on all 132 SMs (264 slots) the same CTAs run in one wave
    assert H200.critical_tokens(load(22, 15096), 132) == 944 * 16
    # 8 requests of 27,579 tokens (1,724 pages) split into 4 chunks each: 256 CTAs, two balanced waves of 431 pages
    assert H200.critical_tokens(load(8, 27579), 64) == 2 * 431 * 16


def test_the_plan_keeps_chunks_of_at_least_128_tokens_and_pads_to_the_graph():
    # one request of 1,000 tokens (63 pages) in chunks of at least 8 pages: 8 chunks, 64 CTAs; on 16 SMs (32 slots)
    # two waves of 8 pages; the graph of 1 adds nothing
    assert H200.critical_tokens(load(1, 1000), 16) == 2 * 8 * 16
    # a batch above the largest graph runs unpadded
    no_graphs = DecodePlan(132, 8, 16)
    assert no_graphs.critical_tokens(load(300, 2048), 132) == H200.critical_tokens(load(300, 2048), 132)
    assert H200.critical_tokens(DecodeLoad(0, 0), 64) == 0.0
    assert DecodePlan.from_dict(H200.to_dict()) == H200


def test_the_solo_fit_recovers_a_decode_cost_with_a_wave_term():
    rng = np.random.default_rng(1)
    truth = {64: (4e-5, 0.02, 5.0, 3e-4), 132: (3e-5, 0.015, 4.5, 2e-4)}

    def samples(count: int) -> list[Sample]:
        out = []
        for sms, (e, f, g, k) in truth.items():
            for _ in range(count):
                lo = load(int(rng.integers(1, 128)), int(rng.integers(512, 30000)))
                ms = e * lo.reused_tokens + f * lo.batch_size + g + k * H200.critical_tokens(lo, sms)
                out.append(Sample("decode", sms, ms, decode=lo))
        prefill = [Sample("prefill", s, 10.0 + n / 100, prefill=()) for s in truth for n in range(4)]
        return out + prefill

    model = fit_solo(samples(30), H200)
    assert fit_error(model, samples(100)).decode_max <= 0.02  # held out
    for sms, coefficients in truth.items():
        assert np.allclose(model.decode[sms], coefficients, rtol=0.05)
    # without the plan the same samples fit three terms, worse
    assert len(fit_solo(samples(30)).decode[64]) == 3
    assert fit_error(fit_solo(samples(30)), samples(100)).decode_max > 0.02


def test_a_partition_with_too_few_samples_for_the_wave_term_fits_without_it():
    few = [Sample("decode", 64, 5.0 + b / 10, decode=load(b, 4096)) for b in (1, 8, 32)]
    few += [Sample("prefill", 64, 10.0 + n, prefill=()) for n in range(4)]
    assert len(fit_solo(few, H200).decode[64]) == 3


def test_a_profile_refuses_a_wave_coefficient_without_its_plan(tmp_path):
    raw = json.loads(Path("docs/data/profile-llama-3.1-8b-h200-2026-11-22.json").read_text())
    raw["decode"]["64"] = raw["decode"]["64"] + [1e-4]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="critical-path coefficient but the profile has no decode_plan"):
        read_profile(path)
    raw["decode_plan"] = {"total_sms": 132, "kv_heads": 8}
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="page_size"):
        read_profile(path)
    raw["decode_plan"] = H200.to_dict()
    path.write_text(json.dumps(raw))
    predictor = read_profile(path).predictor(32, "profile")
    assert predictor.decode_ms(load(22, 15096), 64) > read_profile(
        "docs/data/profile-llama-3.1-8b-h200-2026-11-22.json").predictor(32, "profile").decode_ms(load(22, 15096), 64)


def replay(plan: DecodePlan, batch: int, context: int, sms: int) -> int:
    """The plan step by step: every chunk of every request, a CTA per chunk and KV head, waves of the slots."""
    sizes = [s for s in plan.graph_sizes if s >= batch]
    pages = [math.ceil(context / plan.page_size)] * batch + [1] * ((sizes[0] if sizes else batch) - batch)
    limit = 2 * plan.total_sms // plan.kv_heads
    least = max(128 // plan.page_size, 1)
    chunk = next(c for c in range(least, max(max(pages), least) + 1)
                 if sum(math.ceil(p / c) for p in pages) <= limit or c >= max(pages))
    ctas = sorted((min(p - j * chunk, chunk) for p in pages for j in range(math.ceil(p / chunk))
                   for _ in range(plan.kv_heads)), reverse=True)
    return plan.page_size * sum(ctas[::2 * sms])


def test_the_closed_form_matches_the_plan_replayed_chunk_by_chunk():
    rng = np.random.default_rng(7)
    for plan in (H200, DecodePlan(78, 4, 16, (1, 2, 4, 8, 16, 32)), DecodePlan(132, 8, 32)):
        for i in range(120):
            batch, context = int(rng.integers(1, 300)), int(rng.integers(2, 200 if i % 4 == 0 else 40000))
            sms = int(rng.choice([16, 32, 48, 64, 96, plan.total_sms]))
            assert plan.critical_tokens(load(batch, context), sms) == replay(plan, batch, context, sms), \
                (plan, batch, context, sms)


H200_TRITON = DecodePlan(132, 8, 16, tuple(capture_sizes(256)), "triton")


def test_muxd_kernels_run_their_own_plans_on_graph_batches():
    # one request of 1,024 tokens (64 pages): the split kernel's 64 splits of at least 2 pages, 32 in use, 256
    # programs; all 132 SMs hold 6 each (one wave of 2 pages), 16 SMs 96 (three waves)
    assert H200_TRITON.critical_tokens(load(1, 1024), 132) == 2 * 16
    assert H200_TRITON.critical_tokens(load(1, 1024), 16) == 3 * 2 * 16
    # 64 requests of 4,096 tokens (256 pages): the balanced plan aims at 99 items a KV head (6 SMs' worth of
    # programs), so chunks of 166 pages cut each row in two: 1,024 programs of 128 pages, 3 a SM at once
    assert H200_TRITON.critical_tokens(load(64, 4096), 132) == 3 * 128 * 16
    assert H200_TRITON.critical_tokens(load(64, 4096), 64) == 6 * 128 * 16
    # past the largest graph the eager step runs flashinfer's decode
    assert H200_TRITON.critical_tokens(load(300, 2048), 132) == H200.critical_tokens(load(300, 2048), 132)
    assert DecodePlan.from_dict(H200_TRITON.to_dict()) == H200_TRITON
    assert DecodePlan.from_dict({"total_sms": 132, "kv_heads": 8, "page_size": 16}).kernel == "flashinfer"
    with pytest.raises(ValueError, match="decode kernel 'cutlass' is not one of flashinfer, triton"):
        DecodePlan(132, 8, 16, kernel="cutlass")


def replay_triton(plan: DecodePlan, batch: int, context: int, sms: int) -> int:
    """muxd's kernels program by program: each row's splits (or the balanced plan's items) for every KV head, the
    longest first in waves of the programs the SMs hold."""
    graph = next(s for s in plan.graph_sizes if s >= batch)
    pages = [math.ceil(context / plan.page_size)] * batch + [1] * (graph - batch)
    if graph <= triton_decode.MAX_BATCH:
        splits = triton_decode.splits_for(graph)
        runs = []
        for p in pages:
            per = max(-(-p // splits), triton_decode.PAGES_PER_BLOCK)
            runs += [min(per, p - s * per) for s in range(splits) if s * per < p]
        slots = triton_decode.PROGRAMS_PER_SM * sms
    else:
        target = -(-triton_decode.BALANCED_WAVES * plan.total_sms // plan.kv_heads)
        items = triton_decode.balance(np.array(pages), target, target + 2 * graph)
        runs = [int(e - b) for row, b, e, _, _ in items if row >= 0]
        slots = triton_decode.BALANCED_PROGRAMS_PER_SM * sms
    programs = sorted((r for r in runs for _ in range(plan.kv_heads)), reverse=True)
    return plan.page_size * sum(programs[::slots])


def test_muxd_kernels_closed_form_matches_their_programs_replayed():
    rng = np.random.default_rng(11)
    for plan in (H200_TRITON, DecodePlan(78, 4, 16, (1, 2, 4, 8, 16, 32), "triton")):
        for i in range(150):
            batch = int(rng.integers(1, plan.graph_sizes[-1] + 1))
            context = int(rng.integers(2, 200 if i % 4 == 0 else 40000))
            sms = int(rng.choice([16, 32, 48, 64, 96, plan.total_sms]))
            assert plan.critical_tokens(load(batch, context), sms) == replay_triton(plan, batch, context, sms), \
                (plan, batch, context, sms)


def test_a_profile_names_the_kernel_its_plan_models(tmp_path):
    raw = json.loads(Path("docs/data/profile-llama-3.1-8b-h200-2026-11-22.json").read_text())
    raw["decode"]["64"] = raw["decode"]["64"] + [1e-4]
    path = tmp_path / "p.json"
    raw["decode_plan"] = H200_TRITON.to_dict()
    path.write_text(json.dumps(raw))
    triton = read_profile(path).predictor(32, "profile")
    raw["decode_plan"] = H200.to_dict()
    path.write_text(json.dumps(raw))
    flashinfer = read_profile(path).predictor(32, "profile")
    # 22 requests of 15,096 tokens on 64 SMs: flashinfer's plan runs two waves of whole requests, muxd's balanced
    # plan shorter items in whole rounds
    assert triton.decode_ms(load(22, 15096), 64) < flashinfer.decode_ms(load(22, 15096), 64)
    raw["decode_plan"]["kernel"] = "cutlass"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="decode kernel 'cutlass' is not one of flashinfer, triton"):
        read_profile(path)
