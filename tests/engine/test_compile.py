"""Regional torch.compile on CPU: one compiled layer serves every layer and token count (no recompilation per layer),
and the compiled model generates the same greedy tokens as eager."""
from __future__ import annotations

import torch
from tiny_models import build_tiny_checkpoint
from torch._dynamo.utils import counters

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams


def test_compiled_layers_are_shared_and_match_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path / "cache"))
    build_tiny_checkpoint("qwen3", tmp_path, num_layers=8)
    torch._dynamo.reset()
    counters.clear()
    compiled = build_engine(Config.flat(model=tmp_path, num_gpu_blocks_override=64, compile=True))
    eager = build_engine(Config.flat(model=tmp_path, num_gpu_blocks_override=64))
    assert compiled.compiled and not eager.compiled
    prompts = [[1, 5, 7, 9, 11, 13], list(range(3, 40)), [4]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [c.token_ids for c in compiled.generate(prompts, params)] == \
        [c.token_ids for c in eager.generate(prompts, params)]
    # first layer (no residual yet) and the rest, each for one token and for a symbolic count: 8 layers, 4 graphs
    assert counters["stats"]["unique_graphs"] == 4
    assert (tmp_path / "cache" / "inductor").is_dir()
