"""`muxd serve` on a GPU with no latency profile anywhere: the default policy is mux, it plans from the roofline prior,
and the closed loop keeps the contract on a short replay of short-prompt chat (Llama-3.1-8B shapes, dummy weights)."""
from __future__ import annotations

from pathlib import Path

from appliance.bench.client import replay_in_process
from appliance.bench.prompts import PromptSynth
from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.slo.attainment import evaluate
from appliance.slo.contract import load_contract
from appliance.workload import shaping as wl

ROOT = Path(__file__).resolve().parents[2]


def test_mux_without_a_profile_keeps_the_contract(tmp_path, monkeypatch):
    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path / "cache"))  # nothing cached
    monkeypatch.setattr("appliance.predictor.catalog.BUNDLED", tmp_path / "none")  # nothing shipped either
    contract = ROOT / "configs" / "slo" / "chat-queue.yaml"
    engine = build_engine(Config.flat(model=str(ROOT / "configs" / "models" / "llama-3.1-8b"), load_format="dummy",
                                      slo=str(contract), max_model_len=8192, max_num_seqs=128))
    assert engine.config.scheduler.policy == "mux" and engine.predictor.source == "roofline prior"
    inp, out = (wl.LengthDist.parse(x) for x in wl.preset("chat-short"))
    specs, _ = wl.clip_to_context(wl.synthetic(160, 6.0, inp, out, seed=3), 8191)
    synth = PromptSynth(vocab_size=engine.model.config.vocab_size)
    result = replay_in_process(engine, specs, [synth.token_ids(s, i) for i, s in enumerate(specs)])
    report = evaluate(load_contract(contract), result.timelines, specs)
    assert report.met, f"{report.reasons}; p99 TBT {report.tbt_ms:.1f} ms"
    state = engine.scheduler.planner.snapshot()["control"]["default"]["tbt"]
    assert state["samples"] > 1000
    assert engine.pool.num_free_pages == engine.pool.num_pages
