"""Times one decoder layer's GEMMs (QKV, O, gate+up, down: the model's own weights) at the row buckets on each
prefill partition's stream: the table that the executor pads prefill launches by and that the solo-run model reads
(predictor/gemm_table.py). `muxd profile` measures it before any prefill sample, so every sample ran padded.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Sequence

import torch
from torch import nn

from appliance.model_zoo.llama import DecoderForCausalLM
from appliance.predictor.gemm_table import GemmTable

WARM_UP, REPS = 1, 5


def layer_linears(model: DecoderForCausalLM) -> list[nn.Linear]:
    """The GEMMs of one decoder layer (every layer has the same shapes)."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def time_gemms(linears: Sequence[nn.Linear], inputs: dict[int, torch.Tensor], rows: int,
               stream: torch.cuda.Stream | None, reps: int = REPS) -> float:
    """Median milliseconds of the GEMMs on `rows` rows (of `inputs`, one per input width) on `stream` (None: the
    current stream, or the CPU)."""
    cuda = next(iter(inputs.values())).is_cuda
    times = []
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for i in range(WARM_UP + reps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            for linear in linears:  # the GEMM alone: a tensor-parallel layer's all-reduce is not the GEMM's time
                nn.functional.linear(inputs[linear.in_features][:rows], linear.weight, linear.bias)
            if cuda:
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if i >= WARM_UP:
                times.append(ms)
    return statistics.median(times)


@torch.inference_mode()
def measure_gemm_table(model: DecoderForCausalLM, streams: dict[int, torch.cuda.Stream | None],
                       rows: Sequence[int], reps: int = REPS) -> GemmTable:
    """One layer's GEMM time at each of `rows` on each partition (`streams`: prefill SM count -> its stream)."""
    linears = layer_linears(model)
    weight = linears[0].weight
    gen = torch.Generator(device=weight.device).manual_seed(0)
    inputs = {w: torch.randn(max(rows), w, device=weight.device, dtype=weight.dtype, generator=gen)
              for w in {linear.in_features for linear in linears}}
    ms = {sms: tuple(time_gemms(linears, inputs, r, stream, reps) for r in rows) for sms, stream in streams.items()}
    return GemmTable(tuple(rows), ms)
