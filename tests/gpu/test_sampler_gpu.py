"""The sampler's Triton argmax on the device against torch.argmax: vocabularies of Llama-3 and Qwen2.5, fp32 and
bf16 logits, 1 to 64 rows, ties inside and across slices, rows with nothing finite, a strided output."""
from __future__ import annotations

import pytest
import torch

from appliance.engine.request import SamplingParams
from appliance.engine.sampler import ARGMAX_SLICE, argmax_rows, sample_tensor, triton_argmax


@pytest.mark.parametrize("vocab", [128256, 151936, 2 * ARGMAX_SLICE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_argmax_equals_torch(vocab, dtype):
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    for rows in (1, 3, 8, 64):
        x = torch.randn(rows, vocab + 5, generator=gen, device="cuda").to(dtype)[:, :vocab]
        x[0, 7] = x[0, ARGMAX_SLICE + 1] = x[0, -1] = 1000.0  # a tie across slices: the first wins
        if rows > 1:
            x[1, 100:104] = 1000.0  # a tie inside a slice
            x[-1] = float("-inf")
        out = torch.full((rows, 2), -1, dtype=torch.long, device="cuda")
        assert triton_argmax(x, out[:, 0]).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out[:, 0], x.argmax(dim=-1), rtol=0, atol=0)
        assert (out[:, 1] == -1).all()
        torch.testing.assert_close(argmax_rows(x), x.argmax(dim=-1), rtol=0, atol=0)


def test_sampling_a_large_vocabulary_takes_the_argmax_for_greedy_rows_and_the_race_for_random_ones():
    logits = torch.randn(6, 128256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    tokens = sample_tensor(logits, [greedy, seeded] * 3, [0, 5] * 3)
    assert tokens[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()
    again = sample_tensor(logits[1:2], [seeded], [5])  # a seeded row draws the same alone as in a batch
    assert tokens[1].item() == again.item()
