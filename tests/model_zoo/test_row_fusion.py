"""DecoderLayer.forward_row, the form the single-token graph compiles on a GPU (each norm's statistic inside the
projection's reduction, the residual adds inside the projections' kernels): it computes the stream `forward` and its
caller's add compute, and an engine whose one-row steps run it generates what the plain engine generates (decode, a
one-token prompt, prompts resumed together between layer ranges)."""
from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_checkpoint

from appliance.attention import set_layer
from appliance.attention.context import ForwardContext, forward_context
from appliance.config import Config
from appliance.engine import runner as runner_module
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.model_zoo.layers import DecoderLayer, RMSNorm, norm_linear, settle

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("bias", [False, True])
def test_norm_linear_is_the_projection_of_the_norm(bias):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(48, 1e-5)
    norm.weight.data = torch.rand(48, generator=g) + 0.5
    linear = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, 48, generator=g) * 3
    with torch.no_grad():
        torch.testing.assert_close(norm_linear(x, norm, linear), linear(norm(x)))
        xb, nb, lb = x.bfloat16(), norm.bfloat16(), linear.bfloat16()
        torch.testing.assert_close(norm_linear(xb, nb, lb).float(), lb(nb(xb)).float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_forward_row_returns_the_stream_forward_and_its_caller_make(family, tmp_path):
    build_tiny_checkpoint(family, tmp_path, num_layers=2)
    engine = build_engine(Config.flat(model=str(tmp_path), num_gpu_blocks_override=16))
    model = engine.runner.model
    g = torch.Generator().manual_seed(2)
    hidden, residual = (torch.randn(1, model.config.hidden_size, generator=g) for _ in range(2))
    layer = model.model.layers[1]
    ctx = ForwardContext(engine.runner.backend, engine.runner.scratch_batch([1]).metadata,
                         engine.runner.kv_cache.data)
    with torch.no_grad(), forward_context(ctx):
        set_layer(1)
        positions = torch.zeros(1, dtype=torch.long)
        for carried in (None, residual):
            out, res = DecoderLayer.forward(layer, positions, hidden, carried)
            stream, none = layer.forward_row(positions, hidden, carried)
            assert none is None
            torch.testing.assert_close(stream, settle(out, res.dtype) + res)


def _generate(path, **kw) -> list[list[int]]:
    engine = build_engine(Config.flat(model=str(path), num_gpu_blocks_override=64, **kw))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 1, 30, 12, 1, 19)]
    together = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts[:3]]  # one row: prefill and decode
    return together + alone


@pytest.mark.parametrize("extra", [{}, {"policy": "layerwise", "layers_per_step": 1}])
def test_an_engine_running_one_row_layers_as_the_compiled_form_generates_the_same(llama_checkpoint, monkeypatch,
                                                                                 extra):
    path, _ = llama_checkpoint
    expected = _generate(path, **extra)
    rows = []

    def forward(self, positions, hidden, residual):  # what the single-token graph runs on a GPU, here eagerly
        rows.append(hidden.shape[0])
        if hidden.shape[0] == 1:
            return DecoderLayer.forward_row(self, positions, hidden, residual)
        return plain(self, positions, hidden, residual)

    plain = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward", forward)
    assert _generate(path, **extra) == expected
    assert 1 in rows and any(r > 1 for r in rows)


def test_prefills_resumed_together_carry_zeros_for_a_stream_without_residual():
    """A one-row layer range leaves the whole stream and no residual; resumed beside prefills that carry one, its
    residual is zeros (the stream plus nothing)."""
    g = torch.Generator().manual_seed(4)
    one = runner_module._Partial(torch.randn(1, 8, generator=g), None, 2)
    two = runner_module._Partial(torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g), 2)
    assert runner_module._residuals([one, one]) is None
    carried = runner_module._residuals([one, two])
    assert carried.shape == (4, 8)
    assert torch.equal(carried[:1], torch.zeros(1, 8)) and torch.equal(carried[1:], two.residual)
