"""Engine construction: KV-cache sizing and configuration errors."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from appliance.config import Config, default_graph_rows
from appliance.engine.factory import build_engine
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig


def test_pool_is_capped_at_what_max_num_seqs_full_requests_need(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, kv_cache_memory=1 << 40, max_num_seqs=2,
                                      max_model_len=64))
    assert engine.pool.num_pages == 2 * 2 * (64 // 16)
    assert engine.kv_cache.data.shape[2] == engine.pool.num_pages + 1  # + the scratch page


def test_kv_cache_size_is_logged_as_vllm_words_it(llama_checkpoint, caplog):
    path, _ = llama_checkpoint
    with caplog.at_level(logging.INFO, logger="muxd.engine"):
        build_engine(Config.flat(model=path, num_gpu_blocks_override=100, max_model_len=320))
    lines = [r.getMessage() for r in caplog.records]
    assert "CPU KV cache size: 1,600 tokens" in lines  # 100 pages of 16
    assert "Maximum concurrency for 320 tokens per request: 5.00x" in lines


def test_pool_from_memory_budget(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, kv_cache_memory=1 << 20))
    per_page = engine.kv_cache.data[:, :, 0].numel() * engine.kv_cache.data.element_size()
    assert engine.pool.num_pages == (1 << 20) // per_page
    assert engine.max_model_len == min(512, engine.pool.num_pages * 16)


@pytest.mark.parametrize("settings, message", [
    (dict(kv_cache_memory=10), "holds no page"),
    (dict(num_gpu_blocks_override=4, max_model_len=100), "max_model_len 100 exceeds"),
    (dict(policy="fifo"), "--policy .* must be one of"),
    (dict(max_num_seqs=0), "--max-num-seqs must be >= 1"),
    (dict(attention_backend="flash"), "--attention-backend must be one of"),
    (dict(decode_kernel="fast"), "--decode-kernel must be one of auto, flashinfer, triton, got 'fast'"),
    (dict(decode_blas="cutlass"), "--decode-blas must be one of cublaslt, cublas, got 'cutlass'"),
    (dict(partition_granularity=12), "multiple of 8"),
])
def test_bad_engine_config(llama_checkpoint, settings, message):
    path, _ = llama_checkpoint
    with pytest.raises(ConfigError, match=message):
        build_engine(Config.flat(model=path, **settings))


def test_unknown_setting_is_named():
    with pytest.raises(ConfigError, match="unknown setting 'planer'"):
        Config.flat(planer="mux")


@pytest.mark.parametrize("settings, rows", [
    (dict(), 2048),                                                  # auto (mux on a GPU), serial, layerwise, ...
    (dict(policy="mux"), 2048),
    (dict(policy="chunked"), 2048),                                  # its budget: --max-num-batched-tokens (8192)
    (dict(policy="chunked", chunk_budget=1024), 1024),               # every mixed step of the budget, no larger
    (dict(policy="chunked", chunk_budget=4096), 2048),
    (dict(policy="chunked", profile="some-profile.json"), 2048),     # the budget tuned at start-up: up to the cap
    (dict(policy="chunked", chunk_budget=1024, prefill_graph_rows=256), 256),  # as told
    (dict(policy="mux", prefill_graph_rows=0), 0),
])
def test_prefill_graph_rows_default_to_the_policys(settings, rows):
    """Chunked prefill's mixed steps replay piecewise graphs up to its budget (capped): launched eagerly they cost
    the host 3-4x as much; the other policies replay them up to 2048 rows unless told."""
    assert Config.flat(**settings).prefill_graph_rows() == rows


def _model(name: str) -> ModelConfig:
    return ModelConfig.from_file(Path(__file__).resolve().parents[2] / "configs" / "models" / name / "config.json")


@pytest.mark.parametrize("name, rows", [
    ("llama-3.1-8b", 2048), ("qwen3-8b", 2048), ("qwen2.5-7b", 2048), ("llama-3.1-70b", 2048),
    ("llama-3.2-1b", 4096), ("qwen2.5-0.5b", 16384),
])
def test_prefill_graph_rows_grow_as_a_layer_shrinks(name, rows):
    """A smaller layer takes the GPU less time at the same rows, so its prefill graphs reach further before an eager
    launch's host time hides behind the GPU: the largest power of two up to 2048 x (the 8B's layer / this one);
    the 8B's size or larger (one rank's share under tensor parallelism) keeps 2048."""
    model = _model(name)
    assert default_graph_rows(model) == rows
    assert Config.flat().prefill_graph_rows(model) == rows
    assert Config.flat().captured_graph_rows(model) == min(rows, 8192)  # never above a step's prefill tokens
    assert Config.flat(prefill_graph_rows=512).captured_graph_rows(model) == 512  # as told
    assert Config.flat(cuda_graph=False).captured_graph_rows(model) == 0
    assert Config.flat(policy="chunked", chunk_budget=1024).prefill_graph_rows(model) == 1024


def test_prefill_graph_rows_of_a_sharded_layer():
    """Under tensor parallelism each GPU runs its share of a layer: the 70B over 8 GPUs has a rank's layer half the
    8B's, so its graphs reach twice as far."""
    model = _model("llama-3.1-70b")
    assert default_graph_rows(model.sharded(2)) == 2048
    assert default_graph_rows(model.sharded(8)) == 4096
    assert default_graph_rows(None) == 2048


def test_negative_prefill_graph_rows_is_refused():
    with pytest.raises(ConfigError, match="--prefill-graph-rows must be >= 0"):
        Config.flat(prefill_graph_rows=-1)


@pytest.mark.parametrize("settings, sizes", [
    (dict(max_num_seqs=40), [1, 2, 4, 8, 16, 24, 32, 40]),
    (dict(max_num_seqs=40, max_graph_batch=12), [1, 2, 4, 8, 12]),
    (dict(max_num_seqs=40, cudagraph_capture_sizes=[16, 1, 4]), [1, 4, 16]),
])
def test_decode_graph_sizes_follow_the_capture_settings(llama_checkpoint, settings, sizes):
    """The decode batch sizes an engine captures as CUDA graphs (on a GPU; a CPU engine only sizes its token
    buffer by the largest): muxd's ladder up to --max-graph-batch, or vLLM's --cudagraph-capture-sizes as given."""
    from appliance.engine.factory import _Builder
    from appliance.model_zoo.loader import load_model

    path, _ = llama_checkpoint
    config = Config.flat(model=path, **settings)
    assert _Builder(config, load_model(path, device="cpu")).graph_sizes == sizes
    engine = build_engine(config)
    assert engine.max_graph_batch == sizes[-1]
    assert engine.runner.tokens.capacity == max(40, sizes[-1])
