"""Shared fixtures: tiny random checkpoints of each supported family, built with transformers on CPU."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

# tiny models gain nothing from intra-op threads, and CI machines have two cores shared with the server under test
torch.set_num_threads(1)

FAMILIES = {
    # Llama-3.1 style: GQA and llama3 rope scaling (short original context so the scaling matters)
    "llama": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", extra=dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        rope_theta=500000.0)),
    # Qwen2.5 small: qkv bias, tied embeddings
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", extra=dict(tie_word_embeddings=True,
                                                                          rope_theta=1000000.0)),
    # Qwen3: q/k RMSNorm, explicit head_dim different from hidden / heads
    "qwen3": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config", extra=dict(head_dim=32, rope_theta=1000000.0)),
}


def build_tiny_checkpoint(family: str, path: Path, vocab_size: int = 256, num_layers: int = 4, seed: int = 0,
                          dtype: torch.dtype = torch.float32):
    """Save a random tiny model of `family` in Hugging Face layout; returns the transformers model (eval, fp32)."""
    import transformers

    spec = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, spec["cfg"])(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, **spec["extra"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, spec["cls"])(cfg).eval()
        if dtype != torch.float32:
            model = model.to(dtype)
        model.save_pretrained(path)
    return model.float()


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def tiny_checkpoint(request, tmp_path_factory):
    """(family, directory, transformers model) for each family."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = build_tiny_checkpoint(request.param, path)
    return request.param, path, model


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = build_tiny_checkpoint("llama", path)
    return path, model
