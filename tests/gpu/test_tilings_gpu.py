"""A tilings table on the GPU (engine/tilings.py): made from a tuned cache, it fixes the single-token graph of a
fresh start (every kernel of the table compiles, nothing is tuned) and decodes as the tuning did."""
from __future__ import annotations

import json

from copy_model import periodic_prompt
from test_fast_path import GREEDY, fast

from appliance.engine import tilings


def _start(copy_model, cache, setting, monkeypatch):
    for var, path in (("MUXD_CACHE_DIR", cache), ("TORCHINDUCTOR_CACHE_DIR", cache / "inductor"),
                      ("TRITON_CACHE_DIR", cache / "triton")):
        monkeypatch.setenv(var, str(path))
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
