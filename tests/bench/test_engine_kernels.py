"""`muxd bench engine --kernels`: the decode step's kernels by name and by role from the profiler's events (the GPU
run itself is in tests/gpu/run_all.sh); the aggregation, the roles and their floors, the table and the flag's errors,
on the CPU."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from appliance.bench.engine_bench import EngineBenchResult, Kernels, device_events, kernel_rows, render
from appliance.bench.kernel_roles import ATTENTION, LM_HEAD, OTHER, PROJECTIONS, by_role, kind, weight_floors
from appliance.cli.main import app
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.llama import DecoderForCausalLM

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
QKV, O, GATE_UP, DOWN = PROJECTIONS


def test_kernels_are_summed_by_name_per_step_heaviest_first():
    events = [("gemm", 0.3), ("norm", 0.01), ("gemm", 0.3), ("attn", 0.05), ("norm", 0.01), ("rope", 0.02)] * 4
    rows = kernel_rows(events, steps=4, top=2)
    assert [r.name for r in rows] == ["gemm", "attn", "(2 other kernels)"]
    assert (rows[0].launches, rows[0].ms) == (2, pytest.approx(0.6))
    assert (rows[2].launches, rows[2].ms) == (3, pytest.approx(0.04))  # norm twice and rope once a step


def test_device_events_are_the_profilers_device_side_ones_in_the_order_they_started():
    def event(name, device, us, start):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us, start=start))

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [event("cudaGraphLaunch", cpu, 40.0, 0), event("Memcpy HtoD", cuda, 2.0, 900),
              event("gemm", cuda, 300.0, 500)]
    assert device_events(events) == [("gemm", 0.3), ("Memcpy HtoD", 0.002)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # the real event type
        torch.ones(8) @ torch.ones(8)
    assert prof.events() and device_events(prof.events()) == []


def test_the_table_shows_the_gaps_between_kernels():
    result = EngineBenchResult({"device": "GPU", "copy_TBps": 3.0, "gemm_TFLOPps": 700.0}, "m", {})
    result.kernels.append(Kernels("decode b=1 ctx=1024", 6.5, kernel_rows([("gemm", 5.0), ("attn", 0.5)], 1)))
    table = render(result)
    assert "kernels of decode b=1 ctx=1024: 2 a step, 5.50 ms of them in a 6.50 ms replay (between them: 1.00 ms)" \
        in table
    assert "| `gemm` | 1 | 5.000 | 76.9 % |" in table
    assert result.to_json()["kernels"][0]["kernel_ms"] == pytest.approx(5.5)


@pytest.mark.parametrize("value, message", [("64", "BATCH@CONTEXT"), ("0@1024", "positive"), ("a@b", "BATCH@CONTEXT")])
def test_a_bad_kernels_flag_is_named_before_anything_starts(value, message):
    result = CliRunner().invoke(app, ["bench", "engine", "--kernels", value])
    assert result.exit_code == 2 and message in result.output


def _step(layers: int, one_row: bool | str) -> list[tuple[str, float]]:
    """The kernels of one decode step as they run, with the names an H200 showed at 1 and 64 rows (at one row,
    muxd's Triton decode attention; at 64, flashinfer's); one_row="row product": one row's kernels as they are named
    since the layers write the one-row product themselves (`row_product`), not Inductor's decomposition."""
    attention = [("void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits>", 0.009),
                 ("void flashinfer::PersistentVariableLengthMergeStatesKernel<8u>", 0.0025)]  # 64 rows
    if one_row:  # Inductor's fused matrix-vector reductions; the rotary kernels carry the QKV matmul's name
        attention = [("decode_partial", 0.009), ("decode_merge", 0.0025)]
        norm, qkv, rope = "triton_red_fused__to_copy_add_mean_pow_0", \
            "triton_red_fused__to_copy_add_mean_mm_mul_pow_rsqrt_t_1", \
            "triton_poi_fused__to_copy_add_cat_cos_mm_mul_neg_paged_attention_sin_split_2"
        o, gate_up, down = "triton_red_fused_add_mm_t_view_5", \
            "triton_red_fused__to_copy_add_mean_mm_mul_pow_rsqrt_t_7", "triton_red_fused_mm_mul_silu_split_t_8"
        if one_row == "row product":
            qkv = "triton_red_fused__to_copy_add_mean_mul_pow_rope_paged_attention_rsqrt_sum_t_unsqueeze_1"
            rope = "triton_red_fused__to_copy_mean_pow_3"
            o, gate_up, down = "triton_red_fused__to_copy_add_mul_sum_t_unsqueeze_view_2", \
                "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_sum_t_unsqueeze_4", \
                "triton_red_fused__to_copy_mul_silu_split_sum_t_unsqueeze_5"
        after_down = []
    else:
        norm, qkv, rope = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", \
            "nvjet_sm90_tst_64x64_64x13_4x1_v_bz_TNT", "triton_poi_fused__to_copy_add_cat_cos_mul_neg_paged_attention_3"
        o, gate_up, down = "nvjet_sm90_tst_64x32_64x16_1x2_h_badd_TNT", "nvjet_sm90_tst_256x64_64x5_4x1_v_bz_TNT", \
            "nvjet_sm90_tst_96x64_64x10_2x1_v_bz_splitK_TNN"
        after_down = [("void cublasLt::splitKreduce_kernel<32, 16, int, float>", 0.002)]
    events = [("void at::native::indexSelectLargeIndex<c10::BFloat16>", 0.003)]
    for _ in range(layers):
        events += [(norm, 0.002), (qkv, 0.018), (rope, 0.001), (rope, 0.001), ("write_kv_kernel", 0.001)] + \
            attention + [(o, 0.011), (norm, 0.002), (gate_up, 0.056), (down, 0.030)] + after_down
    return events + [("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT", 0.24),
                     ("void at::native::reduce_kernel<argmax>", 0.004)]


@pytest.mark.parametrize("one_row", [True, "row product", False])
def test_kernels_are_attributed_to_roles_by_their_order_in_the_step(one_row):
    floors = {QKV: 0.38, O: 0.25, GATE_UP: 1.78, DOWN: 0.89, LM_HEAD: 0.25, ATTENTION: 0.03}
    rows = {r.role: r for r in by_role(_step(32, one_row) * 3, steps=3, num_layers=32, floors_ms=floors)}
    assert list(rows) == [QKV, ATTENTION, O, GATE_UP, DOWN, LM_HEAD, OTHER]
    assert (rows[QKV].launches, rows[QKV].ms) == (32, pytest.approx(32 * 0.018))
    assert rows[GATE_UP].ms == pytest.approx(32 * 0.056) and rows[O].ms == pytest.approx(32 * 0.011)
    split_k = 0 if one_row else 0.002
    assert (rows[DOWN].launches, rows[DOWN].ms) == (32 * (1 if one_row else 2), pytest.approx(32 * (0.030 + split_k)))
    assert (rows[ATTENTION].launches, rows[ATTENTION].ms) == (64, pytest.approx(32 * 0.0115))
    assert (rows[LM_HEAD].launches, rows[LM_HEAD].ms) == (1, pytest.approx(0.24))
    # norms twice a layer, rotary twice, the K/V write; the embedding and the argmax once a step
    assert (rows[OTHER].launches, rows[OTHER].ms) == (32 * 5 + 2, pytest.approx(32 * 0.007 + 0.007))
    assert rows[OTHER].floor_ms is None and rows[OTHER].ratio is None
    assert rows[QKV].ratio == pytest.approx(32 * 0.018 / 0.38)
    assert kind("void cublasLt::splitKreduce_kernel<32>") == "split-k"


def test_each_of_muxds_decode_attention_kernels_is_attention():
    pytest.importorskip("triton")
    from appliance.attention import triton_decode_kernels

    names = [n for n in vars(triton_decode_kernels) if n.startswith("decode_")]
    assert {"decode_partial", "decode_partial_rope", "decode_merge", "decode_balanced"} <= set(names)
    assert {kind(n) for n in names} == {ATTENTION}


def test_a_step_whose_matmuls_do_not_count_four_a_layer_gets_no_roles():
    events = _step(32, one_row=False)
    events.insert(3, ("sm90_xmma_gemm_bf16bf16_bf16f32", 0.01))  # a fifth matmul in layer 0
    found = by_role(events, steps=1, num_layers=32, floors_ms={})
    assert isinstance(found, str) and "130 matmul kernels in 1 steps, not 129 a step" in found


def test_each_roles_floor_is_its_weights_bytes_over_the_copy_bandwidth():
    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-8b" / "config.json")
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg).to(torch.bfloat16)
    copy = 4e12
    floors = weight_floors(model.model.layers, 128256 * 4096 * 2, kv_bytes=64 * 1024 * 131072, copy_bytes_per_s=copy)
    per_layer = {QKV: 4096 * 6144, O: 4096 * 4096, GATE_UP: 4096 * 2 * 14336, DOWN: 14336 * 4096}
    for role, params in per_layer.items():
        assert floors[role] == pytest.approx(32 * params * 2 / copy * 1e3)
    assert floors[LM_HEAD] == pytest.approx(128256 * 4096 * 2 / copy * 1e3)
    assert floors[ATTENTION] == pytest.approx(64 * 1024 * 131072 / copy * 1e3)


def test_the_table_shows_the_roles_and_the_gaps():
    result = EngineBenchResult({"device": "GPU", "copy_TBps": 3.0, "gemm_TFLOPps": 700.0}, "m", {})
    events = _step(2, one_row=False)
    floors = {QKV: 0.02, O: 0.01, GATE_UP: 0.1, DOWN: 0.05, LM_HEAD: 0.2, ATTENTION: 0.01}
    result.kernels.append(Kernels("decode b=64 ctx=1024", 0.6, kernel_rows(events, 1),
                                  by_role(events, 1, 2, floors)))
    result.kernels.append(Kernels("decode b=1 ctx=1024", 0.6, kernel_rows(events, 1), "no roles here"))
    table = render(result)
    assert "| QKV projection | 2 | 0.036 | 0.020 | 1.80x |" in table
    assert "| down projection | 4 | 0.064 | 0.050 | 1.28x |" in table
    assert "| other kernels | 12 | 0.021 |  |  |" in table
    assert "| between kernels | | 0.082 | | |" in table  # a 0.6 ms replay, 0.518 ms of kernels
    assert "by role: no roles here" in table
    assert result.to_json()["kernels"][0]["roles"][0]["role"] == QKV


def test_a_bad_log_level_is_named_before_anything_starts():
    result = CliRunner().invoke(app, ["bench", "engine", "--log-level", "loud"])
    assert result.exit_code == 2 and "--log-level 'loud'" in result.output
