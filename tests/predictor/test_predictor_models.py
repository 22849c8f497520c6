"""Predictor models: the solo-run fit recovers a known function, the contention guard keeps cell maxima and learns
online, the roofline prior scales with SMs and calibrates, and profile files load or fall back to the prior."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from appliance import __version__
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.contention import ContentionGuard, cell_of
from appliance.predictor.predictor import Predictor, partition_choices
from appliance.predictor.profile import build_profile, load_predictor, read_profile, save_profile
from appliance.predictor.roofline import DEVICES, RooflineModel
from appliance.predictor.shapes import DecodeLoad, PrefillItem, Sample
from appliance.predictor.solo import MeasuredRange, fit_error, fit_solo
from appliance.predictor.synthetic import SyntheticGPU, sample_grid, synthetic_profile

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
LLAMA_8B = ModelConfig.from_file(CONFIGS / "llama-3.1-8b" / "config.json")
QWEN_7B = ModelConfig.from_file(CONFIGS / "qwen2.5-7b" / "config.json")

# a known latency function: MuxWise's form with different coefficients per partition (ms)
TRUE_PREFILL = {32: (4e-7, 3e-7, 0.05, 6.0), 100: (1.3e-7, 1e-7, 0.016, 5.5), 132: (1e-7, 8e-8, 0.012, 5.0)}
TRUE_DECODE = {32: (2.0e-4, 0.05, 7.0), 100: (1.1e-4, 0.02, 5.2), 132: (1.1e-4, 0.015, 5.0)}


def known_samples(rng: np.random.Generator, count: int) -> list[Sample]:
    samples = []
    for sms, (a, b, c, d) in TRUE_PREFILL.items():
        for _ in range(count):
            items = tuple(PrefillItem(int(rng.integers(16, 16384)), int(rng.integers(0, 32768)))
                          for _ in range(int(rng.integers(1, 4))))
            n2 = sum(i.new ** 2 for i in items)
            nr = sum(i.new * i.reused for i in items)
            n = sum(i.new for i in items)
            samples.append(Sample("prefill", sms, a * n2 + b * nr + c * n + d, prefill=items))
    for sms, (e, f, g) in TRUE_DECODE.items():
        for _ in range(count):
            bs = int(rng.integers(1, 256))
            load = DecodeLoad(bs, bs * int(rng.integers(128, 16384)))
            samples.append(Sample("decode", sms, e * load.reused_tokens + f * bs + g, decode=load))
    return samples


def test_solo_fit_recovers_a_known_function():
    rng = np.random.default_rng(0)
    model = fit_solo(known_samples(rng, 40))
    err = fit_error(model, known_samples(rng, 200))  # held out
    assert err.prefill_max <= 0.02 and err.decode_max <= 0.02
    for sms, truth in TRUE_PREFILL.items():
        assert np.allclose(model.prefill[sms][:4], truth, rtol=0.02)
        assert model.prefill[sms][4] <= min(s.ms for s in known_samples(rng, 50) if s.sms == sms)  # no floor
    for sms, truth in TRUE_DECODE.items():
        assert np.allclose(model.decode[sms], truth, rtol=0.02)
    # between profiled partitions the smaller one answers (never optimistic)
    items = [PrefillItem(4096, 0)]
    assert model.prefill_ms(items, 120) == model.prefill_ms(items, 100) > model.prefill_ms(items, 132)


def test_solo_fit_with_noise_stays_close():
    rng = np.random.default_rng(1)
    noisy = [dataclasses.replace(s, ms=s.ms * (1 + rng.normal(0, 0.01))) for s in known_samples(rng, 60)]
    err = fit_error(fit_solo(noisy), known_samples(rng, 100))
    assert err.prefill_mean < 0.02 and err.decode_mean < 0.02


def test_more_sms_never_predict_a_slower_prefill():
    """A wide partition's fit that put its time on the quadratic term (as a short profile's did on an H100) is held,
    past the range it was measured on, to what the narrower partitions predict."""
    rng = np.random.default_rng(4)
    model = fit_solo(known_samples(rng, 40))
    short, long = [PrefillItem(1024, 0)], [PrefillItem(28000, 0)]
    before = model.prefill_ms(short, 132)  # remembered: asked again, the same figure
    assert model.prefill_ms(tuple(short), 132) == before and len(model._memo) == 1
    quadratic = dataclasses.replace(model, prefill={**model.prefill, 132: (4e-6, 0.0, 0.0, 5.0, 0.0)})
    assert not quadratic._memo  # a replaced model answers from its own coefficients
    assert quadratic.prefill_ms(short, 132) == pytest.approx(4e-6 * 1024 ** 2 + 5.0)  # its own fit where it holds
    assert quadratic.prefill_ms(short, 132) < quadratic.prefill_ms(short, 100)
    assert quadratic.prefill_ms(long, 132) == quadratic.prefill_ms(long, 100) < 4e-6 * 28000 ** 2
    for sms, (a, _, c, d) in TRUE_PREFILL.items():  # a consistent fit is left as it is
        assert model.prefill_ms(long, sms) == pytest.approx(a * 28000 ** 2 + c * 28000 + d, rel=0.02)


class LinearPrior:
    """A prior whose prefill time is linear in new and reused tokens."""

    def prefill_ms(self, items, sms):
        return sum(i.new + 0.1 * i.reused for i in items) * 132 / sms


def test_past_the_measured_range_the_prior_scales_the_edge(tmp_path):
    """A profile measured prompts up to 4k tokens: a longer one takes the 4k edge's fitted time, scaled as the prior
    scales; within the range, and without a prior, the fit answers alone. The range travels in the profile file."""
    rng = np.random.default_rng(5)
    samples = [s for s in known_samples(rng, 40) if s.kind != "prefill"]
    for sms, (a, b, c, d) in TRUE_PREFILL.items():
        for _ in range(20):
            n, r = int(rng.integers(16, 3072)), int(rng.integers(0, 1024))
            samples.append(Sample("prefill", sms, a * n * n + b * n * r + c * n + d, prefill=(PrefillItem(n, r),)))
    fitted = fit_solo(samples)
    assert fitted.measured is not None and fitted.measured.kv <= 4096
    model = dataclasses.replace(fitted, measured=MeasuredRange(new=4096, kv=4096), prior=LinearPrior())
    inside, past = [PrefillItem(3000, 1000)], [PrefillItem(12000, 4000)]
    assert model.prefill_ms(inside, 132) == fitted.prefill_ms(inside, 132)
    edge = [PrefillItem(3072, 1024)]  # every prompt shrunk by the same factor to the edge (kv 4096)
    assert model.prefill_ms(past, 132) == pytest.approx(fitted.prefill_ms(edge, 132) * 12400 / 3174.4)
    assert dataclasses.replace(fitted, measured=MeasuredRange(4096, 4096)).prefill_ms(past, 132) == \
        fitted.prefill_ms(past, 132)
    profile = build_profile(samples, model_name="m", model=LLAMA_8B, gpu_name="NVIDIA H200", sm_count=132,
                            decode_partitions=[32])
    assert profile.measured == {"prefill_new": fitted.measured.new, "prefill_kv": fitted.measured.kv}
    path = tmp_path / "p.json"
    save_profile(profile, path)
    predictor = load_predictor(path, LLAMA_8B, "NVIDIA H200")
    assert isinstance(predictor.latency.prior, RooflineModel)
    assert predictor.latency.measured == fitted.measured
    raw = json.loads(path.read_text())
    raw["measured"] = {"prefill_new": 0, "prefill_kv": 10}
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="measured"):
        read_profile(path)


def test_a_mixed_chunk_past_the_measured_range_adds_what_prefill_adds():
    """A chunk over a cached prefix longer than the profile measured: the mixed model at the prefix cut to the range,
    plus the prefill model's increment from there (scaled past the range as the prior scales). A mixed fit made on
    short prefixes has no attention term over them; within the range the fit answers alone."""
    rng = np.random.default_rng(4)
    fitted = dataclasses.replace(fit_solo(known_samples(rng, 40)), mixed=(0.0, 0.0, 0.02, 1e-4, 6.0, 10.0))
    model = dataclasses.replace(fitted, measured=MeasuredRange(new=4096, kv=4096), prior=LinearPrior())
    load = DecodeLoad(16, 16 * 2000)
    inside, past = [PrefillItem(1024, 3000)], [PrefillItem(1024, 20000)]
    terms = lambda items: 0.02 * (sum(i.new for i in items) + 16) + 1e-4 * 32000 + 6.0  # noqa: E731
    assert model.mixed_gpu_ms(inside, load) == pytest.approx(terms(inside))
    edge = [PrefillItem(1024, 3072)]  # the new tokens kept, the prefix cut to end at the range's edge
    extra = model.prefill_ms(past, 132) - model.prefill_ms(edge, 132)
    assert extra > 0
    assert model.mixed_gpu_ms(past, load) == pytest.approx(terms(edge) + extra)
    assert model.mixed_ms(past, load, 132) == pytest.approx(max(10.0, terms(edge) + extra))
    assert fitted.mixed_gpu_ms(past, load) == pytest.approx(terms(past))  # no prior: the fit alone


def test_solo_fit_finds_the_host_floor_and_the_mixed_step():
    """Short prefills cost the host's launch time, whatever their size: the fit finds that floor and keeps its
    GPU terms for the long ones; measured mixed steps get their own coefficients."""
    rng = np.random.default_rng(2)
    floor, (a, b, c, d) = 18.0, TRUE_PREFILL[132]
    mixed_truth = (1.1e-7, 9e-8, 0.013, 1.2e-4, 6.0)

    def prefill(n: int, r: int) -> Sample:
        return Sample("prefill", 132, max(floor, a * n * n + b * n * r + c * n + d), prefill=(PrefillItem(n, r),))

    def mixed(n: int, r: int, bs: int, ctx: int) -> Sample:
        a2, b2, c2, e2, d2 = mixed_truth
        ms = max(25.0, a2 * n * n + b2 * n * r + c2 * (n + bs) + e2 * bs * ctx + d2)
        return Sample("mixed", 132, ms, prefill=(PrefillItem(n, r),), decode=DecodeLoad(bs, bs * ctx))

    draw = lambda lo, hi: int(np.exp(rng.uniform(np.log(lo), np.log(hi))))  # noqa: E731
    fit = [prefill(draw(64, 16384), int(rng.integers(0, 16384))) for _ in range(40)]
    fit += [mixed(draw(64, 4096), int(rng.integers(0, 8192)), draw(1, 256), draw(128, 8192)) for _ in range(40)]
    fit += [Sample("decode", 132, 5.0 + 0.01 * bs, decode=DecodeLoad(bs, bs * 100)) for bs in (1, 8, 64, 128)]
    model = fit_solo(fit)
    assert model.prefill[132][4] == pytest.approx(floor, rel=0.05)
    assert model.mixed is not None and model.mixed[5] == pytest.approx(25.0, rel=0.05)
    held = [prefill(draw(64, 16384), int(rng.integers(0, 16384))) for _ in range(100)]
    held += [mixed(draw(64, 4096), int(rng.integers(0, 8192)), draw(1, 256), draw(128, 8192)) for _ in range(100)]
    err = fit_error(model, held)
    assert err.prefill_max <= 0.05 and err.mixed_max <= 0.05
    # without mixed samples the mixed step is composed from the prefill and decode fits
    assert fit_solo([s for s in fit if s.kind != "mixed"]).mixed is None


def test_a_profile_without_the_host_floor_still_predicts(tmp_path):
    """Profiles written before the floor (four prefill coefficients, no mixed fit) load and predict as before."""
    rng = np.random.default_rng(3)
    profile = build_profile(known_samples(rng, 20), model_name="m", model=LLAMA_8B, gpu_name="NVIDIA H200",
                            sm_count=132, decode_partitions=[32])
    raw = json.loads(profile.model_dump_json())
    raw["prefill"] = {k: v[:4] for k, v in raw["prefill"].items()}
    raw["mixed"] = None
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    predictor = read_profile(path).predictor(32, "old")
    a, b, c, d = TRUE_PREFILL[132]
    items = [PrefillItem(2048, 1024)]
    assert predictor.prefill_ms(items) == pytest.approx(a * 2048 ** 2 + b * 2048 * 1024 + c * 2048 + d, rel=0.02)
    assert predictor.mixed_ms(items, DecodeLoad(4, 4000)) > predictor.prefill_ms(items)
    raw["prefill"]["132"] = [1.0, 2.0]
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="expected 4 or 5"):
        read_profile(path)


def test_fit_needs_enough_samples():
    with pytest.raises(Exception, match="needs at least 4"):
        fit_solo([Sample("prefill", 132, 10.0, prefill=(PrefillItem(100),))] * 3
                 + [Sample("decode", 132, 5.0, decode=DecodeLoad(1, 10))] * 3)


def test_a_partition_with_too_few_samples_is_predicted_from_its_neighbour():
    """A budget that ran out part way through the grid leaves some partitions a sample or two: they are left out as
    if never measured, and the narrower partition beside them stands in (never optimistic)."""
    def prefill(sms: int, n: int, r: int = 0) -> Sample:
        a, b, c, d = TRUE_PREFILL[sms]
        return Sample("prefill", sms, a * n * n + b * n * r + c * n + d, prefill=(PrefillItem(n, r),))

    def decode(sms: int, batch: int, context: int) -> Sample:
        e, f, g = TRUE_DECODE[sms]
        return Sample("decode", sms, e * batch * context + f * batch + g, decode=DecodeLoad(batch, batch * context))

    full = [(256, 0), (1024, 0), (4096, 0), (1024, 2048), (4096, 1024)]
    samples = [prefill(s, n, r) for s in (32, 100) for n, r in full] + [prefill(132, 512), prefill(132, 2048)]
    samples += [decode(s, b, c) for s in (32, 132) for b, c in ((1, 512), (64, 512), (16, 4096))]
    samples += [decode(100, 8, 1024)]
    model = fit_solo(samples)
    assert sorted(model.prefill) == [32, 100] and sorted(model.decode) == [32, 132]
    item = [PrefillItem(3000, 500)]
    assert model.prefill_ms(item, 132) == pytest.approx(model.prefill_ms(item, 100))  # 100 SMs stand in for 132
    assert model.prefill_ms(item, 132) >= prefill(132, 3000, 500).ms
    load = DecodeLoad(8, 8 * 1024)
    assert model.decode_ms(load, 100) == pytest.approx(model.decode_ms(load, 32))
    # with no partition fitted for a phase there is no model
    with pytest.raises(ConfigError, match=r"no decode partition .*1 on 100 SMs"):
        fit_solo([s for s in samples if s.kind == "prefill"] + [decode(100, 8, 1024)])


def test_contention_guard_returns_cell_maximum_and_learns_online():
    guard = ContentionGuard(default=1.3)
    items, load = [PrefillItem(3000, 0)], DecodeLoad(16, 16 * 4000)
    for measured in (11.0, 12.5, 11.8):  # solo prediction 10 ms
        guard.observe(32, items, load, 10.0, measured)
    assert guard.slowdown(32, items, load) == pytest.approx(1.25)
    # same cell: another prefill size inside the bin, another batch inside its bin
    assert guard.slowdown(32, [PrefillItem(4000, 100)], DecodeLoad(20, 20 * 3000)) == pytest.approx(1.25)
    assert cell_of(32, items, load) != cell_of(48, items, load)
    # a cell never measured: the worst of its partition; a partition never measured: the device default
    assert guard.slowdown(32, [PrefillItem(16000, 0)], load) == pytest.approx(1.25)
    assert guard.slowdown(64, items, load) == pytest.approx(1.3)
    assert guard.slowdown(32, [], load) == 1.0  # nothing runs beside decode
    # online refinement: a slower step raises the cell at once, a faster one does not lower it
    assert guard.observe(32, items, load, 10.0, 14.0) == pytest.approx(1.4)
    assert guard.slowdown(32, items, load) == pytest.approx(1.4)
    guard.observe(32, items, load, 10.0, 10.5)
    assert guard.slowdown(32, items, load) == pytest.approx(1.4)


def test_online_refinement_follows_measured_steps_not_one_outlier():
    guard = ContentionGuard({cell_of(32, [PrefillItem(3000)], DecodeLoad(16, 64000)): 1.25}, default=1.3)
    items, load = [PrefillItem(3000, 0)], DecodeLoad(16, 16 * 4000)
    for _ in range(7):
        assert guard.refine(32, items, load, 10.0, 15.0) == pytest.approx(1.25)  # fewer than 8: the profile holds
    assert guard.refine(32, items, load, 10.0, 15.0) == pytest.approx(1.5)  # underestimated: it rises
    other = [PrefillItem(100, 0)]  # a cell the profile never measured
    guard.refine(32, other, load, 10.0, 30.0)  # one stray slow step (a host hiccup) ...
    for _ in range(62):
        guard.refine(32, other, load, 10.0, 11.0)
    assert guard.slowdown(32, other, load) == pytest.approx(1.1)  # ... does not set the cell
    for _ in range(8):
        guard.refine(32, items, load, 10.0, 10.0)  # faster steps never take a cell below its profile
    assert guard.slowdown(32, items, load) >= 1.25


def test_predictor_applies_the_guard_only_beside_prefill():
    p = Predictor.prior(LLAMA_8B, DEVICES["h100"])
    load, items = DecodeLoad(32, 32 * 4096), [PrefillItem(8192, 0)]
    solo = p.decode_ms(load, 32)
    assert p.decode_ms(load, 32, items) == pytest.approx(solo * 1.3)
    p.observe_decode(load, 32, items, solo * 1.1)
    assert p.decode_ms(load, 32, items) == pytest.approx(solo * 1.3)  # one step is not evidence yet
    for _ in range(7):
        p.observe_decode(load, 32, items, solo * 1.1)
    assert p.decode_ms(load, 32, items) == pytest.approx(solo * 1.1)
    assert p.decode_ms(load, None, items) == p.decode_ms(load)  # all SMs: nothing runs beside it
    assert p.decode_partitions == partition_choices(132) == (16, 32, 48, 64, 80, 96, 112)


def test_roofline_scales_with_sms():
    m = RooflineModel(LLAMA_8B, DEVICES["h100"])
    # decode is memory bound: a few SMs pull much of the bandwidth, which saturates: past 64 SMs, twice the SMs
    # gain a few per cent; below it they gain much
    load = DecodeLoad(16, 16 * 4096)
    assert m.decode_ms(load, 132) < m.decode_ms(load, 64) < 1.1 * m.decode_ms(load, 132)
    assert m.decode_ms(load, 16) > 1.7 * m.decode_ms(load, 64)
    # a long prefill is compute bound: fewer SMs take longer, and each SM computes more on a small partition than
    # on a large one (half the SMs, 1.6x the time; half of those, 1.8x)
    items = [PrefillItem(8192, 0)]
    assert 1.5 < m.prefill_ms(items, 66) / m.prefill_ms(items, 132) < 2.0
    assert m.prefill_ms(items, 66) / m.prefill_ms(items, 132) < m.prefill_ms(items, 33) / m.prefill_ms(items, 66) < 2
    # attention-aware: the same new tokens after a long cached prefix cost more
    assert m.prefill_ms([PrefillItem(2048, 32768)], 132) > 1.5 * m.prefill_ms([PrefillItem(2048, 0)], 132)
    # a mixed batch costs less than its parts run one after the other (the weights are read once)
    assert m.mixed_ms(items, load, 132) < m.prefill_ms(items, 132) + m.decode_ms(load, 132)
    # the same model on a faster memory system decodes faster
    assert RooflineModel(LLAMA_8B, DEVICES["h200"]).decode_ms(load, 132) < m.decode_ms(load, 132)


def test_roofline_calibration_from_a_few_samples():
    prior = RooflineModel(QWEN_7B, DEVICES["h100"])
    measured = [Sample("prefill", 132, 1.25 * prior.prefill_ms([PrefillItem(n)], 132), prefill=(PrefillItem(n),))
                for n in (512, 2048, 8192)]
    measured += [Sample("decode", 64, 1.6 * prior.decode_ms(DecodeLoad(b, b * 2048), 64),
                        decode=DecodeLoad(b, b * 2048)) for b in (1, 32)]
    calibrated = prior.calibrated(measured)
    assert calibrated.prefill_scale == pytest.approx(1.25) and calibrated.decode_scale == pytest.approx(1.6)
    assert calibrated.prefill_ms([PrefillItem(4000, 1000)], 100) == pytest.approx(
        1.25 * prior.prefill_ms([PrefillItem(4000, 1000)], 100))


def test_profile_of_a_synthetic_gpu_round_trips(tmp_path):
    gpu = SyntheticGPU(LLAMA_8B, DEVICES["h100"])
    parts = partition_choices(132)
    profile = synthetic_profile(gpu, parts, "llama-3.1-8b")
    assert profile.fit["prefill_mean_rel_error"] < 0.03 and profile.fit["decode_mean_rel_error"] < 0.03
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    raw = json.loads(path.read_text())
    assert (raw["format"], raw["version"], raw["muxd_version"]) == ("muxd-profile", 1, __version__)
    assert raw["model"]["name"] == "llama-3.1-8b" and raw["gpu"] == {"name": "H100", "sm_count": 132}
    p = load_predictor(path, LLAMA_8B, "NVIDIA H100 80GB HBM3")
    assert p.source == f"profile {path}" and p.decode_partitions == parts
    # the guard holds the worst contention seen in each cell: every profiled step is covered by the worst case
    contended = [s for s in sample_grid(gpu, parts) if s.kind == "contended"]
    assert contended and all(p.decode_ms(s.decode, s.sms, s.prefill) >= s.ms * (1 - 1e-9) for s in contended)


@pytest.mark.parametrize("change, reason", [
    (lambda raw: raw["model"]["shape"].update(num_layers=28), "another shape"),
    (lambda raw: raw["gpu"].update(name="H200"), "measured on H200"),
    (lambda raw: raw.update(version=99), "format version 99"),
    (lambda raw: raw.update(format="something-else"), "not a muxd profile"),
    (lambda raw: raw.pop("prefill"), "field prefill"),
])
def test_mismatched_profile_falls_back_to_the_prior(tmp_path, caplog, change, reason):
    gpu = SyntheticGPU(LLAMA_8B, DEVICES["h100"])
    raw = json.loads(synthetic_profile(gpu, (32, 64), "llama").model_dump_json())
    change(raw)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="muxd.predictor"):
        p = load_predictor(path, LLAMA_8B, "h100")
    assert p.source == "roofline prior"
    assert reason in caplog.text and "roofline prior" in caplog.text
    assert isinstance(p.latency, RooflineModel)


def test_missing_profile_and_other_muxd_version(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="muxd.predictor"):
        assert load_predictor(tmp_path / "none.json", LLAMA_8B, "h100").source == "roofline prior"
        assert load_predictor(None, LLAMA_8B, "cpu").sm_count == DEVICES["cpu"].sm_count
    assert "cannot read" in caplog.text and "no --profile given" in caplog.text
    profile = synthetic_profile(SyntheticGPU(LLAMA_8B, DEVICES["h100"]), (32,), "llama")
    path = tmp_path / "old.json"
    save_profile(profile.model_copy(update={"muxd_version": "0.0.1"}), path)
    p = load_predictor(path, LLAMA_8B, "h100")
    assert p.source.startswith("profile") and any("0.0.1" in n for n in p.notes)
    assert read_profile(path).muxd_version == "0.0.1"


def test_profile_needs_every_phase():
    gpu = SyntheticGPU(LLAMA_8B, DEVICES["h100"])
    only_decode = [s for s in sample_grid(gpu, (32,)) if s.kind == "decode"]
    with pytest.raises(Exception, match="prefill and for decode"):
        build_profile(only_decode, model_name="x", model=LLAMA_8B, gpu_name="H100", sm_count=132,
                      decode_partitions=(32,))
