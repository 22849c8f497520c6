"""SplitKLinear's partial products: their sum is the layer's product, the norm that reads them sums them, and a model
whose output projections return them generates what the plain model generates (layer ranges included)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.model_zoo.layers import RMSNorm, SplitKLinear, partial_products, settle

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("rows, k, n, slices", [(2, 64, 48, 2), (5, 96, 32, 4), (16, 128, 64, 2)])
def test_partial_products_sum_to_the_product(rows, k, n, slices):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    parts = partial_products(x, w, slices)
    assert parts.shape == (slices, rows, n) and parts.dtype == torch.float32
    for i in range(slices):  # each is its slice of the input features
        cut = slice(i * k // slices, (i + 1) * k // slices)
        torch.testing.assert_close(parts[i], x[:, cut] @ w[:, cut].T)
    torch.testing.assert_close(settle(parts, torch.float32), F.linear(x, w))


def test_the_norm_sums_partial_products_before_the_residual_add():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = torch.rand(32, generator=g) + 0.5
    parts, residual = torch.randn(2, 3, 32, generator=g), torch.randn(3, 32, generator=g)
    out, carried = norm(parts, residual)
    expected, expected_carried = norm(parts[0] + parts[1], residual)
    assert torch.equal(out, expected) and torch.equal(carried, expected_carried)
    assert torch.equal(settle(residual, torch.float32), residual)  # a plain output passes through


def generate(path, **kw) -> list[list[int]]:
    engine = build_engine(Config.flat(model=str(path), num_gpu_blocks_override=64, **kw))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 30, 12, 19)]
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("layers_per_step", [None, 1])
def test_a_model_returning_partial_products_generates_the_same(llama_checkpoint, monkeypatch, layers_per_step):
    path, _ = llama_checkpoint
    extra = {} if layers_per_step is None else {"policy": "layerwise", "layers_per_step": layers_per_step}
    expected = generate(path, **extra)
    calls = []

    def splits(self, x):  # as compiled on a GPU, here eagerly: every batch of 2-16 rows
        calls.append(x.shape[0])
        return 2 <= x.shape[0] <= 16

    monkeypatch.setattr(SplitKLinear, "splits", splits)
    assert generate(path, **extra) == expected
    assert any(2 <= rows <= 16 for rows in calls) and any(rows > 16 for rows in calls)
