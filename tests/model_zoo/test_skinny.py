"""muxd's skinny GEMM (model_zoo/skinny.py, `--decode-blas triton`): its Triton kernel (Triton's interpreter on the
CPU, a subprocess) equals F.linear at any row count up to 16 and ragged N and K; `install` routes the decoder's
projections of more than one row through `muxd::linear` and leaves one-row products to F.linear; the op's fake
implementation and schema pass torch's checks; the kernel is on only where the decode graphs turn it on."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from appliance.config import Config
from appliance.model_zoo import skinny
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.llama import DecoderForCausalLM

CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from appliance.model_zoo.skinny import skinny_linear
    gen = torch.Generator().manual_seed(0)
    for m, n, k in [(2, 96, 512), (8, 200, 384), (16, 64, 256), (3, 40, 1000), (5, 17, 33)]:
        x = torch.randn(m, k + 8, generator=gen)[:, :k]  # rows strided, as a slice of a wider activation
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        err = (skinny_linear(x, w) - F.linear(x, w)).abs().max().item()
        print(m, n, k, err)
        assert err < 1e-4, (m, n, k, err)
    print("ok")
""")


def test_kernel_equals_f_linear_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")


def test_more_rows_than_the_tile_are_refused():
    with pytest.raises(ValueError, match="up to 16"):
        skinny.skinny_linear(torch.zeros(17, 8), torch.zeros(4, 8))


def _model() -> DecoderForCausalLM:
    torch.manual_seed(0)
    return DecoderForCausalLM(ModelConfig.from_dict({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rope_theta": 10000.0}))


def test_install_routes_projections_of_several_rows_through_the_op(monkeypatch):
    model = _model()
    assert skinny.install(model) == 4 * 2
    calls = []
    real = skinny._linear_op
    monkeypatch.setattr(skinny, "_linear_op", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    qkv = model.model.layers[0].self_attn.qkv_proj  # Qwen2: a bias, which the op adds
    for rows in (1, 3):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(qkv(x), F.linear(x, qkv.weight, qkv.bias))
    assert calls == [3]


def test_the_op_passes_torch_checks_and_adds_the_bias():
    x, w, b = torch.randn(4, 32), torch.randn(24, 32), torch.randn(24)
    torch.library.opcheck(skinny._linear_op, (x, w, b))
    torch.testing.assert_close(skinny._linear_op(x, w, b), F.linear(x, w, b))


def test_the_kernel_is_on_only_inside_the_block():
    assert Config.flat(decode_blas="triton").runtime.decode_blas == "triton"
    assert skinny.rows() == 0
    with skinny.enabled():
        assert skinny.rows() == skinny.MAX_ROWS and not skinny._pdl
        with skinny.enabled(4, pdl=True):
            assert skinny.rows() == 4 and skinny._pdl
        assert skinny.rows() == skinny.MAX_ROWS and not skinny._pdl
    assert skinny.rows() == 0
