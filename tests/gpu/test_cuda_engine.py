"""The engine on CUDA: same greedy tokens and close logits as the CPU fp32 reference; real model shapes run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from spies import on_forward

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
PROMPT = [1] + [(7 * i + 3) % 250 + 3 for i in range(40)]


def logits_of(engine: Engine, prompt: list[int]) -> torch.Tensor:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    box: dict[str, torch.Tensor] = {}
    undo = on_forward(engine, lambda plan, logits: box.update(logits))
    while engine.has_unfinished():
        engine.step()
    undo()
    return box[rid].float().cpu()


def test_cuda_fp32_matches_cpu(tiny_checkpoint):
    family, path, _ = tiny_checkpoint
    cpu = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    gpu = build_engine(Config.flat(model=path, device="cuda", num_gpu_blocks_override=64))
    a, b = logits_of(cpu, PROMPT), logits_of(gpu, PROMPT)
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-3, family
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert cpu.generate(PROMPT, params)[0].token_ids == gpu.generate(PROMPT, params)[0].token_ids


def test_bf16_dummy_llama31_8b_serves_a_batch(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    raw = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())
    raw["num_hidden_layers"] = 4  # real layer shapes, fewer of them
    (d / "config.json").write_text(json.dumps(raw))
    engine = build_engine(Config.flat(model=d, device="cuda", load_format="dummy", kv_cache_memory=2 << 30))
    assert engine.kv_cache.data.dtype == torch.bfloat16
    prompts = [[128000] + list(range(1000 + i, 1000 + i + 50 * (i + 1))) for i in range(6)]
    out = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.7, seed=1, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [16] * 6
    assert engine.pool.num_free_pages == engine.pool.num_pages


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b"])
def test_rotary_in_attention_matches_the_compiled_rotation(tmp_path, name):
    """`--fused-rope` (one kernel rotates q and k, after Qwen3's q/k norms, and writes K/V) against the compiled
    layers' norms and rotation, Llama-3.1-8B and Qwen3-8B layer shapes (bf16, dummy weights, the same for both): the
    logits of the prompt and of every greedy step whose inputs agree (a near tie may pick another token, after which
    the rows are not comparable)."""
    d = tmp_path / name
    d.mkdir()
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    raw["num_hidden_layers"] = 2
    (d / "config.json").write_text(json.dumps(raw))
    runs = []
    for fused_rope in (True, False):
        engine = build_engine(Config.flat(model=d, device="cuda", load_format="dummy", kv_cache_memory=1 << 30,
                                          fused_rope=fused_rope))
        assert (engine.model.model.rotary.cos_sin is not None) == fused_rope
        seen: list[torch.Tensor] = []
        undo = on_forward(engine, lambda plan, logits: seen.extend(v.float().cpu() for v in logits.values()))
        out = engine.generate([[128000] + list(range(1000, 1300))],
                              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
        undo()
        assert engine.pool.num_free_pages == engine.pool.num_pages
        runs.append((out[0].token_ids, torch.stack(seen[:9])))
        del engine
    (tokens, fused), (tokens_ref, compiled) = runs
    same = next((i for i, (a, b) in enumerate(zip(tokens, tokens_ref)) if a != b), len(tokens))
    rows = min(same + 1, 9)  # row i is computed from the prompt and tokens[:i]
    err = ((fused[:rows] - compiled[:rows]).norm(dim=-1) / compiled[:rows].norm(dim=-1)).max().item()
    assert err < 2e-2, (err, same)


def test_bf16_dummy_qwen_shapes_serve_a_batch(tmp_path):
    """Qwen2.5-7B (GQA group 7, QKV bias: the rotary kernel with a padded group) and Qwen3-8B (q/k norms in the same
    kernel) layer shapes on the flashinfer backend: a batch completes and every page comes back."""
    for name, fused in (("qwen2.5-7b", True), ("qwen3-8b", True)):
        d = tmp_path / name
        d.mkdir()
        raw = json.loads((CONFIGS / name / "config.json").read_text())
        raw["num_hidden_layers"] = 2
        (d / "config.json").write_text(json.dumps(raw))
        engine = build_engine(Config.flat(model=d, device="cuda", load_format="dummy", kv_cache_memory=2 << 30))
        assert engine.runner.backend_name == "flashinfer", name
        assert (engine.model.model.rotary.cos_sin is not None) == fused, name
        prompts = [[1] + list(range(1000 + i, 1000 + i + 40 * (i + 1))) for i in range(5)]
        out = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.7, seed=1, ignore_eos=True))
        assert [len(c.token_ids) for c in out] == [12] * 5, name
        assert engine.pool.num_free_pages == engine.pool.num_pages, name
        del engine
