"""Trace loaders on slices of the real traces and on malformed files; workload shaping (window, re-timing, clipping,
synthetic arrivals)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from appliance.errors import ConfigError
from appliance.workload import shaping as wl
from appliance.workload.traces import (
    MOONCAKE_BLOCK,
    RequestSpec,
    detect_format,
    load_azure,
    load_mooncake,
    load_sharegpt,
    load_trace,
)

DATA = Path(__file__).resolve().parents[1] / "data"
AZURE = DATA / "azure_code_2023_head200.csv"
MOONCAKE = DATA / "mooncake_conversation_head200.jsonl"


def triples(specs: list[RequestSpec]) -> list[tuple[float, int, int]]:
    return [(s.arrival, s.prompt_len, s.output_len) for s in specs]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_2023_slice():
    specs = load_azure(AZURE)
    assert len(specs) == 200
    assert specs[0] == RequestSpec(0.0, 4808, 10)
    # 18:17:03.9799600 -> 18:17:04.0319600 and -> 18:17:04.0781490, to the nanosecond
    assert specs[1].arrival == pytest.approx(0.052, abs=1e-9)
    assert specs[2].arrival == pytest.approx(0.098189, abs=1e-9)
    assert all(a.arrival <= b.arrival for a, b in zip(specs, specs[1:]))
    assert detect_format(AZURE) == "azure" and load_trace(AZURE) == specs


def test_azure_2024_schema_with_utc_offsets(tmp_path):
    path = write(tmp_path, "az24.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                       "2024-05-10 00:00:01+00:00,5,3\n"
                                       "2024-05-10 00:00:00.009930+00:00,10,2\n"
                                       "2024-05-10 02:00:02.5+02:00,7,1\n")
    assert triples(load_trace(path)) == [(0.0, 10, 2), (pytest.approx(0.99007), 5, 3),
                                         (pytest.approx(2.49007), 7, 1)]


def test_mooncake_slice_keeps_hash_ids_and_ms_times():
    specs = load_mooncake(MOONCAKE)
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    assert len(specs) == 200
    by_time = sorted(rows, key=lambda r: r["timestamp"])
    assert [s.hash_ids for s in specs] == [tuple(r["hash_ids"]) for r in by_time]
    assert specs[-1].arrival == pytest.approx((by_time[-1]["timestamp"] - by_time[0]["timestamp"]) / 1000)
    assert all(s.block_size == MOONCAKE_BLOCK for s in specs)
    assert detect_format(MOONCAKE) == "mooncake"


def test_burstgpt_drops_failed_rows(tmp_path):
    path = write(tmp_path, "burst.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                        "5,ChatGPT,472,18,490,Conversation log\n"
                                        "45,ChatGPT,1087,0,1087,Conversation log\n"
                                        "118,GPT-4,417,276,693,API log\n")
    assert detect_format(path) == "burstgpt"
    assert triples(load_trace(path)) == [(0.0, 472, 18), (113.0, 417, 276)]


def test_sharegpt_first_two_turns(tmp_path):
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "hello there"},
                                           {"from": "gpt", "value": "general kenobi, you are a bold one"}]},
             {"id": "b", "conversations": [{"from": "human", "value": "alone"}]},
             {"id": "c", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                           {"from": "human", "value": "more"}]}]
    path = write(tmp_path, "sg.json", json.dumps(convs, indent=1))
    specs = load_trace(path, count_tokens=lambda text: len(text.split()))
    assert detect_format(path) == "sharegpt"
    assert [(s.prompt, s.prompt_len, s.output_len, s.arrival) for s in specs] == [
        ("hello there", 2, 7, 0.0), ("q", 1, 1, 0.0)]
    assert load_sharegpt(path)[0].prompt_len == math.ceil(len("hello there") / 4)  # estimate without a tokenizer


@pytest.mark.parametrize("name, text, where", [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,2\n2023-11-16 18:17:04,x,2\n",
     ":3: ContextTokens must be an integer"),
    ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,2\n16/11/2023,10,2\n",
     ":3: TIMESTAMP '16/11/2023'"),
    ("c.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10\n", ":2: 2 fields where"),
    ("d.csv", "TIMESTAMP,Prompt,GeneratedTokens\n2023-11-16 18:17:03.97,10,2\n", ":1: the CSV header lacks"),
    ("e.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n{"timestamp": 5,\n',
     ":2: not valid JSON"),
    ("f.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n\n'
                '{"timestamp": 1, "input_length": 1100, "output_length": 2, "hash_ids": [0, 1]}\n',
     ":3: 2 hash_ids of 512 tokens cannot make a prompt of input_length=1100"),
    ("g.jsonl", '{"timestamp": -4, "input_length": 10, "output_length": 2}\n', ":1: timestamp must be"),
    ("h.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 0}\n', ":1: output_length must be"),
    ("i.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,m,5,2,7,x\nnow,m,5,2,7,x\n",
     ":3: Timestamp must be a number"),
    ("j.json", '[\n {"id": "a", "conversations": []},\n {"id": "b"}\n]', ":3: expected an object with a "
                                                                          "'conversations' list"),
    ("k.json", '[\n {"id": "a",\n  "conversations": [}\n]', ":3: not valid JSON"),
])
def test_malformed_files_name_the_line(tmp_path, name, text, where):
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as err:
        load_trace(path)
    assert f"{path}{where}" in str(err.value)


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot tell the trace format"):
        load_trace(write(tmp_path, "x.csv", "a,b,c\n1,2,3\n"))
    with pytest.raises(ConfigError, match="trace file not found"):
        load_trace(tmp_path / "none.csv")
    with pytest.raises(ConfigError, match="holds no request"):
        load_trace(write(tmp_path, "empty.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))


def test_window_skip_and_limit():
    specs = load_azure(AZURE)
    part = wl.select(specs, wl.parse_window("29:60"), skip=1, max_requests=5)
    inside = [s for s in specs if 29 <= s.arrival < 60]
    assert len(part) == 5 and part[0].arrival == 0.0
    assert [p.prompt_len for p in part] == [s.prompt_len for s in inside[1:6]]
    assert part[4].arrival == pytest.approx(inside[5].arrival - inside[1].arrival)
    with pytest.raises(ConfigError, match="--window"):
        wl.parse_window("60:30")
    with pytest.raises(ConfigError, match="no request"):
        wl.select(specs, (1e6, 2e6))


def test_retime_to_rate_and_speedup_is_exact():
    specs = wl.select(load_azure(AZURE), max_requests=50)
    at5 = wl.retime(specs, rate=5.0)
    assert wl.offered_rate(at5) == pytest.approx(5.0, rel=1e-12)
    assert at5[-1].arrival == pytest.approx(49 / 5.0, rel=1e-12)
    # the burst pattern is kept: every gap scaled by one factor
    scale = at5[-1].arrival / specs[-1].arrival
    assert [b.arrival for b in at5] == pytest.approx([s.arrival * scale for s in specs], rel=1e-12)
    assert [s.prompt_len for s in at5] == [s.prompt_len for s in specs]
    fast = wl.retime(specs, speedup=4.0)
    assert [f.arrival for f in fast] == [s.arrival / 4.0 for s in specs]
    assert all(s.arrival == 0.0 for s in wl.retime(specs, rate=math.inf))
    with pytest.raises(ConfigError, match="not both"):
        wl.retime(specs, rate=1.0, speedup=2.0)


def test_untimed_traces_get_gamma_arrivals():
    specs = [RequestSpec(0.0, 10, 5)] * 2000
    times = [s.arrival for s in wl.retime(specs, rate=20.0, seed=3)]
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.08)
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.1)  # exponential gaps (Poisson): std == mean
    regular = np.diff([s.arrival for s in wl.retime(specs[:10], rate=4.0, burstiness=math.inf)])
    assert regular == pytest.approx([0.25] * 9)


def test_clip_to_context_cuts_prompt_first_and_keeps_hash_prefix():
    specs = [RequestSpec(0, 7000, 10, hash_ids=tuple(range(14)), block_size=512), RequestSpec(0, 100, 4000),
             RequestSpec(0, 3000, 3000), RequestSpec(0, 50, 50)]
    clipped, n = wl.clip_to_context(specs, 2048)
    assert n == 3
    assert [(s.prompt_len, s.output_len) for s in clipped] == [(2038, 10), (100, 1948), (1024, 1024), (50, 50)]
    assert clipped[0].hash_ids == (0, 1, 2, 3)
    assert all(s.prompt_len + s.output_len <= 2048 for s in clipped)


def test_synthetic_lengths_and_rate():
    specs = wl.synthetic(400, 8.0, wl.LengthDist.parse("uniform:10:20"), wl.LengthDist.parse("lognormal:64:0.5"),
                         seed=1)
    assert all(10 <= s.prompt_len <= 20 for s in specs)
    assert np.median([s.output_len for s in specs]) == pytest.approx(64, rel=0.15)
    assert wl.offered_rate(specs) == pytest.approx(8.0, rel=0.15)
    assert specs == wl.synthetic(400, 8.0, wl.LengthDist.parse("uniform:10:20"),
                                 wl.LengthDist.parse("lognormal:64:0.5"), seed=1)
    assert [s.prompt_len for s in wl.synthetic(3, 1.0, wl.LengthDist.parse("7"), wl.LengthDist.parse("2"))] == [7] * 3
    for bad in ("uniform:5", "zipf:3", "0", "uniform:9:3"):
        with pytest.raises(ConfigError, match="--input-len"):
            wl.LengthDist.parse(bad, "--input-len")
