"""Regional torch.compile on CPU: one compiled layer serves every layer and token count (no recompilation per layer),
and the compiled model generates the same greedy tokens as eager."""
from __future__ import annotations

import os

import torch
from tiny_models import build_tiny_checkpoint
from torch._dynamo.utils import counters

from appliance.config import Config
from appliance.engine.compile import _torch_default_inductor_dir, use_cache_dirs
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams


def test_compile_caches_go_to_muxds_cache_directory_unless_chosen(tmp_path, monkeypatch):
    """Importing torch._dynamo (this module did) sets TORCHINDUCTOR_CACHE_DIR to torch's default: that one moves under
    muxd's cache directory (where a container keeps it); a directory the user set stays, for Triton's cache too."""
    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path / "cache"))
    default = _torch_default_inductor_dir()
    assert default is not None
    for before in (default, None):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
        use_cache_dirs()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    use_cache_dirs()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "my-triton")


def test_compiled_layers_are_shared_and_match_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path / "cache"))
    # whatever compile_layers sets them to is undone after the test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    monkeypatch.delenv("TRITON_CACHE_DIR")
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
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
