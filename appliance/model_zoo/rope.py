"""Rotary-embedding maths: inverse frequencies of every supported rope type (default, linear, llama3, yarn, dynamic
NTK), yarn's attention factor, and the cos/sin tables the rotary layer applies.

Each type follows transformers' `modeling_rope_utils` operation for operation, so logits match it in fp32.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from appliance.model_zoo.config import RopeConfig


def _default_inv_freq(head_dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    device = theta.device if isinstance(theta, torch.Tensor) else None
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponent)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (fp32, CPU). For dynamic NTK these are the unscaled ones, which hold while
    a sequence is no longer than the model's original context; `dynamic_inv_freq` gives the longer ones."""
    if rope.type == "yarn":
        return _yarn_inv_freq(head_dim, rope)
    if rope.type == "dynamic":
        # transformers' value at the original length, in Python floats (equal to theta up to rounding)
        base = rope.theta * ((rope.factor * rope.original_max_position / rope.original_max_position)
                             - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
        return _default_inv_freq(head_dim, base)
    inv_freq = _default_inv_freq(head_dim, rope.theta)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): interpolate low frequencies by `factor`, keep high ones, ramp linearly between the
    dimensions that turn beta_fast and beta_slow times over the original context."""
    base, dim = rope.theta, head_dim

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def attention_factor(rope: RopeConfig) -> float:
    """Scale of cos/sin (yarn's mscale: sharper attention at long range); 1.0 for the other types."""
    if rope.type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


def dynamic_inv_freq(head_dim: int, rope: RopeConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: per-row inverse frequencies [rows, head_dim / 2] for sequences of seq_lens [rows] tokens; the
    rope base grows with the length beyond the original context (fp32, as transformers computes it)."""
    original = rope.original_max_position
    lens = torch.clamp(seq_lens, min=original)
    base = rope.theta * ((rope.factor * lens / original) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    return _default_inv_freq(head_dim, base.unsqueeze(-1))


# Dynamic NTK only: the sequence length each row's frequencies come from, set by the runner around a forward.
_row_lengths: torch.Tensor | None = None


@contextlib.contextmanager
def rope_lengths(lengths: torch.Tensor | None) -> Iterator[None]:
    """Make `lengths` [num_tokens] the sequence lengths that dynamic-NTK rows use inside this block."""
    global _row_lengths
    previous, _row_lengths = _row_lengths, lengths
    try:
        yield
    finally:
        _row_lengths = previous


def dynamic_lengths(positions: torch.Tensor, prompt_lens: list[int], query_lens: list[int]) -> torch.Tensor:
    """The length whose frequencies rotate each row, as transformers' generate would have it for that sequence
    alone: a prompt token is rotated when the whole prompt is (its length), a generated token when it is appended
    (its position + 1). Independent of chunking, layer ranges, batching and recompute after preemption."""
    prompt = torch.repeat_interleave(torch.tensor(prompt_lens, dtype=torch.int64),
                                     torch.tensor(query_lens, dtype=torch.int64)).to(positions.device)
    return torch.maximum(positions + 1, prompt)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, rope: RopeConfig,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_tokens, head_dim] for the rows at `positions`, computed in fp32 and cast to `dtype`."""
    if rope.type == "dynamic":
        # without lengths from the runner each row counts as the end of its sequence: exact for decode rows, so
        # decode forwards (and CUDA graphs of them) need none; prefills of prompt tokens do
        lengths = _row_lengths if _row_lengths is not None else positions + 1
        freqs = positions.float().unsqueeze(-1) * dynamic_inv_freq(2 * inv_freq.numel(), rope, lengths)
        # rows within the original context keep the unscaled frequencies bit for bit
        freqs = torch.where((lengths <= rope.original_max_position).unsqueeze(-1),
                            positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0), freqs)
    else:
        freqs = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    scale = attention_factor(rope)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)
