"""Piecewise CUDA graphs of the prefill layers, one set per stream, at fixed row counts (the padded sizes).

A short prefill's time is set by the host launching 32 layers' kernels, not by the GPU, and a host that changes
speed makes it unpredictable. Here each decoder layer is captured as two graphs, the part before attention and the
part after it; the paged attention kernel, whose plan changes with every batch, runs eagerly between them, as in
vLLM's piecewise capture. Where attention rotates q and k itself (one kernel rotates them and writes K and V at their
slots, attention/kv_write.py) that kernel stays in the first graph, reading the slots from a fixed buffer of the set
(padding rows write the scratch page), and only the paged kernel runs eagerly; otherwise the rotation and the KV write
run eagerly with it. A prefill of layers [start, end) on `size` rows then costs the host two graph launches and one
attention call per layer.

Capture cuts the model's own forward: while a set captures, the forward context's `cut` hook ends the current graph
at each attention call, runs attention on fixed buffers, and begins the next graph. Inputs (positions, the hidden
state and residual between layers) and the attention buffers are fixed tensors of the set; every layer reads and
writes the same ones, so a launch may start at any layer. Padding rows are zeros that attention never sees.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from appliance.attention import (AttentionBackend, AttentionMetadata, ForwardContext, current_context, forward_context,
                                 set_layer)
from appliance.attention.context import rotates_in_attention
from appliance.attention.kv_write import launch_rope_write_kv, rope_kernel_takes
from appliance.engine.graphs import CAPTURE_MODE, WARM_LAYERS, quiet_capture
from appliance.engine.kv_cache import KVCache
from appliance.model_zoo.layers import settle
from appliance.model_zoo.llama import DecoderForCausalLM

log = logging.getLogger("muxd.graphs")

Carried = tuple[torch.Tensor, torch.Tensor | None]
ROTATE_IN_GRAPH = True  # the rotary + K/V write kernel captured in the graphs where attention takes it (else eager)


class PrefillGraphs:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 sizes: list[int], stream: torch.cuda.Stream | None = None) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = sorted(set(sizes))
        self.stream = stream
        self.pool = torch.cuda.graph_pool_handle()  # its own: prefill on another stream may run meanwhile
        cfg, device = model.config, kv_cache.data.device
        dtype = next(model.parameters()).dtype
        n = self.sizes[-1]
        with torch.inference_mode():  # like every batch tensor: compiled layers guard on the dispatch keys
            self.positions = torch.zeros(n, dtype=torch.long, device=device)
            self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
            self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
            self.out = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
            self.slots = torch.zeros(n, dtype=torch.long, device=device)  # the K/V slot of each row (rotated form)
            self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)  # q rotated in a graph
        self.scratch_slot = kv_cache.scratch_page * kv_cache.page_size
        self.inputs: list[torch.Tensor] = []  # attention's row inputs (q, k, v or a fused QKV), sized at warm-up
        self._calls: dict[int, tuple] = {}  # per layer: how the captures call its attention (`_cut`)
        self.rotates = False  # some layer's graph rotates q and writes K/V (at `slots`, into `q`)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # per size: [before attn 0, after attn 0, ...]
        self._capturing: list[torch.cuda.CUDAGraph] | None = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self.launches = 0

    # ---- capture ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, metadata_for: Callable[[int], AttentionMetadata]) -> None:
        """Capture every size, largest first (smaller sizes reuse the pool's memory); `metadata_for(size)` is a
        valid batch of `size` tokens to capture on (the runner's scratch page)."""
        with quiet_capture():
            self._capture(metadata_for)

    def _capture(self, metadata_for: Callable[[int], AttentionMetadata]) -> None:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        stream = self.stream or torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                ctx = ForwardContext(self.backend, metadata_for(size), self.kv_cache.data)
                with forward_context(ctx):
                    self.positions.zero_()
                    self.hidden.zero_()
                    self.slots.fill_(self.scratch_slot)
                    ctx.cut = self._size_inputs
                    self._layers(size, end=WARM_LAYERS)  # warm-up on the capture stream (handles, kernel loading)
                    stream.synchronize()
                    ctx.cut = self._cut
                    self._capturing = []
                    self._layers(size, capture=True)
                    graphs, self._capturing = self._capturing, None
                if len(graphs) != 2 * self.model.num_layers:
                    raise RuntimeError(f"piecewise capture of {size} rows made {len(graphs)} graphs for "
                                       f"{self.model.num_layers} layers: each layer must call attention once")
                self._graphs[size] = graphs
        self.rotates = any(call is None for call in self._calls.values())  # some layer reads slots and q
        if all(call is None for call in self._calls.values()):
            self.inputs = []  # every layer rotates in its graph: no replay reads the row inputs' buffers
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = torch.cuda.memory_allocated() - before
        log.info("captured prefill graphs (%d..%d rows, %d sizes) in %.1f s, %.0f MiB", self.sizes[0],
                 self.sizes[-1], len(self.sizes), self.capture_seconds, self.memory_bytes / 2**20)

    def _layers(self, size: int, capture: bool = False, end: int | None = None) -> None:
        """The layers before `end` (every layer by default) on the fixed buffers' first `size` rows; when capturing,
        a graph begins at each layer's start and ends at its end (attention's cut splits it in two)."""
        layers, positions = self.model.model.layers[:end], self.positions[:size]
        hidden, residual = self.hidden[:size], self.residual[:size]
        for i, layer in enumerate(layers):
            set_layer(i)
            if capture:
                self._begin()
            h, r = layer(positions, hidden, None if i == 0 else residual)
            hidden.copy_(settle(h, hidden.dtype))  # a layer's output may be partial products (SplitKLinear)
            residual.copy_(r)
            if capture:
                self._end()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_MODE)
        self._capturing.append(graph)

    def _end(self) -> None:
        self._capturing[-1].capture_end()

    def _size_inputs(self, attend: Callable[..., torch.Tensor], rows: tuple[torch.Tensor, ...], *rest) -> torch.Tensor:
        """The forward context's attention during the warm-up before a capture: allocates the fixed buffers of
        attention's row inputs (at the largest size, warmed up first) and attends."""
        if not self.inputs:
            n = self.sizes[-1]
            self.inputs = [torch.zeros(n, *x.shape[1:], dtype=x.dtype, device=x.device) for x in rows]
        return attend(*rows, *rest)

    def _cut(self, attend: Callable[..., torch.Tensor], rows: tuple[torch.Tensor, ...], *rest) -> torch.Tensor:
        """The forward context's attention while capturing: the graph so far ends with attention's row inputs in the
        fixed buffers (the set's positions stay where they are), then attention runs eagerly on them, and the next
        graph begins reading its output buffer. Where the rotation can stay in the graph, the graph ends with q
        rotated and K/V written instead, and only the paged kernel runs eagerly. Replays make the same call
        (`_attend`)."""
        size = rows[0].shape[0]
        layer = current_context().layer  # the rest (e.g. a layer's q/k norm weights) may differ by layer
        if self._rotate(attend, rows, rest):
            self._calls[layer] = None
        else:
            fixed = []
            for buffer, x in zip(self.inputs, rows, strict=True):
                if x.data_ptr() == self.positions.data_ptr():
                    fixed.append(None)
                else:
                    buffer[:size].copy_(x)
                    fixed.append(buffer)
            self._calls[layer] = (attend, fixed, rest)
        self._end()
        out = self._attend(size, layer)
        self._begin()
        return out

    def _rotate(self, attend: Callable[..., torch.Tensor], rows: tuple[torch.Tensor, ...], rest: tuple) -> bool:
        """While capturing: rotate q into the set's q buffer and write K/V at the set's slots with the rotary kernel
        (captured), where the call is a rotating attention, the backend attends on rotated q and the kernel takes
        the tensors; returns whether it did."""
        ctx = current_context()
        if not (ROTATE_IN_GRAPH and rotates_in_attention(attend) and hasattr(self.backend, "attend_rotated")):
            return False
        (qkv, positions), (cos_sin, num_heads, q_norm, k_norm, eps) = rows, rest
        kv = ctx.kv_cache[ctx.layer]
        if not (qkv.is_cuda and num_heads == self.q.shape[1] and cos_sin.shape[-1] == self.q.shape[2]
                and rope_kernel_takes(qkv, cos_sin, num_heads, kv, q_norm, k_norm)):
            return False
        size = qkv.shape[0]
        launch_rope_write_kv(qkv, positions, cos_sin, num_heads, kv, self.slots[:size], q_norm, k_norm, eps,
                             q_out=self.q[:size])
        return True

    def _attend(self, size: int, layer: int) -> torch.Tensor:
        """Attention of `layer` (the current one) for the context's batch as captured, on the first `size` rows of
        the fixed buffers, its output into the set's output buffer."""
        call = self._calls[layer]
        if call is None:  # q rotated in the graph: the batch's rows attend, into the output's first rows
            ctx = current_context()
            tokens = ctx.metadata.num_tokens
            ctx.backend.attend_rotated(self.q[:tokens], ctx.kv_cache[layer], self.out[:tokens])
            return self.out[:size]
        attend, fixed, rest = call
        rows = (self.positions[:size] if buffer is None else buffer[:size] for buffer in fixed)
        self.out[:size].copy_(attend(*rows, *rest))
        return self.out[:size]

    # ---- replay -----------------------------------------------------------------------------------------------
    def padded(self, tokens: int) -> int:
        """The smallest captured size that holds `tokens` rows (`tokens` itself when none does: eager)."""
        return next((s for s in self.sizes if s >= tokens), tokens)

    def holds(self, rows: int) -> bool:
        """Whether a graph of exactly `rows` rows was captured (the executor pads launches to these sizes)."""
        return rows in self._graphs

    @torch.inference_mode()
    def run(self, size: int, metadata: AttentionMetadata, positions: torch.Tensor, start: int, end: int,
            input_ids: torch.Tensor | None = None, carried: Carried | None = None,
            backend: AttentionBackend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [start, end) of a batch of `metadata.num_tokens` tokens on `size` rows, on the current stream:
        from the embeddings of `input_ids` (start 0) or the `carried` activations. Returns (hidden, residual) of
        the batch's rows: views of the set's buffers when `end` is the last layer (read them before the next
        launch on this stream), copies otherwise."""
        graphs = self._graphs[size]
        tokens = metadata.num_tokens
        if carried is None:
            if start != 0:
                raise RuntimeError(f"a prefill resuming at layer {start} needs the activations it stopped with")
            self.model.embed_into(input_ids, self.hidden[:tokens])
        else:
            self.hidden[:tokens].copy_(carried[0])
            self.residual[:tokens].copy_(carried[1])
        self.positions[:tokens].copy_(positions)
        if self.rotates:
            self.slots[:tokens].copy_(metadata.slot_mapping)
        if size > tokens:
            self.hidden[tokens:size].zero_()
            self.residual[tokens:size].zero_()
            self.positions[tokens:size].zero_()
            if self.rotates:
                self.slots[tokens:size].fill_(self.scratch_slot)
                self.out[tokens:size].zero_()  # (the rotated form writes the batch's rows only)
        kv = self.kv_cache.data
        with forward_context(ForwardContext(backend or self.backend, metadata, kv)):
            for i in range(start, end):
                set_layer(i)
                graphs[2 * i].replay()
                self._attend(size, i)
                graphs[2 * i + 1].replay()
        self.launches += 1
        hidden, residual = self.hidden[:tokens], self.residual[:tokens]
        if end < self.model.num_layers:
            return hidden.clone(), residual.clone()
        return hidden, residual
