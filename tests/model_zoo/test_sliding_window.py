"""Sliding-window attention is not implemented, so a model whose window is shorter than the context it would be
served with is refused, naming the field and its value; a window that covers the context is served exactly, and
vLLM's --disable-sliding-window makes the window the default context."""
from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_checkpoint

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.errors import ConfigError, ModelLoadError, RequestError
from appliance.model_zoo.config import ModelConfig

PROMPT = [1] + [(7 * i + 3) % 250 + 3 for i in range(36)]  # the 37-token prompt that went wrong with a window of 8


@pytest.fixture(scope="module")
def window_of_8(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-window-8")
    return path, build_tiny_checkpoint("mistral", path, sliding_window=8)


def test_mistral_with_a_short_window_is_refused(window_of_8):
    path, _ = window_of_8
    with pytest.raises(ConfigError, match=r"config\.json field 'sliding_window' is 8\b.*--max-model-len 8"):
        build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    # `muxd serve` says so before it starts loading
    with pytest.raises(ConfigError, match=r"'sliding_window' is 8\b.*context of 512 tokens"):
        Config.flat(model=str(path)).check()
    with pytest.raises(ConfigError, match=r"'sliding_window' is 8\b.*context of 9 tokens"):
        build_engine(Config.flat(model=path, num_gpu_blocks_override=64, max_model_len=9))


def test_a_context_within_the_window_is_served_exactly(window_of_8):
    """With --max-model-len at the window, no query ever reaches past it: the output is the model's."""
    path, hf = window_of_8
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, max_model_len=8))
    prompt = PROMPT[:5]
    [done] = engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert done.token_ids == ref
    with pytest.raises(RequestError, match="context is 8 tokens"):
        engine.generate(PROMPT, SamplingParams(max_tokens=3))



def test_disable_sliding_window_serves_the_window_as_the_context(window_of_8):
    """vLLM's --disable-sliding-window: without --max-model-len the context is the window, as vLLM caps it; a longer
    --max-model-len is still refused."""
    path, _ = window_of_8
    cfg = Config.flat(model=str(path), disable_sliding_window=True, num_gpu_blocks_override=64)
    cfg.check()  # (`muxd serve`'s check before loading)
    engine = build_engine(cfg)
    assert engine.max_model_len == 8
    [done] = engine.generate(PROMPT[:5], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(done.token_ids) == 3
    with pytest.raises(ConfigError, match=r"'sliding_window' is 8\b.*context of 9 tokens"):
        build_engine(Config.flat(model=path, disable_sliding_window=True, num_gpu_blocks_override=64,
                                 max_model_len=9))


def test_mistral_window_covering_the_context_matches_transformers(tmp_path):
    hf = build_tiny_checkpoint("mistral", tmp_path, sliding_window=512, max_position_embeddings=512)
    engine = build_engine(Config.flat(model=tmp_path, num_gpu_blocks_override=64))
    assert engine.max_model_len == 512 and engine.model.config.sliding_window == 512
    [done] = engine.generate(PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert done.token_ids == ref


BASE = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 4,
        "num_attention_heads": 4, "max_position_embeddings": 32768}


@pytest.mark.parametrize("arch, fields, window", [
    ("MistralForCausalLM", {}, 4096),                               # MistralConfig's default when absent
    ("MistralForCausalLM", {"sliding_window": None}, None),         # Mistral 7B v0.2 / v0.3
    ("MistralForCausalLM", {"sliding_window": 4096}, 4096),         # Mistral 7B v0.1
    ("LlamaForCausalLM", {"sliding_window": 16}, None),             # Llama attention has no window
    ("Qwen2ForCausalLM", {"sliding_window": 131072, "use_sliding_window": False}, None),  # Qwen2.5 as shipped
    ("Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 4}, None),
    ("Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, 64),
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 64,
                          "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, 64),
])
def test_window_is_read_as_transformers_builds_the_model(arch, fields, window):
    cfg = ModelConfig.from_dict({"architectures": [arch], **BASE, **fields})
    assert cfg.sliding_window == window
    if window is not None:
        with pytest.raises(ConfigError, match=f"'sliding_window' is {window}"):
            cfg.check_max_model_len(cfg.max_model_len)
        cfg.check_max_model_len(window)


def test_malformed_window_names_the_field():
    with pytest.raises(ModelLoadError, match=r"'sliding_window' is 'wide'"):
        ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], **BASE, "sliding_window": "wide"})
