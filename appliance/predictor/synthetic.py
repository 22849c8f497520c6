"""A known latency function standing in for a GPU, for tests and for simulations without a measured profile:
solo times from the roofline of a model on a device, and a decode slowdown beside a concurrent prefill that grows
with the prefill's share of the SMs and its size. `sample_grid` measures it the way `muxd profile` measures a GPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Sequence

from appliance.model_zoo.config import ModelConfig
from appliance.predictor.profile import ProfileFile, build_profile
from appliance.predictor.roofline import DeviceSpec, RooflineModel
from appliance.predictor.shapes import DecodeLoad, PrefillItem, Sample

PREFILL_NEW = (128, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL_REUSED = (0, 4096, 16384, 32768)
DECODE_BATCH = (1, 4, 16, 32, 64, 128, 256)
DECODE_CONTEXT = (512, 2048, 8192, 16384)


@dataclass(frozen=True)
class SyntheticGPU:
    """Step times of `model` on `device`. A decode step beside a prefill of `n` new tokens on the other
    `S - d` SMs runs 1 + contention * (S - d) / S * min(1, n / saturation) times slower."""

    model: ModelConfig
    device: DeviceSpec
    contention: float = 0.3
    saturation_tokens: int = 4096

    @functools.cached_property
    def roofline(self) -> RooflineModel:
        return RooflineModel(self.model, self.device)

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def sm_count(self) -> int:
        return self.device.sm_count

    def prefill_ms(self, items: Sequence[PrefillItem], sms: int | None = None) -> float:
        return self.roofline.prefill_ms(items, sms or self.sm_count)

    def decode_ms(self, load: DecodeLoad, sms: int | None = None, concurrent: Sequence[PrefillItem] = ()) -> float:
        solo = self.roofline.decode_ms(load, sms or self.sm_count)
        if sms is None or not concurrent:
            return solo
        share = (self.sm_count - sms) / self.sm_count
        size = min(1.0, sum(i.new for i in concurrent) / self.saturation_tokens)
        return solo * (1.0 + self.contention * share * size)

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float:
        return self.roofline.mixed_ms(items, load, self.sm_count)


def sample_grid(gpu: SyntheticGPU, decode_partitions: Iterable[int]) -> list[Sample]:
    """Solo prefill samples on every prefill partition (and all SMs), solo decode samples on every decode partition
    (and all SMs), and contended decode samples on every split."""
    parts = sorted(decode_partitions)
    samples: list[Sample] = []
    for sms in sorted({gpu.sm_count, *(gpu.sm_count - d for d in parts)}):
        for n in PREFILL_NEW:
            for r in PREFILL_REUSED:
                items = (PrefillItem(n, r),)
                samples.append(Sample("prefill", sms, gpu.prefill_ms(items, sms), prefill=items))
        for n in (256, 1024, 4096):  # batches of several prompts
            items = (PrefillItem(n, 0), PrefillItem(n // 2, 2048), PrefillItem(n * 2, 8192))
            samples.append(Sample("prefill", sms, gpu.prefill_ms(items, sms), prefill=items))
    for sms in [*parts, gpu.sm_count]:
        for bs in DECODE_BATCH:
            for ctx in DECODE_CONTEXT:
                load = DecodeLoad(bs, bs * ctx)
                samples.append(Sample("decode", sms, gpu.decode_ms(load, sms), decode=load))
    for d in parts:
        for n in (512, 2048, 8192, 16384):
            for bs in (8, 32, 128):
                for ctx in (2048, 8192):
                    items, load = (PrefillItem(n, 0),), DecodeLoad(bs, bs * ctx)
                    samples.append(Sample("contended", d, gpu.decode_ms(load, d, items), items, load))
    return samples


def synthetic_profile(gpu: SyntheticGPU, decode_partitions: Iterable[int], model_name: str) -> ProfileFile:
    """The profile `muxd profile` would write if the GPU behaved exactly like `gpu`."""
    parts = sorted(decode_partitions)
    return build_profile(sample_grid(gpu, parts), model_name=model_name, model=gpu.model,
                         gpu_name=gpu.device.name, sm_count=gpu.sm_count, decode_partitions=parts)
