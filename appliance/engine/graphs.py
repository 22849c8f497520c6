"""CUDA graphs of the decode forward (embedding -> every layer -> logits), one per padded batch size.

A `DecodeGraphs` set is captured on one stream (a graph keeps the SM limit of the stream it was captured on, so the
multiplexing executor captures one set per SM partition) into one memory pool, largest batch first. Inputs live in
persistent buffers; each size has its own attention backend whose decode wrapper keeps fixed index buffers: `plan()`
runs on the host before a replay, only `run()` is captured. Padded rows read and write the KV cache's scratch page.
An input id may be a placeholder for a token the previous step sampled and the host has not read: the graph takes it
from the runner's token buffer (engine/launched.py), so a step can be launched before the previous one's tokens are
on the host. After capture, a split partition's set times its one-row graph (the single-token graph, tiled for all
SMs) against its two-row graph and lets one row pad to two where that runs faster.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Callable, Iterator

import numpy as np
import torch

from appliance.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context, page_layout
from appliance.attention.pinned import PinnedRing
from appliance.engine.batch import HostBatch, resolve
from appliance.engine.cuda_timing import time_cuda_queued
from appliance.engine.kv_cache import KVCache
from appliance.model_zoo.llama import DecoderForCausalLM

log = logging.getLogger("muxd.graphs")


CAPTURE_MODE = "thread_local"  # another thread's CUDA calls (a compile worker's) cannot invalidate a capture

# layers a warm-up runs eagerly before each size's capture: the first (no residual yet) and one after it. Every later
# layer runs the same compiled code and kernels as the second, so these load every kernel and library handle the
# capture meets; warming all 32 layers of an 8B took half of its prefill graphs' capture (15 of 31 s over 8
# partitions on an H200)
WARM_LAYERS = 2


@contextlib.contextmanager
def quiet_capture() -> Iterator[None]:
    """No garbage collection while graphs are captured: freeing an unreachable object's CUDA memory or events in
    the middle of a capture would invalidate it (collected once before, as torch.cuda.graph does, unless collection
    is already off: nested, as around every partition's captures, it collects once, 0.3 s with an 8B loaded)."""
    enabled = gc.isenabled()
    if enabled:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library within the block (read at each GEMM's call: captured graphs keep it)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def index_capacity(num_pages: int, size: int) -> int:
    """Page indices a size-row decode graph holds: every page of the pool plus the scratch page, and one padding
    page per row. Requests that share prefix pages may list more; such a batch runs eagerly."""
    return num_pages + 1 + size


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to max_batch (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, min(max_batch, 64) + 1, 8)) + list(range(80, max_batch + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_batch} | {max_batch})
    return sizes


class DecodeGraphs:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache,
                 make_backend: Callable[[int], AttentionBackend], max_batch: int,
                 stream: torch.cuda.Stream | None = None, pool=None, sizes: list[int] | None = None,
                 token_buffer: torch.Tensor | None = None, blas: str = "cublaslt") -> None:
        self.model, self.kv_cache, self.make_backend = model, kv_cache, make_backend
        self.blas = blas  # the BLAS library the captured GEMMs come from (config.DECODE_BLAS)
        self.token_buffer = token_buffer  # where placeholders among the input ids are read from (None: no placeholders)
        self.sizes = sorted(sizes) if sizes else capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.stream = stream
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        device = kv_cache.data.device
        n = self.max_batch
        with torch.inference_mode():  # like every batch tensor: compiled layers guard on the dispatch keys
            # one device buffer per size's inputs [positions | slots | token ids], filled by one copy per step
            self.inputs = torch.zeros(3 * n, dtype=torch.long, device=device)
            self.logits = torch.empty(n, model.config.vocab_size, dtype=torch.float32, device=device)
        self.staging = PinnedRing(torch.int64, pinned=True)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, AttentionBackend]] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self.replays = 0

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured size that holds batch_size rows, or None when the batch is too large."""
        for s in self.sizes:
            if s >= batch_size:
                return s
        return None

    def _views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, slots, token ids) of a size-row batch: views fixed at capture."""
        return self.inputs[:size], self.inputs[size:2 * size], self.inputs[2 * size:3 * size]

    def _static_metadata(self, size: int) -> AttentionMetadata:
        """Layout of `size` padding rows (one token at position 0 of the scratch page), planned at capture."""
        page = self.kv_cache.scratch_page
        qo, kv_indptr, kv_indices, last, _, _ = page_layout(
            np.zeros(size, np.int64), np.ones(size, np.int64), [np.array([page], np.int32)] * size,
            self.kv_cache.page_size)
        return AttentionMetadata(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices, last_page_len=last,
                                 seq_lens=np.ones(size, np.int32), page_size=self.kv_cache.page_size,
                                 slot_mapping=self._views(size)[1])

    def _forward(self, size: int, layers: int | None = None) -> None:
        """The step's forward on size rows: every layer, or the first `layers` (a warm-up)."""
        model = self.model
        positions, _, ids = self._views(size)
        if self.token_buffer is not None:
            ids = resolve(ids, self.token_buffer)
        hidden = model.embed(ids)
        end = model.num_layers if layers is None else min(layers, model.num_layers)
        hidden, residual = model.forward_layers(positions, hidden, None, 0, end)
        model.compute_logits(hidden, residual, out=self.logits[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, so that smaller graphs reuse the pool's memory. Their GEMMs come
        from `self.blas`: cuBLASLt by default, whose choices at decode's few rows measured 0.5-3 % faster a step
        than cuBLAS's (the down projection without a split-K reduction); prefill keeps torch's default library."""
        with quiet_capture(), blas_library(self.blas):
            self._capture()

    def _capture(self) -> None:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        stream = self.stream or torch.cuda.Stream()
        for size in reversed(self.sizes):
            backend = self.make_backend(size)
            meta = self._static_metadata(size)
            positions, slots, ids = self._views(size)
            positions.zero_()  # capture on a valid batch: token 0 at position 0 of the scratch page, every row
            ids.zero_()
            slots.fill_(self.kv_cache.scratch_page * self.kv_cache.page_size)
            ctx = ForwardContext(backend, meta, self.kv_cache.data)
            # the plan's copies (queued when the context opens) on the capture stream, before its warm-up reads them
            with torch.cuda.stream(stream), forward_context(ctx):
                self._forward(size, WARM_LAYERS)  # warm-up on the capture stream (library handles, workspaces)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=CAPTURE_MODE):
                    self._forward(size)
            self._graphs[size] = (graph, backend)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = torch.cuda.memory_allocated() - before
        log.info("captured %d decode graphs (batch %d..%d) in %.1f s, %.0f MiB", len(self.sizes), self.sizes[0],
                 self.sizes[-1], self.capture_seconds, self.memory_bytes / 2**20)

    def run(self, batch: HostBatch, num_rows: int) -> torch.Tensor:
        """Replay the graph of batch's (padded) size; batch holds num_rows real rows then padding rows.

        Returns the fp32 logits of the real rows (a view of a persistent buffer, valid until the next replay).
        """
        size = len(batch.positions)
        graph, backend = self._graphs[size]
        packed, _ = self.staging.stage([batch.positions, batch.slots, batch.input_ids])
        self.inputs[:3 * size].copy_(packed, non_blocking=True)
        self.staging.done()
        backend.prepare(batch.metadata(self.kv_cache.page_size, self._views(size)[1]))
        graph.replay()
        self.replays += 1
        return self.logits[:num_rows]

    def replay(self, size: int) -> None:
        """Replay size's graph on its last inputs and plan (for timing the device work alone)."""
        self._graphs[size][0].replay()

    @torch.inference_mode()
    def replay_ms(self, size: int, replays: int = 5, rounds: int = 3) -> float:
        """Device milliseconds of one replay of size's graph on its stream, queued back to back (`time_cuda_queued`:
        the least mean over `rounds` of `replays` replays), on its last inputs: the capture's padding rows, unless a
        step ran since."""
        with torch.cuda.stream(self.stream or torch.cuda.current_stream()):
            return time_cuda_queued(lambda: self.replay(size), iters=replays, rounds=rounds) * 1e3

    def choose_one_row_graph(self) -> dict[str, float | bool] | None:
        """One row replays the single-token graph (engine/compile.py), whose kernels are tiled for all of the GPU's
        SMs; on a partition of a few SMs the two-row graph (cuBLASLt's products) can run a row faster (the 8B on an
        H200's 64-SM partition: 6.3 ms a step against 4.7). Time both and let one row pad to two rows where faster.
        Returns the two timings and the choice (None without both sizes)."""
        if 1 not in self._graphs or 2 not in self._graphs:
            return None
        one, two = self.replay_ms(1), self.replay_ms(2)
        padded = two < one
        if padded:
            self.pad_one_row()
        return {"one_row_ms": round(one, 3), "two_row_ms": round(two, 3), "padded": padded}

    def pad_one_row(self) -> None:
        """One row replays the two-row graph from now on (its second row padding); the one-row graph is dropped."""
        if 2 not in self._graphs:
            raise RuntimeError("one row pads to the two-row graph, and this set has none")
        self.sizes = [s for s in self.sizes if s != 1]
        self._graphs.pop(1, None)
