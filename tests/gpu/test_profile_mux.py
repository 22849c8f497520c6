"""`muxd profile` on the GPU's SM partitions, and the `mux` policy driving the multiplex executor with the profile it
wrote: spatial steps on green-context partitions, greedy outputs equal serial execution, the contention guard refined
from measured decode steps, no page lost."""
from __future__ import annotations

import time

import torch
from copy_model import periodic_prompt
from spies import stepper

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.engine.steplog import StepLog
from appliance.predictor.split import FACTOR_RANGE
from appliance.profile.calibrate import calibrate_serving
from appliance.profile.grid import Ranges, plan_points
from appliance.profile.profiler import run_profile
from appliance.profile.timer import StepTimer
from appliance.workload.traces import RequestSpec

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# the copy model's context is 1024 tokens
SMALL = Ranges(prefill_new=(64, 256, 512), prefill_reused=(0, 256), decode_batch=(1, 4, 16),
               decode_context=(64, 512), contended_new=(512,), contended_batch=(8,), contended_context=(256,),
               mixed_new=(128, 512), mixed_batch=(1, 8))
TIGHT = """version: 1
name: tight
attainment: 0.99
targets:
  ttft: {ms: 5000}
  tbt: {ms: 1.0}
"""


def engine(path, **kw) -> Engine:
    return build_engine(Config.flat(model=path, device="cuda",
                                    num_gpu_blocks_override=2048, max_num_seqs=16, attention_backend="flashinfer",
                                    compile=True, **kw))


def test_profile_on_partitions_then_mux_on_the_multiplex_executor(copy_model, tmp_path, caplog):
    prof_engine = engine(copy_model, multiplex=True, max_num_batched_tokens=2048, enable_prefix_caching=False)
    timer = StepTimer(prof_engine, reps=2, decode_steps=4, contended_steps=4)
    assert timer.decode_partitions == [p.decode_sms for p in prof_engine.partitions.splits]
    points = plan_points(SMALL, timer.sm_count, timer.decode_partitions[:3], holdout=1)
    out = tmp_path / "copy.json"
    result = run_profile(timer, points, out, model_name="copy", budget_s=240, started=time.perf_counter())
    # a 2-layer model's prefill may end before the decode step beside it does: such contended points are left out
    # (the 8B profile of tests/gpu/run_all.sh measures them); every solo point is measured
    assert result.measured + result.failed == len(points) and result.skipped_budget == 0
    assert result.failed <= sum(p.kind == "contended" for p in points)
    assert prof_engine.pool.num_free_pages == prof_engine.pool.num_pages and not prof_engine.executor.has_inflight()
    profile = result.profile
    assert sorted(int(k) for k in profile.decode) == sorted([*timer.decode_partitions[:3], timer.sm_count])
    assert sorted(int(k) for k in profile.prefill) == sorted(
        timer.sm_count - d for d in [0, *timer.decode_partitions[:3]])
    assert all(c.slowdown >= 1.0 for c in profile.contention)
    assert result.errors["prefill_n"] > 0 and result.errors["decode_n"] > 0
    # the GEMMs were timed at the row buckets on every prefill partition first, and the prefills ran padded
    assert {int(k) for k in profile.gemm["ms"]} == set(timer.prefill_streams) >= {int(k) for k in profile.prefill}
    assert profile.gemm["rows"][-1] >= 2048 and all(t > 0 for ms in profile.gemm["ms"].values() for t in ms)
    # the prefill attention kernel's plan is recorded where flashinfer runs FA3 (Hopper, 16-bit models)
    kernel = prof_engine.runner.backend.prefill_kernel
    dtype = next(prof_engine.model.parameters()).dtype
    if torch.cuda.get_device_capability()[0] == 9 and dtype in (torch.bfloat16, torch.float16):
        assert kernel == "fa3"
    assert (profile.prefill_plan is not None) == (kernel == "fa3")
    # the serving calibration replays on the multiplexed engine under chunked prefill, then mux, and puts
    # everything back
    specs = [RequestSpec(arrival=i * 0.02, prompt_len=64 + 32 * (i % 4), output_len=48) for i in range(24)]
    factors, steps, prefills = calibrate_serving(
        prof_engine, [(specs, 200.0)], profile.predictor(prof_engine.model.config.num_layers, "profile"))
    assert "decode" in factors and any(s.get("mixed") for s in steps)
    assert any(s.get("mode") == "decode" for s in steps)  # the mux planner's steps (chunked leaves no mode)
    assert set(factors) <= {"decode", "prefill", "prefill_full", "prefill_split", "prefill_split_per_1k",
                            "mixed_floor"}  # (the mixed steps' floor as served, where the replay fits one)
    # prefill on all SMs measured (mux's temporal steps or, too few of them, the serial replay) and kept, or, where a
    # 2-layer model's prefill is so short that the host's launches set its time (5.2x the profile's once on an
    # H200), reported as out of the range a profile keeps
    assert "prefill_full" in factors or "prefill_full came out" in caplog.text
    assert all(r.get("ms") is not None and r["items"] and "decode_beside" in r for r in prefills)  # the split's data
    assert prof_engine.pool.num_free_pages == prof_engine.pool.num_pages and not prof_engine.executor.has_inflight()
    del prof_engine, timer

    contract = tmp_path / "tight.yaml"
    contract.write_text(TIGHT)  # a TBT no mixed step meets: the planner must split the GPU
    ref = engine(copy_model, policy="serial", multiplex=False)
    mux = engine(copy_model, policy="mux", slo=str(contract), profile=str(out))
    assert mux.executor.multiplexed and mux.predictor.source.startswith("profile")
    assert list(mux.predictor.decode_partitions) == [p.decode_sms for p in mux.partitions.splits]
    # its prefill launches run padded to the profile's GEMM buckets (and still compute what serial does, below)
    assert all(mux.executor.pad_rows(p.prefill_sms) is not None for p in mux.partitions.partitions)
    decoders = [periodic_prompt(s, 40 + s) for s in range(4)]
    late = [periodic_prompt(10 + s, 600 + 97 * s) for s in range(3)]
    expected = ref.generate(decoders + late, GREEDY)
    outputs: dict[str, list[int]] = {}
    steps = stepper(mux, outputs)

    beside = []  # decode steps that ran while prefill layers did: each refines the planner's contention guard
    observe = mux._observe

    def spy(plan, load=None):
        seen = mux.executor.last_decode
        if seen is not None and seen.concurrent:
            beside.append(seen)
        observe(plan, load)

    mux._observe = spy
    log = StepLog(mux, mux.predictor).attach()  # and the prefill launches' GPU time, for serving calibration
    ids = [mux.add_request(p, GREEDY) for p in decoders]
    steps(6)
    ids += [mux.add_request(p, GREEDY) for p in late]  # prompts arriving while the first ones decode
    steps()
    log.detach()
    stats = mux.scheduler.planner.stats
    assert stats.spatial_steps > 0 and mux.executor.switches >= 1 and mux.executor.layers_launched > 0
    split = [p for p in log.prefills if p["prefill_sms"] < mux.predictor.sm_count]
    assert split and all(p["ms"] > 0 and p["pred_ms"] > 0 and p["layers"] > 0 for p in split)
    assert any(p["beside"] for p in split)  # the layers ran while decode steps did on the other SMs
    # the engine handed each of those launches to the planner (online refinement of its split slowdown), which keeps
    # the ones its fit may use: a stall (a first launch compiling its kernels) falls out of FACTOR_RANGE
    learned = mux.scheduler.planner.predictor.split.window
    usable = [p for p in split if p["beside"] and FACTOR_RANGE[0] <= p["ms"] / p["pred_ms"] <= FACTOR_RANGE[1]]
    assert len(learned) == min(len(usable), learned.maxlen), \
        f"measured / predicted: {[round(p['ms'] / p['pred_ms'], 2) for p in split]}, kept {len(learned)}"
    assert sum(len(w) for w in mux.predictor.guard.observations.values()) == len(beside)
    assert all(o.decode_sms in mux.predictor.decode_partitions and o.ms > 0 for o in beside)
    for rid, exp in zip(ids, expected):
        assert outputs[rid] == exp.token_ids, rid
    assert mux.pool.num_free_pages == mux.pool.num_pages
