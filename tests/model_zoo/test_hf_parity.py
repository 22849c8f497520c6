"""Logits and greedy tokens of each family match transformers (fp32): prefill, then decode through the paged cache."""
from __future__ import annotations

import pytest
import torch
from spies import on_forward

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams

PROMPT = [1] + [(7 * i + 3) % 250 + 3 for i in range(36)]  # 37 tokens: three pages of 16, the last partial


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def record_logits(engine: Engine) -> list[dict[str, torch.Tensor]]:
    """Wrap the runner so every step's logits are kept (test instrumentation)."""
    seen: list[dict[str, torch.Tensor]] = []
    on_forward(engine, lambda plan, logits: seen.append(logits))
    return seen


def test_logits_match_transformers_prefill_and_16_decode_steps(tiny_checkpoint):
    family, path, hf = tiny_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    seen = record_logits(engine)
    [done] = engine.generate(PROMPT, SamplingParams(max_tokens=17, temperature=0, ignore_eos=True))
    assert len(seen) == 17  # one prefill step + 16 decode steps
    tokens = PROMPT + done.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    for step, logits in enumerate(seen):
        ours = logits[done.request_id]
        expected = ref[len(PROMPT) - 1 + step]
        assert rel_err(ours, expected) <= 1e-4, f"{family} step {step}: rel err {rel_err(ours, expected):.2e}"


def test_greedy_32_tokens_identical_to_transformers(tiny_checkpoint):
    family, path, hf = tiny_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    [done] = engine.generate(PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert done.token_ids == ref, family
    assert done.finish_reason == "length"


@pytest.mark.parametrize("layers_per_step", [1, 3])
def test_layer_range_prefill_equals_one_pass(tiny_checkpoint, layers_per_step):
    family, path, _ = tiny_checkpoint
    whole = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    split = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="layerwise",
                                                             layers_per_step=layers_per_step))
    seen_whole, seen_split = record_logits(whole), record_logits(split)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    [a], [b] = whole.generate(PROMPT, params), split.generate(PROMPT, params)
    # 4 layers in ranges of layers_per_step: only the step that ran the last layer produced logits
    n_ranges = -(-4 // layers_per_step)
    assert [len(s) for s in seen_split[:n_ranges]] == [0] * (n_ranges - 1) + [1]
    first_whole = seen_whole[0][a.request_id]
    first_split = seen_split[n_ranges - 1][b.request_id]
    assert rel_err(first_split, first_whole) <= 1e-6
    assert a.token_ids == b.token_ids
