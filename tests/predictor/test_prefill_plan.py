"""The prefill attention kernel's plan (FA3's persistent CTAs over the whole GPU's grid) as a latency feature: waves
of query tiles on a partition, and the solo fit that reads it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from appliance.errors import ConfigError
from appliance.predictor.gemm_table import GemmTable
from appliance.predictor.prefill_plan import PrefillPlan
from appliance.predictor.profile import build_profile, read_profile, save_profile
from appliance.predictor.shapes import DecodeLoad, PrefillItem, Sample
from appliance.predictor.solo import fit_error, fit_solo
from tests.predictor.test_predictor_models import LLAMA_8B

PLAN = PrefillPlan(total_sms=132, qo_heads=32)


def test_query_tiles_run_in_waves_of_the_partitions_sms():
    def cost(new, reused, sms):
        return PLAN.critical_tokens((PrefillItem(new, reused),), sms)
    # 128 new tokens: one tile per head, 32 tiles; 159: two per head, 64 tiles
    assert cost(128, 19679, 52) == 2 * 128 + 128 + 19679  # one wave: a tile over every key
    assert cost(159, 19679, 52) == pytest.approx(2 * cost(159, 19679, 132), rel=0.01)  # 64 tiles, 52 SMs: two waves
    assert cost(159, 19679, 68) == cost(159, 19679, 132)  # 64 tiles fit 68 SMs
    # more SMs never take longer, and no partition beats spreading the work evenly
    for new, reused in ((100, 0), (700, 5000), (3000, 20000)):
        costs = [cost(new, reused, sms) for sms in (20, 36, 52, 68, 84, 100, 116, 132)]
        assert all(b <= a for a, b in zip(costs, costs[1:]))
        tiles = [2 * 128 + min(reused + (t + 1) * 128, reused + new) for t in range(-(-new // 128))]
        assert all(c >= 32 * sum(tiles) / sms - 1e-6 for c, sms in zip(costs, (20, 36, 52, 68, 84, 100, 116, 132)))
    assert PLAN.critical_tokens((), 52) == 0.0
    assert PrefillPlan.from_dict(PLAN.to_dict()) == PLAN


def test_the_solo_fit_follows_the_waves_where_the_plan_is_known():
    table = GemmTable((128, 256, 512, 1024), {52: (0.3, 0.45, 0.75, 1.4)})
    rng = np.random.default_rng(3)

    def samples(count):
        out = []
        for _ in range(count):
            item = PrefillItem(int(rng.integers(64, 600)), int(rng.integers(4000, 24000)))
            ms = 32 * table.gemm_ms(item.new, 52) + 1e-3 * item.new + 1.5e-4 * PLAN.critical_tokens((item,), 52) + 2.0
            out.append(Sample("prefill", 52, ms, prefill=(item,)))
        return out + [Sample("decode", 52, 1e-4 * b * 900 + 0.02 * b + 5.0, decode=DecodeLoad(b, b * 900))
                      for b in (1, 4, 16, 64)]
    fit, held = samples(80), samples(200)
    model = fit_solo(fit, gemm=table, prefill_plan=PLAN)
    assert len(model.prefill[52]) == 7 and model.prefill[52][6] == pytest.approx(1.5e-4, rel=0.05)
    assert fit_error(model, held).prefill_max < 0.02 < 0.05 < fit_error(fit_solo(fit, gemm=table), held).prefill_max
    # a profile keeps the plan; a critical-path coefficient without it is refused
    profile = build_profile(fit, model_name="llama", model=LLAMA_8B, gpu_name="NVIDIA H200", sm_count=132,
                            decode_partitions=[80], gemm=table, prefill_plan=PLAN)
    assert profile.prefill_plan == PLAN.to_dict()
    assert profile.predictor(32, "p").prefill_solo_ms(held[0].prefill, 52) == pytest.approx(
        model.prefill_ms(held[0].prefill, 52))


def test_a_profile_refuses_a_critical_path_coefficient_without_its_plan(tmp_path):
    table = GemmTable((128, 256), {52: (0.3, 0.45)})
    samples = [Sample("prefill", 52, 10.0 + n / 50, prefill=(PrefillItem(n, r),)) for n in (64, 128, 200, 256)
               for r in (0, 5000)] + [Sample("decode", 52, 5.0 + b, decode=DecodeLoad(b, b * 100)) for b in (1, 2, 4)]
    profile = build_profile(samples, model_name="llama", model=LLAMA_8B, gpu_name="NVIDIA H200", sm_count=132,
                            decode_partitions=[80], gemm=table, prefill_plan=PLAN)
    path = tmp_path / "p.json"
    save_profile(profile, path)
    raw = json.loads(path.read_text())
    # (a, b, c, d, h, q, w): every term, the critical path's last (which of them a fit keeps is the fit's business)
    raw["prefill"]["52"] = [0.5, 0.01, 1e-6, 1e-7, 1.0, 0.2, 0.003]
    path.write_text(json.dumps(raw))
    assert read_profile(path).prefill_plan == PLAN.to_dict()  # with its plan, the profile reads
    raw["prefill_plan"] = None
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="critical-path coefficient but the profile has no prefill_plan"):
        read_profile(path)
    raw["prefill_plan"] = {"total_sms": 0, "qo_heads": 32}
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="field prefill_plan"):
        read_profile(path)
