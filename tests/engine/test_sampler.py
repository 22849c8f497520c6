"""The vectorised sampler: seeded rows depend only on (seed, output index) — not on the batch around them — the hash
noise is uniform, and top-k / top-p cut what they should."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from appliance.engine.request import SamplingParams
from appliance.engine.sampler import _mix, sample, sample_tensor, uniform_from_key


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 500, generator=g)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42)
    alone = [sample(logits[:1], [seeded], [i])[0] for i in range(20)]
    others = [SamplingParams(temperature=t, seed=s, top_p=p) for t, s, p in
              zip([0.0, 1.0, 0.7] * 11, [None, 3, 9] * 11, [1.0, 0.5, 0.9] * 11)][:31]
    for i in range(20):
        batch = sample(logits, [seeded] + others, [i] + list(range(31)))
        assert batch[0] == alone[i]
    assert len(set(alone)) > 3  # the seed's noise changes with the output index


def test_greedy_rows_take_the_argmax_and_unseeded_rows_vary():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=2.0),
              SamplingParams(temperature=2.0)]
    draws = [sample(logits, params, [0] * 4) for _ in range(20)]
    argmax = logits.argmax(-1).tolist()
    assert all(d[0] == argmax[0] and d[1] == argmax[1] for d in draws)
    assert len({d[2] for d in draws}) > 1


def test_ids_are_written_into_the_rows_given():
    """`out` (rows of the token buffer): greedy and seeded rows land there, as without it, and nothing else moves."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5), SamplingParams(top_k=1),
              SamplingParams(temperature=1.5, top_p=0.9, seed=11), SamplingParams(temperature=0.0)]
    buffer = torch.full((9,), -1, dtype=torch.long)
    got = sample_tensor(logits, params, [3] * 5, out=buffer[2:7])
    assert got.data_ptr() == buffer[2:7].data_ptr()
    assert buffer[2:7].tolist() == sample_tensor(logits, params, [3] * 5).tolist()
    assert buffer[:2].tolist() == [-1, -1] and buffer[7:].tolist() == [-1, -1]


def test_hash_noise_is_uniform_and_keyed():
    key = _mix(7, 3)
    lo = torch.tensor([key & 0xFFFFFFFF, 5])
    hi = torch.tensor([key >> 32 & 0xFFFFFFFF, 5])
    u = uniform_from_key(lo, hi, 200_000)
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u[0], bins=20, min=0, max=1)
    expected = u.shape[1] / 20
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 60  # 19 degrees of freedom: far below any non-uniformity worth the name
    assert abs(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1].item()) < 0.01  # different keys, independent noise
    assert torch.equal(uniform_from_key(lo, hi, 200_000), u)


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0, -2.0]])
    topk = {sample(logits, [SamplingParams(temperature=5.0, top_k=2, seed=s)], [0])[0] for s in range(200)}
    assert topk == {0, 1}
    # probabilities ~0.66, 0.24, 0.09, ...: top_p 0.8 keeps the first two
    topp = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=s)], [0])[0] for s in range(200)}
    assert topp == {0, 1}


ARGMAX_CHECK = textwrap.dedent("""
    import torch
    from appliance.engine.sampler import ARGMAX_SLICE, triton_argmax
    gen = torch.Generator().manual_seed(0)
    vocab = 3 * ARGMAX_SLICE + 123  # a last slice mostly past the end of the row
    x = torch.randn(5, vocab + 7, generator=gen)[:, :vocab]  # rows strided
    x[1, 5] = x[1, ARGMAX_SLICE + 9] = x[1, -1] = 99.0  # ties across slices: the first wins
    x[2, 10] = x[2, 11] = 50.0  # a tie inside a slice
    x[3] = float("-inf")  # nothing finite: index 0, as torch has it
    x[4, -1] = 1e9  # the largest in the last, partial slice
    expected = x.argmax(dim=-1)
    out = torch.full((5, 2), -1, dtype=torch.long)
    got = triton_argmax(x, out[:, 0])  # into a strided output
    assert got.data_ptr() == out.data_ptr(), "not written into out"
    print(expected.tolist(), out[:, 0].tolist())
    assert torch.equal(out[:, 0], expected) and (out[:, 1] == -1).all()
    assert torch.equal(triton_argmax(x[:2].contiguous()), expected[:2])
    print("ok")
""")


def test_the_triton_argmax_takes_each_rows_first_largest_value_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", ARGMAX_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
