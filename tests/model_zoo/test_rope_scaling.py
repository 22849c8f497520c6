"""Rope scaling yarn and dynamic NTK: frequencies equal transformers' bit for bit, configs parse in both spellings,
and tiny models generate what transformers generates (dynamic: prompts shorter and longer than the original context,
alone and batched together, through layer-range prefill)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from test_hf_parity import record_logits, rel_err
from tiny_models import build_tiny_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.rope import attention_factor, dynamic_inv_freq, rope_inv_freq

HEAD_DIM = 64
YARN_VARIANTS = [
    {"factor": 4.0, "original_max_position_embeddings": 32768},
    {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 0.9},
]


def hf_config(rope: dict, max_position_embeddings: int = 131072) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=max_position_embeddings, rope_theta=1e6,
                                    rope_scaling=dict(rope))


def ours(rope: dict, max_position_embeddings: int = 131072) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": HEAD_DIM * 4,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": HEAD_DIM,
        "max_position_embeddings": max_position_embeddings, "rope_theta": 1e6, "rope_scaling": rope})


@pytest.mark.parametrize("variant", YARN_VARIANTS)
def test_yarn_frequencies_and_attention_factor_equal_transformers(variant):
    rope = {"rope_type": "yarn", **variant}
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(rope))
    cfg = ours(rope)
    assert torch.equal(rope_inv_freq(HEAD_DIM, cfg.rope), expected)
    assert attention_factor(cfg.rope) == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("seq_len", [100, 2048, 2049, 3000, 8191])
def test_dynamic_frequencies_equal_transformers_at_every_length(seq_len):
    rope = {"rope_type": "dynamic", "factor": 4.0}
    hf = hf_config(rope, max_position_embeddings=2048)
    # transformers keeps the init-time frequencies up to the original context and recomputes them beyond it
    if seq_len <= 2048:
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, seq_len=torch.tensor(seq_len))
    cfg = ours(rope, max_position_embeddings=2048)
    static = rope_inv_freq(HEAD_DIM, cfg.rope)
    per_row = dynamic_inv_freq(HEAD_DIM, cfg.rope, torch.tensor([seq_len, 10]))
    assert torch.equal(per_row[0] if seq_len > 2048 else static, expected)
    assert torch.equal(per_row[1], dynamic_inv_freq(HEAD_DIM, cfg.rope, torch.tensor([2048]))[0])


def test_qwen25_long_context_yarn_config_parses_in_both_spellings():
    v4 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1e6,
          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    v5 = {**v4, "rope_scaling": None,
          "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                              "rope_theta": 1e6}}
    for raw in (v4, v5):
        cfg = ModelConfig.from_dict(raw)
        assert (cfg.rope.type, cfg.rope.factor, cfg.rope.original_max_position, cfg.rope.theta) == (
            "yarn", 4.0, 32768, 1e6)
        assert cfg.max_model_len == 4 * 32768  # served context, as vLLM derives it
    dynamic = ModelConfig.from_dict({**v4, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert dynamic.max_model_len == 65536 and dynamic.rope.length_dependent


@pytest.mark.parametrize("bad", [{"type": "yarn"}, {"type": "dynamic", "factor": 0.5},
                                 {"type": "yarn", "factor": "4"}])
def test_scaling_without_a_usable_factor_is_refused(bad):
    with pytest.raises(ConfigError, match=r"'factor'"):
        ours(bad)


def hf_generate(path, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step logits from a freshly loaded transformers model (dynamic rope keeps state)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def check_against_hf(engine: Engine, path, prompts: list[list[int]], n: int) -> None:
    seen = record_logits(engine)
    done = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for prompt, got in zip(prompts, done):
        tokens, logits = hf_generate(path, prompt, n)
        assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        ours_steps = [step[got.request_id] for step in seen if got.request_id in step]
        assert len(ours_steps) == n
        worst = max(rel_err(a, b) for a, b in zip(ours_steps, logits))
        assert worst <= 1e-4, f"prompt of {len(prompt)} tokens: rel err {worst:.2e}"


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [1] + [(7 * i + 3 + salt) % 250 + 3 for i in range(n - 1)]


def test_qwen2_yarn_checkpoint_matches_transformers(tmp_path):
    build_tiny_checkpoint("qwen2", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None)  # written the way Qwen2.5's model card says: 4.x spelling
    raw.update(max_position_embeddings=32768, rope_theta=1e6,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    engine = build_engine(Config.flat(model=tmp_path, num_gpu_blocks_override=64))
    assert engine.model.config.rope.type == "yarn"
    check_against_hf(engine, tmp_path, [prompt_of(37)], 24)


@pytest.fixture(scope="module")
def dynamic_checkpoint(tmp_path_factory):
    """A tiny Llama whose original context is 32 tokens, with dynamic NTK scaling x2 (context 64)."""
    path = tmp_path_factory.mktemp("dynamic")
    build_tiny_checkpoint("llama", path, max_position_embeddings=32, rope_scaling={"rope_type": "dynamic",
                                                                                  "factor": 2.0})
    return path


SHORT, LONG = prompt_of(20), prompt_of(37, salt=5)  # 20 + 24 outputs crosses 32 while decoding; 37 starts past it


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["shorter", "longer"])
def test_dynamic_ntk_matches_transformers_below_and_beyond_the_original_context(dynamic_checkpoint, prompt):
    engine = build_engine(Config.flat(model=dynamic_checkpoint, num_gpu_blocks_override=64))
    assert engine.max_model_len == 64
    assert not engine.pool.enable_prefix_caching  # K of a prompt depends on the prompt's length
    check_against_hf(engine, dynamic_checkpoint, [prompt], 24 if prompt is SHORT else 16)


def test_dynamic_ntk_rows_use_their_own_sequence_length_in_a_batch(dynamic_checkpoint):
    """Both prompts in one batch, prefilled a layer range at a time: each still matches its own solo run."""
    engine = build_engine(Config.flat(model=dynamic_checkpoint, num_gpu_blocks_override=64, policy="layerwise",
                                                                           layers_per_step=3))
    check_against_hf(engine, dynamic_checkpoint, [SHORT, LONG], 16)


def test_dynamic_ntk_output_survives_preemption_and_recompute(dynamic_checkpoint):
    """A preempted request recomputes prompt + output as one prefill; its tokens keep their rotations."""
    prompts = [prompt_of(18 + 3 * i, salt=i) for i in range(8)]  # 18..39 tokens, half past the original 32
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    solo = build_engine(Config.flat(model=dynamic_checkpoint, num_gpu_blocks_override=64))
    alone = [solo.generate(p, params)[0].token_ids for p in prompts]
    tight = build_engine(Config.flat(model=dynamic_checkpoint, num_gpu_blocks_override=10))
    requests = [tight.make_request(p, params) for p in prompts]
    for r in requests:
        tight.submit(r)
    while tight.has_unfinished():
        tight.step()
    assert any(r.num_preemptions for r in requests), "the pool was never exhausted; the test lost its point"
    assert [r.output_token_ids for r in requests] == alone
