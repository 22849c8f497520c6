"""The predictor knows the tensor-parallel degree: the roofline prior costs one rank's share plus its collectives, a
profile records the degree it was measured at and serves only that degree, and the simulator runs TP
configurations (`--serve-args "-tp N"`)."""
from __future__ import annotations

import logging
from pathlib import Path

from appliance.bench.capacity import kv_pages
from appliance.bench.run import BenchOptions
from appliance.bench.simulated import simulated_bench
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.catalog import profile_key
from appliance.predictor.predictor import partition_choices
from appliance.predictor.profile import load_predictor, save_profile
from appliance.predictor.roofline import DEVICES, RooflineModel
from appliance.predictor.shapes import DecodeLoad, PrefillItem
from appliance.predictor.synthetic import SyntheticGPU, synthetic_profile

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
LLAMA_70B = ModelConfig.from_file(MODELS / "llama-3.1-70b" / "config.json")
LLAMA_8B = ModelConfig.from_file(MODELS / "llama-3.1-8b" / "config.json")


def test_the_prior_costs_a_rank_s_share_and_its_collectives():
    h200 = DEVICES["h200"]
    one, two, four = (RooflineModel(LLAMA_70B.sharded(tp), h200) for tp in (1, 2, 4))
    assert one.comm_ms(256, 256) == 0.0
    assert 0 < two.comm_ms(1, 1) < two.comm_ms(256, 256) < four.comm_ms(256, 256)
    load = DecodeLoad(64, 64 * 4096)
    # decode reads the weights: half of them per rank is nearly twice as fast, less the all-reduces
    assert one.decode_ms(load, 132) / 2 < two.decode_ms(load, 132) < one.decode_ms(load, 132)
    assert two.decode_ms(load, 132) - two.comm_ms(64, 64) < one.decode_ms(load, 132) / 1.9
    prompt = [PrefillItem(8192, 0)]
    assert four.prefill_ms(prompt, 132) < two.prefill_ms(prompt, 132) < one.prefill_ms(prompt, 132)


def test_a_profile_serves_only_the_degree_it_was_measured_at(tmp_path, caplog):
    two = LLAMA_8B.sharded(2)
    profile = synthetic_profile(SyntheticGPU(two, DEVICES["h100"]), partition_choices(132), "llama-3.1-8b")
    assert profile.tensor_parallel_size == 2 and profile.model.shape["num_heads"] == 32  # the whole model's shape
    path = tmp_path / "tp2.json"
    save_profile(profile, path)
    assert load_predictor(path, two, "h100").source == f"profile {path}"
    with caplog.at_level(logging.WARNING):
        fallback = load_predictor(path, LLAMA_8B, "h100")
    assert fallback.source == "roofline prior"
    assert "measured with --tensor-parallel-size 2, this engine runs 1" in caplog.text
    assert profile_key(two, "h100") != profile_key(LLAMA_8B, "h100")


def test_the_simulator_runs_a_tensor_parallel_configuration():
    opts = dict(model=str(MODELS / "llama-3.1-70b"))
    single, _, _ = simulated_bench(BenchOptions(**opts), "h200")
    split, model, notes = simulated_bench(BenchOptions(**opts, serve_args=["-tp", "2"]), "h200")
    assert model.tp_size == 2 and any("tensor parallelism over 2 GPUs" in n for n in notes)
    assert split.sim.num_pages > single.sim.num_pages == kv_pages(LLAMA_70B, DEVICES["h200"])
    load = DecodeLoad(32, 32 * 2048)
    assert split.predictor.decode_ms(load) < single.predictor.decode_ms(load)


def test_the_simulator_plans_for_the_engines_loop():
    """Overlapped by default, tensor-parallel engines too; synchronous with --no-async-scheduling."""
    opts = dict(model=str(MODELS / "llama-3.1-70b"))
    assert simulated_bench(BenchOptions(**opts), "h200")[0].predictor.host.overlapped
    assert not simulated_bench(BenchOptions(**opts, serve_args=["--no-async-scheduling"]),
                               "h200")[0].predictor.host.overlapped
    assert simulated_bench(BenchOptions(**opts, serve_args=["-tp", "2"]), "h200")[0].predictor.host.overlapped
    assert not simulated_bench(BenchOptions(**opts, serve_args=["-tp", "2", "--no-async-scheduling"]),
                               "h200")[0].predictor.host.overlapped
