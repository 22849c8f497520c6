"""ModelRunner: executes a StepPlan on the model — builds token batches and attention metadata, runs decode (a CUDA
graph replay where one is captured) and layer-range prefill forwards, keeps unfinished prefills' activations between
steps, and samples into the token buffer the next step may read its input ids from (engine/launched.py).

It decides nothing: which requests run, over which tokens and layers, comes from the plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import groupby
from typing import Callable

import numpy as np
import torch

from appliance.attention import (
    AttentionBackend,
    ForwardContext,
    forward_context,
    make_backend,
    new_workspace,
    resolve_backend_name,
)
from appliance.engine.batch import BatchBuilder, TokenBatch, resolve
from appliance.engine.graphs import DecodeGraphs, index_capacity
from appliance.engine.kv_cache import KVCache
from appliance.engine.launched import TokenBuffer
from appliance.engine.logits import PenaltyCounts, apply_grammars, process_logits
from appliance.engine.logprobs import DEFAULT_MODE, LogprobBatch, asking_rows, prompt_logprobs, sampled_logprobs
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.prefill_graphs import PrefillGraphs
from appliance.engine.request import Request, SamplingParams, TokenLogprob
from appliance.engine.sampler import sample_tensor
from appliance.model_zoo.llama import DecoderForCausalLM
from appliance.model_zoo.rope import dynamic_lengths, rope_lengths

Logits = tuple[list[str], torch.Tensor]  # request ids and their fp32 next-token logits rows
Sampled = tuple[torch.Tensor, dict[str, tuple[LogprobBatch, int]]]  # token ids (device), log-probabilities by request


@dataclass
class _Partial:
    """A prefill chunk that has run some layers: its activations wait here for the next layer range."""

    hidden: torch.Tensor
    residual: torch.Tensor | None
    layer_end: int


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, attention_backend: str = "auto",
                 max_rows: int = 1024, decode_kernel: str = "auto", decode_blas: str = "cublaslt") -> None:
        """max_rows: the most tokens one step samples (one per running request: at least --max-num-seqs);
        decode_kernel: which attention kernels CUDA-graph decode batches run (attention.uses_triton_decode);
        decode_blas: the BLAS library of the decode graphs' GEMMs (config.DECODE_BLAS)."""
        self.model, self.kv_cache = model, kv_cache
        self.device = kv_cache.data.device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = model.num_layers
        self.backend_name = resolve_backend_name(attention_backend, model.config, self.dtype, self.device)
        self.backend = make_backend(self.backend_name, model.config, self.dtype, self.device)
        self.decode_kernel, self.decode_blas = decode_kernel, decode_blas
        self.batches = BatchBuilder(kv_cache.page_size, self.device)
        self.penalties = PenaltyCounts(model.config.vocab_size, self.device, max_rows)  # penalised requests' counts
        self.graphs: DecodeGraphs | None = None
        self.use_graphs = True  # replay captured graphs when a batch fits (off: the same forward, eagerly)
        self.last_replayed = False  # whether the latest layers run (`_layers`) replayed piecewise prefill graphs
        self.gpu_wait_s = 0.0   # time the host spent blocked on the device (reading sampled tokens)
        self.tokens = TokenBuffer(max_rows, self.device)  # the latest step's sampled ids, for the next one's inputs
        self._partials: dict[str, _Partial] = {}
        self._prompt_logprobs: dict[str, list[tuple[int, LogprobBatch]]] = {}
        self.logprobs_mode = DEFAULT_MODE  # what logprobs report (engine/logprobs.py; --logprobs-mode)

    # ---- set-up -----------------------------------------------------------------------------------------------
    def graph_set(self, max_batch: int, stream: torch.cuda.Stream | None = None, pool=None,
                  sizes: list[int] | None = None) -> DecodeGraphs | None:
        """A set of decode graphs (not captured yet) for `stream`, its attention backends sharing one workspace;
        None when the device or backend cannot capture."""
        if self.device.type != "cuda" or not self.backend.supports_cuda_graph:
            return None
        workspace = new_workspace(self.backend_name, self.device)

        def backend_for(size: int):
            return make_backend(self.backend_name, self.model.config, self.dtype, self.device,
                                graph_batch_size=size, max_pages=index_capacity(self.kv_cache.num_pages, size),
                                shared_workspace=workspace, decode_kernel=self.decode_kernel,
                                page_size=self.kv_cache.page_size)

        return DecodeGraphs(self.model, self.kv_cache, backend_for, max_batch, stream=stream, pool=pool, sizes=sizes,
                            token_buffer=self.tokens.ids, blas=self.decode_blas)

    def capture_graphs(self, max_batch: int, stream: torch.cuda.Stream | None = None,
                       sizes: list[int] | None = None) -> DecodeGraphs | None:
        """Capture the runner's own decode graphs up to max_batch rows (or of `sizes`) on `stream`; None when it
        cannot."""
        self.graphs = self.graph_set(max_batch, stream, sizes=sizes)
        if self.graphs is not None:
            self.graphs.capture()
        return self.graphs

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """Dummy forwards on the scratch page (a prefill of num_tokens rows, decodes of 1 and 2 rows) so that
        compilation, kernel loading and library handles happen before serving and before graph capture."""
        for lens in ([num_tokens], [1], [1, 1]):
            batch = self.scratch_batch(lens)
            hidden, residual = self._layers(batch, 0, self.num_layers, None)
            self._logits_at(hidden, residual, batch.last_rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def warm_kernels(self, prefill_rows: list[int], logits_rows: int, head: bool = True,
                     backend: AttentionBackend | None = None) -> None:
        """Launch, on the current stream, the kernels that launches outside captured graphs choose by their size: one
        eager prefill layer at each of `prefill_rows` rows, the LM head (`head`) and greedy sampling at every row
        count up to `logits_rows`, random sampling at powers of two up to it. The driver loads a kernel's module at
        its first launch in a context (lazy loading): tens of milliseconds of host in the middle of a step, the
        first time a size is served."""
        for rows in prefill_rows:
            self._layers(self.scratch_batch([rows]), 0, 1, None, backend=backend)
        hidden = torch.zeros(1, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        vocab = self.model.config.vocab_size
        greedy, random = SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, top_k=50, min_p=0.05)
        for n in range(1, logits_rows + 1):
            if head:
                logits = self._logits_at(hidden, None, np.zeros(n, np.int64))
            else:
                logits = torch.zeros(n, vocab, dtype=torch.float32, device=self.device)
            sample_tensor(logits, [greedy] * n, [0] * n)
            if n & (n - 1) == 0 or n == logits_rows:
                sample_tensor(logits, [random] * n, [0] * n)

    def scratch_batch(self, lens: list[int]) -> TokenBatch:
        """Sequences of token 0 whose every page is the scratch page."""
        page, size = self.kv_cache.scratch_page, self.kv_cache.page_size
        pages = [np.full(-(-n // size), page, np.int32) for n in lens]
        return self.batches.build_raw(np.zeros(len(lens), np.int64), np.array(lens, np.int64), pages,
                                      [0] * sum(lens))

    def use_partials_on(self, request_id: str, stream: torch.cuda.Stream) -> None:
        """The request's unfinished prefill continues on `stream`: keep its activations' memory from being reused
        by the stream that made them until `stream` has read them."""
        partial = self._partials.get(request_id)
        if partial is not None:
            for t in (partial.hidden, partial.residual):
                if t is not None:
                    t.record_stream(stream)

    def release(self, request_id: str) -> None:
        """Forget a request's executor state (it finished, was preempted or aborted)."""
        self._partials.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self.batches.release(request_id)
        self.penalties.release(request_id)

    # ---- one step ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan, requests: dict[str, Request]) -> dict[str, int]:
        """Run the plan; returns the sampled token of every request that finished a prefill or decoded."""
        ids, logits = self.forward(plan, requests)
        return dict(zip(ids, self.read_tokens(self.sample(ids, logits, requests)[0])))

    def sample(self, ids: list[str], logits: torch.Tensor, requests: dict[str, Request],
               counts: list[int] | None = None, out: torch.Tensor | None = None) -> Sampled:
        """Sampled token ids of the rows (a device tensor; no host synchronisation), after each request's logits
        processors, and {request id: (batch, row)} of the rows that ask for their log-probability (read with
        `LogprobBatch.get` when the token is reported). `counts`: each row's output tokens before this one (default:
        the requests' as they are now); `out`: where the ids are written (default: a new tensor)."""
        if not ids:
            return torch.empty(0, dtype=torch.long), {}
        reqs = [requests[i] for i in ids]
        counts = counts if counts is not None else [r.num_output_tokens for r in reqs]
        # the grammars' masks first: raw logprobs are over the tokens a grammar allows, as vLLM's
        logits = apply_grammars(logits, reqs)
        asking = asking_rows(logits, reqs, self.logprobs_mode)
        logits = process_logits(logits, reqs, counts, grammar=False, penalties=self.penalties)
        tokens = sample_tensor(logits, [r.sampling for r in reqs], counts, out)
        penalised = [i for i, r in enumerate(reqs) if r.sampling.penalised]
        if penalised:  # (process_logits gave them their rows)
            self.penalties.count([reqs[i] for i in penalised], penalised, tokens)
        return tokens, sampled_logprobs(logits, reqs, tokens, self.logprobs_mode, asking)

    def take_prompt_logprobs(self, request_id: str, prompt_len: int) -> list[TokenLogprob | None] | None:
        """Its prompt tokens' log-probabilities (None for the first), once its prefill has run every layer."""
        parts = self._prompt_logprobs.pop(request_id, None)
        if parts is None:
            return None
        out: list[TokenLogprob | None] = [None] * prompt_len
        for start, batch in parts:
            for i in range(len(batch)):
                out[start + i] = batch.get(i)
        return out

    def _keep_prompt_logprobs(self, works: list[PrefillWork], reqs: list[Request], hidden: torch.Tensor,
                              residual: torch.Tensor | None, last_rows: np.ndarray) -> None:
        """Prompt log-probabilities of the works (after their last layer) whose request asks for them."""
        for w, r, last in zip(works, reqs, last_rows):
            if not r.wants_prompt_logprobs:
                continue
            first = int(last) - w.num_tokens + 1
            self._record_prompt_logprobs(r, w, self._logits_at(hidden, residual, np.arange(first, int(last) + 1)))

    def _record_prompt_logprobs(self, r: Request, w: PrefillWork, logits: torch.Tensor) -> None:
        part = prompt_logprobs(logits, r, w.token_start, self.logprobs_mode)
        if part is not None:
            self._prompt_logprobs.setdefault(r.request_id, []).append(part)

    def read_tokens(self, tokens: torch.Tensor) -> list[int]:
        """Token ids on the host: waits for the current stream's work (counted as time waiting for the device)."""
        start = time.perf_counter()
        out = tokens.tolist()
        self.gpu_wait_s += time.perf_counter() - start
        return out

    def forward(self, plan: StepPlan, requests: dict[str, Request], pad_rows: Callable[[int], int] | None = None,
                graphs: PrefillGraphs | None = None) -> Logits:
        """Run the plan's forwards; fp32 next-token logits of every request that decoded or finished its prefill. A
        mixed step runs on the rows `pad_rows` asks for, a replay of `graphs` where it has captured that many."""
        parts: list[Logits] = []
        if plan.mixed:
            parts.append(self._mixed(plan, requests, pad_rows, graphs))
        else:
            if plan.decode:
                parts.append(self.decode([requests[i] for i in plan.decode]))
            for (start, end), group in groupby(plan.prefill, key=lambda w: (w.layer_start, w.layer_end)):
                parts.append(self.prefill(list(group), requests, start, end))
        parts = [p for p in parts if p[0]]
        if not parts:
            return [], torch.empty(0)
        if len(parts) == 1:
            return parts[0]
        return [i for ids, _ in parts for i in ids], torch.cat([logits for _, logits in parts])

    def decode(self, reqs: list[Request], graphs: DecodeGraphs | None = None,
               backend: AttentionBackend | None = None) -> Logits:
        """One decode step of `reqs` on the current stream: a replay of `graphs` (default: the runner's own) when
        the batch fits a captured size, else an eager forward with `backend` (default: the runner's)."""
        graphs = graphs if graphs is not None else self.graphs
        ids = [r.request_id for r in reqs]
        spans = [(n - 1, n) for n in [r.num_tokens for r in reqs]]
        size = graphs.padded_size(len(reqs)) if (graphs is not None and self.use_graphs) else None
        if size is not None:  # (the graph reads placeholders from the token buffer itself)
            host = self.batches.layout(reqs, spans, pad_rows=size - len(reqs), pad_page=self.kv_cache.scratch_page)
            if len(host.kv_indices) <= index_capacity(self.kv_cache.num_pages, size):
                return ids, graphs.run(host, len(reqs))
        batch = self._resolved(self.batches.build(reqs, spans))
        hidden, residual = self._layers(batch, 0, self.num_layers, None, backend=backend)
        return ids, self.model.compute_logits(hidden, residual)

    def _mixed(self, plan: StepPlan, requests: dict[str, Request], pad_rows: Callable[[int], int] | None = None,
               graphs: PrefillGraphs | None = None) -> Logits:
        """Decode rows and whole-model prefill chunks in one forward; logits for the decode rows and the chunks that
        end their request's prompt."""
        for w in plan.prefill:
            if (w.layer_start, w.layer_end) != (0, self.num_layers):
                raise RuntimeError(f"a mixed step runs prefills over all layers; {w.request_id} asks for "
                                   f"[{w.layer_start}, {w.layer_end})")
        dec = [requests[i] for i in plan.decode]
        pre = [requests[w.request_id] for w in plan.prefill]
        spans = [(r.num_tokens - 1, r.num_tokens) for r in dec] + [(w.token_start, w.token_end) for w in plan.prefill]
        batch = self._resolved(self.batches.build(dec + pre, spans))
        hidden, residual = self._layers(batch, 0, self.num_layers, None, dec + pre, pad_rows=pad_rows, graphs=graphs)
        self._keep_prompt_logprobs(list(plan.prefill), pre, hidden, residual, batch.last_rows[len(dec):])
        picked = list(range(len(dec))) + [len(dec) + i for i, (w, r) in enumerate(zip(plan.prefill, pre))
                                          if w.token_end == r.num_tokens]
        ids = list(plan.decode) + [w.request_id for w in plan.prefill]
        return [ids[i] for i in picked], self._logits_at(hidden, residual, batch.last_rows[picked])

    def prefill(self, works: list[PrefillWork], requests: dict[str, Request], start: int, end: int,
                backend: AttentionBackend | None = None, pad_rows: Callable[[int], int] | None = None,
                graphs: PrefillGraphs | None = None) -> Logits:
        """Layers [start, end) of the works' token chunks on the current stream; logits of the chunks that end their
        prompt once the last layer has run (activations of unfinished ranges wait in the runner). `pad_rows` maps
        the token count to the rows the layers run (the executor's GEMM buckets; the padding rows are dropped);
        `graphs` replays its piecewise graphs where it has captured that many rows."""
        reqs = [requests[w.request_id] for w in works]
        spans = [(w.token_start, w.token_end) for w in works]
        carried = None
        if start > 0:
            partials = [self._partials.pop(w.request_id) for w in works]
            for w, p in zip(works, partials):
                if p.layer_end != start:
                    raise RuntimeError(f"prefill of {w.request_id} resumes at layer {start} but stopped at "
                                       f"{p.layer_end}")
            carried = (torch.cat([p.hidden for p in partials]),
                       None if partials[0].residual is None else torch.cat([p.residual for p in partials]))
        batch = self.batches.build(reqs, spans, with_ids=carried is None)
        hidden, residual = self._layers(batch, start, end, carried, reqs, backend, pad_rows, graphs)
        if end < self.num_layers:
            sizes = [w.num_tokens for w in works]
            res_parts = residual.split(sizes) if residual is not None else [None] * len(works)
            for w, h, r in zip(works, hidden.split(sizes), res_parts):
                self._partials[w.request_id] = _Partial(h, r, end)
            return [], torch.empty(0)
        self._keep_prompt_logprobs(works, reqs, hidden, residual, batch.last_rows)
        done = [i for i, (w, r) in enumerate(zip(works, reqs)) if w.token_end == r.num_tokens]
        if not done:
            return [], torch.empty(0)
        return [works[i].request_id for i in done], self._logits_at(hidden, residual, batch.last_rows[done])

    def _resolved(self, batch: TokenBatch) -> TokenBatch:
        """The batch with its placeholders replaced by the ids the previous step sampled (on the device)."""
        if batch.placeholders:
            batch.input_ids = resolve(batch.input_ids, self.tokens.ids)
            batch.placeholders = False
        return batch

    def _logits_at(self, hidden: torch.Tensor, residual: torch.Tensor | None, rows: np.ndarray) -> torch.Tensor:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if self.device.type == "cuda":
            # through the batches' pinned ring: a blocking copy would wait for every kernel queued on the stream,
            # and a fresh pinned block (`pin_memory()`) is one more host allocation a step
            staging = self.batches.staging
            packed, _ = staging.stage([rows])
            index = packed.to(self.device, non_blocking=True)
            staging.done()
        else:
            index = torch.from_numpy(rows)
        return self.model.compute_logits(hidden[index], None if residual is None else residual[index])

    def _layers(self, batch: TokenBatch, start: int, end: int,
                carried: tuple[torch.Tensor, torch.Tensor | None] | None, reqs: list[Request] | None = None,
                backend: AttentionBackend | None = None, pad_rows: Callable[[int], int] | None = None,
                graphs: PrefillGraphs | None = None):
        """Layers [start, end) over the batch (embedding first when nothing is carried over), on the rows
        `pad_rows` asks for: zero rows appended, which attention leaves out and the result drops; a replay of
        `graphs` where it has captured that many rows."""
        lengths = None
        if reqs is not None and self.model.config.rope.length_dependent:
            # dynamic NTK: prompt rows take their prompt's length (other rows default to position + 1)
            lengths = dynamic_lengths(batch.positions, [r.num_prompt_tokens for r in reqs], batch.metadata.query_lens)
        rows = batch.metadata.num_tokens
        padded = pad_rows(rows) if pad_rows is not None and lengths is None else rows
        self.last_replayed = graphs is not None and lengths is None and self.use_graphs and graphs.holds(padded)
        if self.last_replayed:
            return graphs.run(padded, batch.metadata, batch.positions, start, end,
                              input_ids=batch.input_ids if carried is None else None, carried=carried,
                              backend=backend or self.backend)
        if carried is None:
            hidden, residual = self.model.embed(batch.input_ids), None
        else:
            hidden, residual = carried
        positions = batch.positions
        extra = padded - rows
        if extra > 0:
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, extra))
            residual = None if residual is None else torch.nn.functional.pad(residual, (0, 0, 0, extra))
            positions = torch.nn.functional.pad(positions, (0, extra))
        ctx = ForwardContext(backend or self.backend, batch.metadata, self.kv_cache.data)
        with forward_context(ctx), rope_lengths(lengths):
            hidden, residual = self.model.forward_layers(positions, hidden, residual, start, end)
        if extra > 0:
            hidden, residual = hidden[:rows], None if residual is None else residual[:rows]
        return hidden, residual
