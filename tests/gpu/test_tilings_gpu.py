"""A tilings table on the GPU (engine/tilings.py): made from a tuned cache, it fixes the single-token graph of a
fresh start (every kernel of the table compiles, nothing is tuned) and decodes as the tuning did."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import fresh_start
from copy_model import periodic_prompt
from test_fast_path import FAST, GREEDY

from appliance.engine import tilings


def _start(copy_model, cache, setting, prompts):
    """A cold start of the copy model's fast engine in a process of its own, with tilings `setting`."""
    spec = {"config": {"model": str(copy_model), **FAST}, "prompts": prompts, "max_tokens": GREEDY.max_tokens}
    return fresh_start.run(spec, cache, {tilings.ENV: setting})


def test_a_table_fixes_the_single_token_graph(copy_model, tmp_path):
    prompts = [periodic_prompt(seed, 30 + 5 * seed) for seed in range(3)]
    tuned = _start(copy_model, tmp_path / "tuned", "tune", prompts)  # one row: the single-token graph
    assert tuned["startup"]["single_token_tilings"]["source"] == "tuned"
    kernels = tilings.tuned_kernels(tmp_path / "tuned" / "inductor")
    assert kernels, "coordinate descent tuned no kernel of the single-token graph"
    key = {k: v for k, v in tuned["startup"]["single_token_tilings"].items() if k not in ("source", "kernels")}
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"key": key, "kernels": kernels}))

    fixed = _start(copy_model, tmp_path / "fixed", str(table), prompts)
    assert fixed["startup"]["single_token_tilings"]["source"] == f"file {table}"
    assert fixed["startup"]["single_token_tilings"]["kernels"] == len(kernels)
    assert fixed["outputs"] == tuned["outputs"]
    assert fixed["replays"] > 0
    assert set(kernels) <= tilings.kernel_hashes(tmp_path / "fixed" / "inductor")  # the same kernels compiled
    assert tilings.tuned_kernels(tmp_path / "fixed" / "inductor") == {}  # and none was tuned


SHIPPED = sorted(tilings.SHIPPED.glob("*.json"))


@pytest.mark.parametrize("table_file", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_a_shipped_table_still_names_the_kernels_muxd_compiles(table_file, tmp_path):
    """Where a shipped table's GPU, torch and Triton are this machine's, a fresh start of its model (dummy weights)
    takes the table, and every kernel the table tiles is among those Inductor compiled: a change to the layers'
    code that changes the kernels' source would leave the table applying to nothing."""
    import torch
    import triton

    table = tilings.load(table_file)
    here = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if any(table["key"][k] != v for k, v in here.items()):
        pytest.skip(f"{table_file.name} is for {table['key']}, this machine is {here}")
    model = Path(__file__).resolve().parents[2] / "configs" / "models" / table_file.stem.rsplit("-", 1)[0]
    spec = {"config": {"model": str(model), "load_format": "dummy", "device": "cuda", "max_model_len": 2048,
                       "max_num_seqs": 1, "num_gpu_blocks_override": 256, "compile": True, "cuda_graph": True},
            "prompts": [[5, 6, 7, 8]], "max_tokens": GREEDY.max_tokens}
    started = fresh_start.run(spec, tmp_path, {tilings.ENV: ""})
    assert started["startup"]["single_token_tilings"]["source"] == f"shipped {table_file.stem}"
    assert len(started["outputs"][0]) == GREEDY.max_tokens
    compiled = tilings.kernel_hashes(tmp_path / "inductor")
    missing = set(table["kernels"]) - compiled
    assert not missing, f"{len(missing)} of {len(table['kernels'])} table kernels were not compiled"
