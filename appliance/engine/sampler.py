"""Token sampling for a batch of logits rows: greedy, temperature, top-k, top-p, min-p, per-request seeds —
vectorised. (Penalties, biases and masks change the logits before, engine/logits.py.)

Random rows use the exponential race (argmax of p / E with E ~ Exp(1) draws from p). A seeded request's noise comes from
a counter-based hash of (seed, output index, vocabulary index) computed on the device, so its tokens depend neither on
the batch it shares nor on preemption, and no generator object is made per row.
"""
from __future__ import annotations

import torch

from appliance.engine.request import SamplingParams

_M32 = 0xFFFF_FFFF


def sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> list[int]:
    """logits [B, V] fp32 -> one token id per row. output_index[i]: how many tokens row i's request has generated."""
    return sample_tensor(logits, params, output_index).tolist()


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """As `sample`, but returns the token ids as a device tensor [B] (no host synchronisation): `out` where given
    (a long tensor [B] the ids are written into, e.g. rows of the token buffer, saving a copy)."""
    tokens = argmax_rows(logits, out)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    # one host->device copy for every per-row parameter: temperature, top_p, top_k, seeded?, key words
    table = []
    for i in rows:
        p = params[i]
        key = _mix(p.seed, output_index[i]) if p.seed is not None else 0
        table.append((p.temperature, p.top_p, p.top_k if p.top_k > 0 else 0, p.seed is not None,
                      key & _M32, key >> 32 & _M32, p.min_p))
    cols = torch.tensor(table, dtype=torch.float64).to(logits.device, non_blocking=True)
    temperature, top_p, top_k = cols[:, 0].float(), cols[:, 1].float(), cols[:, 2].long()
    seeded, key_lo, key_hi, min_p = cols[:, 3].bool(), cols[:, 4].long(), cols[:, 5].long(), cols[:, 6].float()
    index = torch.tensor(rows).to(logits.device, non_blocking=True)  # (a blocking copy waits for the queue)
    sub = logits[index] / temperature.unsqueeze(1)
    need_filter = any(params[i].top_k > 0 or params[i].top_p < 1.0 or params[i].min_p > 0 for i in rows)
    probs = _filtered_probs(sub, top_k, top_p, min_p) if need_filter else sub.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    if any(params[i].seed is not None for i in rows):
        hashed = -torch.log(uniform_from_key(key_lo, key_hi, probs.shape[-1]))
        noise = torch.where(seeded.unsqueeze(1), hashed, noise)
    tokens[index] = argmax_rows(probs / noise)
    return tokens


ARGMAX_SLICE = 4096  # values a program of the Triton argmax reads (16 KiB of fp32)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's index of its largest value (the first, as torch.argmax; NaN counts as +inf) of x [B, V], into
    `out` [B] long where given. On CUDA, rows of at least two slices run as two Triton launches, a program per slice
    of a row and then one a row: torch's reduction gives a row one block, which leaves most SMs idle at a few rows
    of a large vocabulary."""
    rows, vocab = x.shape
    if not (x.is_cuda and vocab >= 2 * ARGMAX_SLICE and rows and x.stride(1) == 1) or \
            (out is not None and out.dtype != torch.long):
        return x.argmax(dim=-1) if out is None else torch.argmax(x, dim=-1, out=out)
    return triton_argmax(x, out)


def triton_argmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`argmax_rows` in two Triton launches (x [B, V] with unit column stride)."""
    rows, vocab = x.shape
    from appliance.engine.argmax_kernels import argmax_pick_kernel, argmax_slices_kernel  # defers Triton
    slices = -(-vocab // ARGMAX_SLICE)
    values = torch.empty(rows, slices, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, slices, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.long, device=x.device) if out is None else out
    argmax_slices_kernel[(rows, slices)](x, x.stride(0), vocab, values, index, slices, BLOCK=ARGMAX_SLICE,
                                         num_warps=8)
    argmax_pick_kernel[(rows,)](values, index, slices, out, out.stride(0),
                                SLICES=1 << (slices - 1).bit_length(), num_warps=1)
    return out


def _filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Softmax after cutting each row to the tokens at least min_p times as likely as its most likely one, to its
    top_k (0: no cut) and to the smallest prefix covering top_p."""
    sorted_logits, order = _cut(logits, top_k, top_p, min_p)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(dim=-1))


def cut_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] (already divided by the temperature) with -inf for the tokens each row's min_p, top_k and top_p
    cut, as sampling cuts them (greedy rows and rows without a cut keep every token)."""
    rows = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0)]
    if not rows:
        return logits
    cols = torch.tensor([(params[i].top_p, params[i].top_k if params[i].top_k > 0 else 0, params[i].min_p)
                         for i in rows], dtype=torch.float64).to(logits.device, non_blocking=True)
    index = torch.tensor(rows).to(logits.device, non_blocking=True)
    sorted_logits, order = _cut(logits[index], cols[:, 1].long(), cols[:, 0].float(), cols[:, 2].float())
    out = logits.clone()
    out[index] = torch.empty_like(sorted_logits).scatter_(-1, order, sorted_logits)
    return out


def _cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logits sorted high to low with -inf for the tokens min_p, top_k (0: no cut) and top_p cut, and
    the order they were sorted in."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)  (min_p = 0 cuts nothing: log 0 = -inf)
    floor = sorted_logits[:, :1] + min_p.log().unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, float("-inf"))
    ks = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # drop a token when the tokens ranked above it already cover top_p (the first token always stays)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
    return sorted_logits.masked_fill(drop, float("-inf")), order


def uniform_from_key(key_lo: torch.Tensor, key_hi: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] uniforms in (0, 1): a hash of (row key, column index), the same on any batch and step order."""
    col = torch.arange(vocab, device=key_lo.device, dtype=torch.int64).unsqueeze(0)
    x = _fmix32(col ^ key_lo.unsqueeze(1))
    x = _fmix32(x ^ key_hi.unsqueeze(1))
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for x < 2^32 without int64 overflow: multiply by the constant's 16-bit halves
    return ((((x * (c >> 16)) & 0xFFFF) << 16) + x * (c & 0xFFFF)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values < 2^32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _mix(seed: int, index: int) -> int:
    """64-bit key of (seed, output index) (splitmix64 of their combination)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return z ^ (z >> 31)
