"""The SM-scaling roofline prior: step latency from the model's shapes and the device's ceilings, before any
profile exists. Compute and memory bandwidth rise with the SM count and saturate (a few SMs already pull much of
HBM; neither grows in proportion on a large partition); attention is costed per request. Under tensor parallelism a
step is one rank's share of the work plus its collectives: two all-reduces per layer and one for the embedding, and
the all-gather of the logits, at the device's link bandwidth whatever the partition. One calibration factor per
phase, fitted from a few measured samples, scales it to the real engine (Bullet, DuetServe).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.shapes import DecodeLoad, PrefillItem, Sample


@dataclass(frozen=True)
class DeviceSpec:
    """Ceilings of one GPU. `flops` and `bandwidth` are the rates measured on all SMs by a large bf16 GEMM and an
    HBM copy; a step's kernels on `sms` SMs reach `flops_fraction * (1 - exp(-sms / flops_sms))` of the first and
    `bw_fraction * (1 - exp(-sms / bw_sms))` of the second (a few SMs already pull much of HBM, and neither rate
    grows in proportion to the SMs on a large partition); partitions are multiples of `granularity` SMs;
    `contention` is the worst decode slowdown when a prefill fills the rest of the GPU."""

    name: str
    sm_count: int
    flops: float
    bandwidth: float
    bw_sms: float
    bw_fraction: float = 1.0
    flops_sms: float | None = None  # None: compute in proportion to the SMs
    flops_fraction: float = 1.0
    memory_bytes: float = 80e9
    granularity: int = 8
    layer_overhead_ms: float = 0.01
    contention: float = 0.3
    link_bandwidth: float = 360e9  # all-reduce bus bandwidth between the GPUs of one host
    link_latency_ms: float = 0.012  # per collective

    def flops_at(self, sms: int) -> float:
        sms = min(sms, self.sm_count)
        if self.flops_sms is None:
            return self.flops * sms / self.sm_count
        return self.flops * self.flops_fraction * -math.expm1(-sms / self.flops_sms)

    def bandwidth_at(self, sms: int) -> float:
        return self.bandwidth * self.bw_fraction * -math.expm1(-min(sms, self.sm_count) / self.bw_sms)


# Measured (GPU_FACTS): H100 SXM copy ~3.0 TB/s, H200 4.3 TB/s, bf16 GEMM ~790 TFLOP/s on both. The curves' four
# numbers were fitted to the solo steps of the Llama-3.1-8B profiles (H200 of 2026-11-22, H100 of 2026-11-25: prefill
# of 1k tokens or more, and decode, on 16 to 132 SMs): a step's kernels reach 0.75 (H200) and 0.725 (H100) of the copy
# rate, half of that on 22 (H200) and 15 (H100) SMs, and 0.70 of the GEMM rate on all SMs with the GEMM rate per SM on
# 20 (one compute curve for both, the same chip). Against the samples, the mean error went from 23 % to 6-8 % for
# those prefills and from 31-40 % to 9-12 % for decode; on the Llama-3.1-70B profile over two H200s, left out of the
# fit, from 17 % to 5 % and from 26 % to 13 %. Prefills of short prompts stay about 1.3-1.45x the prior (fixed costs
# per launch the roofline does not count: calibration and the online factors take them). The CPU entry only lets CPU
# runs plan something: the CPU runner ignores partitions. Links: NCCL's all-reduce bus bandwidth over NVLink 4 without
# multicast, about 360 GB/s (assumed; `muxd bench engine -tp 2` measured 391 GB/s one way between two H200s), and some
# 12 us a small collective; gloo over the loopback for the CPU.
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("H100", 132, 790e12, 3.0e12, 22, bw_fraction=0.725, flops_sms=140, flops_fraction=1.15,
                       memory_bytes=80e9),
    "h200": DeviceSpec("H200", 132, 790e12, 4.3e12, 32, bw_fraction=0.75, flops_sms=140, flops_fraction=1.15,
                       memory_bytes=141e9),
    "cpu": DeviceSpec("CPU", 16, 1e12, 50e9, 4, memory_bytes=16e9, granularity=4, layer_overhead_ms=0.05,
                      link_bandwidth=2e9, link_latency_ms=0.05),
}


def device_spec(name: str) -> DeviceSpec:
    """Look a device up by key ('h100') or by the name CUDA reports ('NVIDIA H100 80GB HBM3')."""
    key = name.lower()
    if key in DEVICES:
        return DEVICES[key]
    for k, spec in DEVICES.items():
        if k != "cpu" and k in key:
            return spec
    raise ConfigError(f"no ceilings known for device {name!r}; known: {', '.join(DEVICES)} (or give a profile "
                      "measured on it with --profile)")


@dataclass(frozen=True)
class RooflineModel:
    """Latency of a step from FLOPs and bytes: max(compute, memory) per part, parts summed (linear layers, attention
    per request), plus a fixed per-layer overhead; times `prefill_scale` / `decode_scale`."""

    model: ModelConfig
    device: DeviceSpec
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    dtype_bytes: int = 2

    # ---- model shape ------------------------------------------------------------------------------------------
    @functools.cached_property
    def _linear_params(self) -> int:
        m = self.model
        per_layer = m.hidden_size * (m.q_size + 2 * m.kv_size) + m.q_size * m.hidden_size
        per_layer += 3 * m.hidden_size * m.intermediate_size
        return m.num_layers * per_layer

    @functools.cached_property
    def _head_params(self) -> int:
        return self.model.vocab_per_rank * self.model.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.model.num_layers * self.model.kv_size * self.dtype_bytes

    # ---- parts ------------------------------------------------------------------------------------------------
    def _roof(self, flops: float, bytes_: float, sms: int) -> float:
        d = self.device
        return 1e3 * max(flops / d.flops_at(sms), bytes_ / d.bandwidth_at(sms))

    def _linear_ms(self, tokens: int, logit_rows: int, sms: int) -> float:
        flops = 2.0 * self._linear_params * tokens + 2.0 * self._head_params * logit_rows
        weights = (self._linear_params + self._head_params) * self.dtype_bytes
        activations = 4.0 * tokens * self.model.hidden_size * self.dtype_bytes * self.model.num_layers
        return self._roof(flops, weights + activations, sms)

    def _attention_flops(self, queries: float, keys: float) -> float:
        m = self.model
        return 4.0 * m.num_heads * m.head_dim * queries * keys * m.num_layers

    def _prefill_attention_ms(self, item: PrefillItem, sms: int) -> float:
        keys = item.reused + (item.new + 1) / 2  # causal: a new token sees the reused ones and half the new ones
        bytes_ = (item.reused + 2 * item.new) * self.kv_bytes_per_token  # read the cache, write the new KV
        return self._roof(self._attention_flops(item.new, keys), bytes_, sms)

    def _decode_attention_ms(self, load: DecodeLoad, sms: int) -> float:
        return self._roof(self._attention_flops(1, load.reused_tokens),
                          (load.reused_tokens + load.batch_size) * self.kv_bytes_per_token, sms)

    def _overhead_ms(self) -> float:
        return self.device.layer_overhead_ms * self.model.num_layers

    def comm_ms(self, tokens: int, logit_rows: int) -> float:
        """The collectives of a step of `tokens` rows under tensor parallelism (0 on one rank): ring all-reduces of
        the hidden state after each layer's attention and MLP and after the embedding, and the all-gather of the
        logits rows."""
        m, d, tp = self.model, self.device, self.model.tp_size
        if tp == 1:
            return 0.0
        reduce = 2 * (tp - 1) / tp * tokens * m.hidden_size * self.dtype_bytes
        gather = (tp - 1) / tp * logit_rows * m.vocab_per_rank * tp * self.dtype_bytes
        collectives = 2 * m.num_layers + 2
        return collectives * d.link_latency_ms + 1e3 * ((2 * m.num_layers + 1) * reduce + gather) / d.link_bandwidth

    # ---- LatencyModel -----------------------------------------------------------------------------------------
    def prefill_ms(self, items: Sequence[PrefillItem], sms: int) -> float:
        if not items:
            return 0.0
        tokens = sum(i.new for i in items)
        t = self._linear_ms(tokens, len(items), sms) + sum(self._prefill_attention_ms(i, sms) for i in items)
        return self.prefill_scale * (t + self._overhead_ms() + self.comm_ms(tokens, len(items)))

    def decode_ms(self, load: DecodeLoad, sms: int) -> float:
        if load.empty:
            return 0.0
        t = self._linear_ms(load.batch_size, load.batch_size, sms) + self._decode_attention_ms(load, sms)
        return self.decode_scale * (t + self._overhead_ms() + self.comm_ms(load.batch_size, load.batch_size))

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad, sms: int) -> float:
        if not items:
            return self.decode_ms(load, sms)
        tokens = sum(i.new for i in items) + load.batch_size
        t = self._linear_ms(tokens, len(items) + load.batch_size, sms)
        t += sum(self._prefill_attention_ms(i, sms) for i in items)
        if not load.empty:
            t += self._decode_attention_ms(load, sms)
        return self.prefill_scale * (t + self._overhead_ms() + self.comm_ms(tokens, len(items) + load.batch_size))

    # ---- calibration ------------------------------------------------------------------------------------------
    def calibrated(self, samples: Sequence[Sample]) -> "RooflineModel":
        """A copy whose two scale factors minimise the squared relative error on measured solo samples (a few are
        enough: the shape comes from the roofline, the samples fix its level)."""
        unscaled = dataclasses.replace(self, prefill_scale=1.0, decode_scale=1.0)
        scales = {}
        for kind in ("prefill", "decode"):
            picked = [s for s in samples if s.kind == kind]
            if not picked:
                scales[kind] = getattr(self, f"{kind}_scale")
                continue
            pred = np.array([unscaled.prefill_ms(s.prefill, s.sms) if kind == "prefill"
                             else unscaled.decode_ms(s.decode, s.sms) for s in picked])
            q = pred / np.array([s.ms for s in picked])
            scales[kind] = float(q.sum() / (q * q).sum())  # argmin_k sum (k*q - 1)^2
        return dataclasses.replace(self, prefill_scale=scales["prefill"], decode_scale=scales["decode"])
