"""Token sampling for a batch of logits rows: greedy, temperature, top-k, top-p, per-request seeds.

Random rows use the exponential-race trick (argmax of p / Exp(1) noise draws from p). A seeded request draws its noise
from a generator seeded by (seed, output index), so its tokens do not depend on batch composition or preemption.
"""
from __future__ import annotations

import torch

from appliance.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
    """logits [B, V] fp32 -> one token id per row. output_index[i]: how many tokens row i's request has generated."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits[rows] / torch.tensor([params[i].temperature for i in rows], device=logits.device).unsqueeze(1)
        probs = _filtered_probs(sub, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            seed = params[i].seed
            if seed is None:
                noise[j].exponential_()
            else:
                gen = torch.Generator(device=logits.device).manual_seed(_mix(seed, output_index[i]))
                noise[j].exponential_(generator=gen)
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits.softmax(dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device).unsqueeze(1)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    ps = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    # drop a token when the tokens ranked above it already cover top_p (the first token always stays)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= ps
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(dim=-1))


def _mix(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF
