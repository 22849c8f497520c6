"""The rotary embedding applied by attention (attention/kv_write.py), with Qwen3's q/k norms before it: its torch
reference equals the layers' own normalisation and rotation, its Triton kernel (run by Triton's interpreter on the
CPU, a subprocess) equals the reference, and a model whose attention rotates computes the logits it computes when its
layers rotate."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from appliance.attention import AttentionMetadata, ForwardContext, TorchAttention, forward_context, page_layout
from appliance.attention.kv_write import apply_rope
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.layers import RMSNorm, RotaryEmbedding
from appliance.model_zoo.llama import DecoderForCausalLM

ROPES = [{}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.9}]


def config(rope: dict, arch: str = "LlamaForCausalLM") -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": [arch], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 512, "rope_theta": 10000.0, **({"rope_scaling": rope} if rope else {})})


@pytest.mark.parametrize("rope", ROPES)
def test_reference_equals_the_layers_rotation(rope):
    cfg = config(rope)
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
    assert rotary.build_table(300, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, (4 + 2 * 2) * 16, generator=gen)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 299])
    q, k, v = apply_rope(qkv, positions, rotary.cos_sin, 4)
    q0, k0, v0 = qkv.split([64, 32, 32], dim=-1)
    eq, ek = rotary(positions, q0.view(7, 4, 16), k0.view(7, 2, 16))
    torch.testing.assert_close(q, eq, rtol=0, atol=1e-6)
    torch.testing.assert_close(k, ek, rtol=0, atol=1e-6)
    assert torch.equal(v, v0.view(7, 2, 16))


def test_reference_normalises_as_the_layers_do():
    """With q/k norm weights (Qwen3), each head of q and k is RMS-normalised by the layers' RMSNorm, then rotated."""
    cfg = config({})
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
    assert rotary.build_table(64, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    q_norm, k_norm = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.rand(16, generator=gen) + 0.5, torch.rand(16, generator=gen) + 0.5
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=gen) * 3
    positions = torch.tensor([0, 1, 9, 33, 63])
    q, k, v = apply_rope(qkv, positions, rotary.cos_sin, 4, q_norm.weight, k_norm.weight, 1e-6)
    q0, k0, v0 = qkv.split([64, 32, 32], dim=-1)
    eq, ek = rotary(positions, q_norm(q0.view(5, 4, 16)), k_norm(k0.view(5, 2, 16)))
    torch.testing.assert_close(q, eq, rtol=0, atol=1e-6)
    torch.testing.assert_close(k, ek, rtol=0, atol=1e-6)
    assert torch.equal(v, v0.view(5, 2, 16))


def test_no_table_where_attention_cannot_rotate():
    """Dynamic NTK rotates by the sequence's length: the layers rotate; q/k norms (Qwen3) go into attention too."""
    dynamic = DecoderForCausalLM(config({"rope_type": "dynamic", "factor": 2.0}))
    assert not dynamic.rotate_in_attention(256) and dynamic.model.rotary.cos_sin is None
    qk_norm = DecoderForCausalLM(config({}, "Qwen3ForCausalLM"))
    assert qk_norm.rotate_in_attention(256)
    plain = DecoderForCausalLM(config({}))
    assert plain.rotate_in_attention(256) and plain.model.rotary.cos_sin.shape == (256, 2, 16)
    assert not plain.rotate_in_attention(None) and plain.model.rotary.cos_sin is None


def _logits(model: DecoderForCausalLM, tokens: list[int]) -> list[torch.Tensor]:
    """A prefill of all but the last token, then a decode of the last, on a fresh cache (pages in reverse order)."""
    cfg, page = model.config, 4
    cache = torch.zeros(cfg.num_layers, 2, 16, page, cfg.num_kv_heads, cfg.head_dim)
    pages = [np.arange(15, -1, -1, dtype=np.int32)]
    out = []
    for start, end in ((0, len(tokens) - 1), (len(tokens) - 1, len(tokens))):
        ends = np.array([end])
        qo, kv_indptr, kv_indices, last, positions, slots = page_layout(np.array([start]), ends, pages, page)
        meta = AttentionMetadata(qo, kv_indptr, kv_indices, last, ends.astype(np.int32), page,
                                 torch.from_numpy(slots))
        with forward_context(ForwardContext(TorchAttention(), meta, cache)):
            out.append(model(torch.tensor(tokens[start:end]), torch.from_numpy(positions)))
    return out


@pytest.mark.parametrize("rope,arch", [(ROPES[0], "LlamaForCausalLM"), (ROPES[1], "LlamaForCausalLM"),
                                       (ROPES[0], "Qwen3ForCausalLM")])
def test_model_rotating_in_attention_computes_the_same_logits(rope, arch):
    torch.manual_seed(0)
    model = DecoderForCausalLM(config(rope, arch))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    tokens = [3, 17, 5, 60, 2, 9, 33, 41, 8, 1, 12]
    with torch.inference_mode():
        expected = _logits(model, tokens)
        assert model.rotate_in_attention(512)
        got = _logits(model, tokens)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


CHECK = textwrap.dedent("""
    import torch
    from appliance.attention.kv_write import apply_rope, launch_rope_write_kv, write_kv
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, norm in [(8, 2, 32, False), (4, 4, 16, False), (7, 1, 32, False), (8, 2, 32, True),
                                       (7, 1, 32, True)]:
        rows, pages, page = 5, 9, 4
        table = torch.randn(100, 2, dim // 2, generator=gen).repeat(1, 1, 2)  # both halves alike, as rope's are
        width = (heads + 2 * kv_heads) * dim
        qkv = torch.randn(rows, width + 24, generator=gen)[:, :width]  # rows strided, as a slice of a wider output
        positions = torch.tensor([0, 7, 99, 42, 3])
        slots = torch.randperm(pages * page, generator=gen)[:rows]
        cache = torch.randn(2, pages, page, kv_heads, dim, generator=gen)
        expected_cache = cache.clone()
        norms = (torch.rand(dim, generator=gen) + 0.5, torch.rand(dim, generator=gen) + 0.5, 1e-5) if norm else ()
        q0, k0, v0 = apply_rope(qkv, positions, table, heads, *norms)
        write_kv(k0, v0, expected_cache, slots)
        q = launch_rope_write_kv(qkv, positions, table, heads, cache, slots, *norms)
        err = max((q - q0).abs().max().item(), (cache - expected_cache).abs().max().item())
        print(heads, kv_heads, dim, norm, err)
        assert q.is_contiguous() and q.shape == (rows, heads, dim)
        assert err < 1e-5, (heads, kv_heads, dim, err)
    print("ok")
""")


def test_kernel_matches_the_reference_in_the_interpreter():
    """GQA groups of 4, 1 and 7 (a padded group), rows strided, slots in random order, positions up to the table's
    last row; with and without q/k norms."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
