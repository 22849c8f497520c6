"""Loading checkpoints: formats, dtypes, shipped configs, dummy weights, and errors that name what is wrong."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_checkpoint

from appliance.errors import ConfigError, ModelLoadError
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.llama import DecoderForCausalLM
from appliance.model_zoo.loader import load_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
# parameter counts published with each model
PUBLISHED = {"llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "qwen3-8b": 8_190_735_360,
             "qwen2.5-7b": 7_615_616_512, "llama-3.2-1b": 1_235_814_400, "qwen2.5-0.5b": 494_032_768}


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_have_the_published_sizes(name):
    cfg = ModelConfig.from_file(CONFIGS / name / "config.json")
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params() == PUBLISHED[name]
    assert cfg.dtype == torch.bfloat16


def test_llama31_config_uses_llama3_rope_scaling():
    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-8b" / "config.json")
    assert (cfg.rope.type, cfg.rope.factor, cfg.rope.original_max_position) == ("llama3", 8.0, 8192)
    assert cfg.eos_token_ids == (128001, 128008, 128009)


def test_dummy_weights_have_the_right_shapes_and_run(tmp_path):
    raw = json.loads((CONFIGS / "qwen3-8b" / "config.json").read_text())
    raw.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(tmp_path, load_format="dummy", dtype="float32")
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    assert model.model.layers[0].self_attn.q_norm.weight.eq(1).all()
    again = load_model(tmp_path, load_format="dummy", dtype="float32")
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)  # seeded


def test_sharded_checkpoint_and_bf16_dtype(tmp_path):
    hf = build_tiny_checkpoint("qwen3", tmp_path / "whole")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    whole = load_model(tmp_path / "whole")
    sharded = load_model(tmp_path / "sharded")
    assert sharded.config.dtype == torch.bfloat16 and sharded.lm_head.weight.dtype == torch.bfloat16
    assert load_model(tmp_path / "sharded", dtype="float32").lm_head.weight.dtype == torch.float32
    assert whole.lm_head.weight.dtype == torch.float32
    hidden, residual = (torch.randn(3, sharded.config.hidden_size, dtype=torch.bfloat16) for _ in range(2))
    out = torch.full((3, sharded.config.vocab_size), float("nan"))
    written = sharded.compute_logits(hidden, residual, out=out)  # (as a decode graph writes its fp32 buffer)
    assert written is out and torch.equal(out, sharded.compute_logits(hidden, residual))


def test_tied_embeddings_share_the_embedding(tmp_path):
    build_tiny_checkpoint("qwen2", tmp_path)
    model = load_model(tmp_path)
    assert model.lm_head is None and model.config.tie_word_embeddings


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    build_tiny_checkpoint("llama", path, num_layers=2)
    return path


def test_missing_directory_and_missing_files(tmp_path, good_dir):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    d = copy_checkpoint(good_dir, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(d)


def test_unsupported_architecture_names_the_field(tmp_path, good_dir):
    d = copy_checkpoint(good_dir, tmp_path / "arch")
    raw = json.loads((d / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"config\.json.*'architectures'.*GPT2LMHeadModel"):
        load_model(d)


def test_unknown_dtype_names_the_field(tmp_path, good_dir):
    d = copy_checkpoint(good_dir, tmp_path / "dtype")
    raw = json.loads((d / "config.json").read_text())
    raw.pop("dtype", None)
    raw["torch_dtype"] = "float8"
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json.*torch_dtype.*float8"):
        load_model(d)
    with pytest.raises(ConfigError, match=r"--dtype.*int4"):
        load_model(good_dir, dtype="int4")


def test_missing_tensor_names_it(tmp_path, good_dir):
    d = copy_checkpoint(good_dir, tmp_path / "missing")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(d)


def test_shape_mismatch_names_file_and_tensor(tmp_path, good_dir):
    d = copy_checkpoint(good_dir, tmp_path / "shape")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1].clone()
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*up_proj\.weight.*shape"):
        load_model(d)


def test_unsupported_rope_type_and_partial_rotary_are_refused(tmp_path, good_dir):
    d = copy_checkpoint(good_dir, tmp_path / "rope")
    raw = json.loads((d / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json.*'longrope'"):
        load_model(d)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"config\.json.*'partial_rotary_factor' is 0\.5"):
        load_model(d)


def test_bad_load_format(good_dir):
    with pytest.raises(ModelLoadError, match="pt"):
        load_model(good_dir, load_format="pt")


def test_building_on_the_meta_device_leaves_torch_dynamo_and_sympy_unimported():
    """No initialiser, no rotary maths and no materialising run torch's Python meta kernels, which would import
    torch._dynamo or sympy, seconds of every server start (checked in a fresh process: this one may have imported
    them)."""
    code = ("import sys\nfrom appliance.config import EMBEDDED_MODEL_DIR\n"
            "from appliance.model_zoo.loader import load_model\n"
            "model = load_model(EMBEDDED_MODEL_DIR)\n"
            "assert not {'torch._dynamo', 'sympy'} & set(sys.modules), {'torch._dynamo', 'sympy'} & set(sys.modules)\n"
            "assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
