"""A tilings table on the GPU (engine/tilings.py): made from a tuned cache, it fixes the single-token graph of a
fresh start (every kernel of the table compiles, nothing is tuned) and decodes as the tuning did."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from copy_model import periodic_prompt
from test_fast_path import GREEDY, fast

from appliance.config import Config
from appliance.engine import tilings
from appliance.engine.factory import build_engine


def _use_cache(cache, monkeypatch):
    """Every compile cache of the process under `cache` (a fresh directory: a cold start)."""
    for var, path in (("MUXD_CACHE_DIR", cache), ("TORCHINDUCTOR_CACHE_DIR", cache / "inductor"),
                      ("TRITON_CACHE_DIR", cache / "triton")):
        monkeypatch.setenv(var, str(path))


def _start(copy_model, cache, setting, monkeypatch):
    _use_cache(cache, monkeypatch)
    monkeypatch.setenv(tilings.ENV, setting)
    return fast(copy_model)


def test_a_table_fixes_the_single_token_graph(copy_model, tmp_path, monkeypatch):
    prompts = [periodic_prompt(seed, 30 + 5 * seed) for seed in range(3)]
    tuned = _start(copy_model, tmp_path / "tuned", "tune", monkeypatch)
    try:
        assert tuned.startup["single_token_tilings"]["source"] == "tuned"
        expected = [tuned.generate(p, GREEDY)[0].token_ids for p in prompts]  # one row: the single-token graph
    finally:
        tuned.close()
    kernels = tilings.tuned_kernels(tmp_path / "tuned" / "inductor")
    assert kernels, "coordinate descent tuned no kernel of the single-token graph"
    key = {k: v for k, v in tuned.startup["single_token_tilings"].items() if k not in ("source", "kernels")}
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"key": key, "kernels": kernels}))

    fixed = _start(copy_model, tmp_path / "fixed", str(table), monkeypatch)
    try:
        assert fixed.startup["single_token_tilings"]["source"] == f"file {table}"
        assert fixed.startup["single_token_tilings"]["kernels"] == len(kernels)
        assert [fixed.generate(p, GREEDY)[0].token_ids for p in prompts] == expected
        assert fixed.runner.graphs.replays > 0
    finally:
        fixed.close()
    assert set(kernels) <= tilings.kernel_hashes(tmp_path / "fixed" / "inductor")  # the same kernels compiled
    assert tilings.tuned_kernels(tmp_path / "fixed" / "inductor") == {}  # and none was tuned


SHIPPED = sorted(tilings.SHIPPED.glob("*.json"))


@pytest.mark.parametrize("table_file", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_a_shipped_table_still_names_the_kernels_muxd_compiles(table_file, tmp_path, monkeypatch):
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
    _use_cache(tmp_path, monkeypatch)
    monkeypatch.delenv(tilings.ENV, raising=False)
    engine = build_engine(Config.flat(model=str(model), load_format="dummy", device="cuda", max_model_len=2048,
                                      max_num_seqs=1, num_gpu_blocks_override=256, compile=True, cuda_graph=True))
    try:
        assert engine.startup["single_token_tilings"]["source"] == f"shipped {table_file.stem}"
        assert len(engine.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids) == GREEDY.max_tokens
    finally:
        engine.close()
    compiled = tilings.kernel_hashes(tmp_path / "inductor")
    missing = set(table["kernels"]) - compiled
    assert not missing, f"{len(missing)} of {len(table['kernels'])} table kernels were not compiled"
