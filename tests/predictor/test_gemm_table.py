"""GEMM row buckets: the sizes, the cheapest bucket a prefill is padded to, the time the solo model reads, the fit of
a prefill whose GEMM time is a spiky staircase, and the profile file that carries the table."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from appliance.errors import ConfigError
from appliance.predictor.gemm_table import GemmTable, bucket_sizes
from appliance.predictor.profile import build_profile, read_profile, save_profile
from appliance.predictor.shapes import DecodeLoad, PrefillItem, Sample
from appliance.predictor.solo import fit_error, fit_solo
from tests.predictor.test_predictor_models import LLAMA_8B

# one layer's GEMMs on 20 SMs of an H200 (ms), measured at 128..1280 rows (docs/data/diagnosis-h200-2026-11-22)
H200_20 = [0.56, 1.15, 0.77, 0.89, 0.97, 1.25, 2.07, 1.34, 1.34, 1.55, 2.33, 2.89, 1.73, 3.47, 3.87, 2.18, 2.51,
           2.46, 2.61, 2.60, 2.60, 3.23, 4.31, 2.96, 4.32, 3.18, 3.25, 3.39, 3.40, 3.69, 3.80, 3.72, 3.80, 4.22,
           4.26, 4.41, 4.30]
ROWS = tuple(range(128, 1281, 32))


def test_bucket_sizes_are_fine_below_512_rows_then_16_per_octave():
    sizes = bucket_sizes(8192)
    assert sizes[:3] == (32, 64, 96) and sizes[-1] == 8192
    assert all(b - a == 32 for a, b in zip(sizes, sizes[1:]) if b <= 1024)
    assert all((b - a) / a <= 1 / 16 for a, b in zip(sizes, sizes[1:]) if a >= 512)
    assert len(sizes) == 32 + 16 * 3  # 32..1024 by 32, then 16 in each of three octaves
    assert bucket_sizes(1000)[-1] == 1024 and bucket_sizes(1)[-1] == 32


def test_a_prefill_is_padded_to_the_cheapest_bucket_at_or_above_it():
    table = GemmTable(ROWS, {20: tuple(H200_20)})
    assert table.padded_rows(445, 20) == 512  # 448 (2.33 ms) and 480 (2.89) cost more than 512 (1.73)
    assert table.padded_rows(416, 20) == 416 and table.gemm_ms(416, 20) == pytest.approx(1.55)
    assert table.padded_rows(1, 20) == 128
    assert table.padded_rows(545, 20) == 608 and table.gemm_ms(545, 20) == pytest.approx(2.18)
    assert table.padded_rows(445, 52) == 445  # a partition the table does not have: no padding
    assert table.padded_rows(2000, 20) == 2000  # beyond the largest bucket
    assert table.gemm_ms(2560, 20) == pytest.approx(4.30 * 2)  # scaled by the rows
    assert table.gemm_ms(0, 20) == 0.0
    # what the executor runs never costs more than a larger batch: the padded time is monotone in the tokens
    times = [table.gemm_ms(n, 20) for n in range(1, 1400)]
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert all(table.gemm_ms(n, 20) <= H200_20[ROWS.index(-(-n // 32) * 32)] for n in range(128, 1281))


def test_launches_that_run_as_graphs_pad_only_within_the_graph_sizes():
    table = GemmTable(ROWS, {20: tuple(H200_20)}, graph_rows=480)
    assert table.graph_sizes() == tuple(range(128, 481, 32))
    # 445 tokens: 512 rows (1.73 ms) would be cheaper, but 445 tokens run as a graph of 448 or 480 rows
    assert table.padded_rows(445, 20) == 448 and table.gemm_ms(445, 20) == pytest.approx(2.33)
    assert table.padded_rows(481, 20) == 512  # past the graphs: the cheapest bucket, as before
    assert table.padded_rows(300, 20) == 352 and table.padded_rows(1, 20) == 128
    assert all(table.padded_rows(n, 20) in table.graph_sizes() for n in range(1, 481))
    assert all(table.padded_rows(n, 20) > 480 for n in range(481, 1281))
    back = GemmTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert back == table and back.padded_rows(445, 20) == 448
    # the engine takes the table with its own graph size (dataclasses.replace): the original keeps its padding
    other = dataclasses.replace(table, graph_rows=0)
    assert other.padded_rows(445, 20) == 512 and table.padded_rows(445, 20) == 448
    assert GemmTable.from_dict({"rows": [32], "ms": {"20": [1.0]}}).graph_rows == 0  # a table from before graphs


@pytest.mark.parametrize("graph_rows", [0, 480, 1280])
def test_only_the_buckets_some_launch_pads_to_need_a_graph(graph_rows):
    """A split partition captures prefill graphs at its pad targets alone: every launch pads to one of them, and a
    bucket slower than a larger one (448 and 480 rows on 20 SMs, past the graphs' edge) is none."""
    table = GemmTable(ROWS, {20: tuple(H200_20)}, graph_rows=graph_rows)
    targets = table.pad_targets(20)
    assert {table.padded_rows(n, 20) for n in range(1, 1281)} == set(targets)
    if graph_rows != 480:
        assert 448 not in targets and 480 not in targets and 512 in targets
    assert len(targets) < len(ROWS)
    assert table.pad_targets(52) == ROWS  # a partition the table does not have: every bucket


@pytest.mark.parametrize("rows, ms, message", [
    ((), {}, "ascending"),
    ((64, 32), {20: (1.0, 2.0)}, "ascending"),
    ((32, 64), {20: (1.0,)}, "1 times for 2"),
    ((32, 64), {20: (1.0, 0.0)}, "<= 0"),
])
def test_a_bad_table_is_refused(rows, ms, message):
    with pytest.raises(ValueError, match=message):
        GemmTable(rows, ms)


def spiky_samples(rng: np.random.Generator, table: GemmTable, count: int, sms: int = 20) -> list[Sample]:
    """A prefill that pays 32 layers of the table's GEMMs beside smooth attention and per-token terms."""
    samples = []
    for _ in range(count):
        item = PrefillItem(int(rng.integers(100, 1280)), int(rng.integers(0, 4096)))
        ms = 32 * table.gemm_ms(item.new, sms) + 2e-6 * item.new ** 2 + 1e-6 * item.new * item.reused \
            + 2e-3 * item.new + 3.0
        samples.append(Sample("prefill", sms, ms, prefill=(item,)))
    for bs in (1, 4, 16, 64):
        load = DecodeLoad(bs, bs * 1000)
        samples.append(Sample("decode", sms, 1e-4 * load.reused_tokens + 0.02 * bs + 5.0, decode=load))
    return samples


def test_the_solo_fit_reads_the_gemm_table_and_follows_its_spikes():
    table = GemmTable(ROWS, {20: tuple(H200_20)})
    rng = np.random.default_rng(1)
    fit, held = spiky_samples(rng, table, 60), spiky_samples(rng, table, 200)
    linear = fit_error(fit_solo(fit), held)
    model = fit_solo(fit, gemm=table)
    assert len(model.prefill[20]) == 6 and model.prefill[20][5] == pytest.approx(32, rel=0.02)
    assert fit_error(model, held).prefill_max < 0.01 < 0.1 < linear.prefill_max
    # the composed mixed estimate (no mixed samples) counts the GEMMs of the prefill and decode rows
    item = (PrefillItem(400, 0),)
    assert model.mixed_ms(item, DecodeLoad(12, 12000), 20) > model.prefill_ms(item, 20)


def test_a_profile_carries_its_gemm_table_and_refuses_a_coefficient_without_it(tmp_path):
    table = GemmTable(ROWS, {20: tuple(H200_20)})
    samples = spiky_samples(np.random.default_rng(2), table, 40)
    profile = build_profile(samples, model_name="llama", model=LLAMA_8B, gpu_name="NVIDIA H200", sm_count=132,
                            decode_partitions=[112], gemm=table)
    path = tmp_path / "p.json"
    save_profile(profile, path)
    predictor = read_profile(path).predictor(LLAMA_8B.num_layers, "profile")
    assert predictor.gemm == table
    items = (PrefillItem(445, 100),)
    assert predictor.prefill_solo_ms(items, 20) == pytest.approx(fit_solo(samples, gemm=table).prefill_ms(items, 20))
    raw = json.loads(path.read_text())
    raw["gemm"] = None
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="prefill.*GEMM coefficient.*no GEMM times"):
        read_profile(path)
    raw["gemm"] = {"rows": [64, 32], "ms": {"20": [1.0, 2.0]}}
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="field gemm: .*ascending"):
        read_profile(path)
