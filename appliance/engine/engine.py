"""Engine: validates and admits requests, and runs steps (plan -> execute -> update -> detokenize -> outputs).

Single-threaded; `AsyncEngine` (async_engine.py) drives it from a background thread for the server. The synchronous
`generate` is the small Python API for scripts and tests.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.attention import BACKEND_NAMES
from appliance.engine.compile import compile_layers
from appliance.multiplex.executor import Executor
from appliance.multiplex.partitions import SPATIAL_POLICIES, PartitionSet, partitions_available
from appliance.engine.detokenizer import Detokenizer
from appliance.engine.kv_cache import KVCache, PagePool
from appliance.engine.request import Request, RequestOutput, SamplingParams
from appliance.engine.runner import ModelRunner
from appliance.engine.scheduler import Scheduler, StepPlan
from appliance.errors import CapacityError, ConfigError, RequestError
from appliance.model_zoo.llama import DecoderForCausalLM
from appliance.model_zoo.loader import load_model
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.predictor.workload import decode_load, prefill_items

CPU_DEFAULT_KV_BYTES = 512 << 20
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for prompt + max_tokens over the context
GRAPH_RESERVE_BYTES = 512 << 20  # graph pool, attention workspaces of the captured sizes
PREFILL_WORKSPACE_BYTES = 160 << 20  # a prefill attention backend's workspaces
log = logging.getLogger("muxd.engine")


@dataclass
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None            # explicit pool size; else from kv_cache_memory / memory fraction
    kv_cache_memory: int | None = None      # bytes for the KV cache
    gpu_memory_utilization: float = 0.9     # fraction of device memory muxd may use in total (CUDA only)
    max_num_seqs: int = 256                 # requests prefilling or decoding at once
    max_model_len: int | None = None        # prompt + output tokens per request; default: the model's limit
    max_prefill_tokens: int = 8192          # prompt tokens admitted per step (at least one request always)
    max_waiting: int = 4096                 # queued requests before add_request refuses with CapacityError
    enable_prefix_caching: bool = True
    planner: str = "serial"                 # policy: mux, chunked, serial, layerwise
    layers_per_step: int = 1                # for the layerwise planner
    chunk_budget: int | None = None         # tokens per step of the chunked planner; None: tuned to the contract's
                                            # TBT target from the profile, 2048 without one
    slo: str | None = None                  # SLO contract file; None: the built-in default contract
    profile: str | None = None              # latency profile (mux; chunked's budget); mismatched: the roofline prior
    attention_backend: str = "auto"        # auto: flashinfer on CUDA when installed, else torch
    compile: bool | None = None             # torch.compile each layer; None: on CUDA, off on CPU
    cuda_graph: bool = True                 # capture decode CUDA graphs (CUDA and a graph-capable backend only)
    max_graph_batch: int | None = None      # largest captured decode batch; default min(max_num_seqs, 256)
    prefill_graph_rows: int = 512           # prefill launches of up to this many tokens replay piecewise graphs
    multiplex: bool | None = None           # SM partitions; None: on with CUDA for the spatial policies
    partition_granularity: int = 16         # decode partitions are multiples of this many SMs
    layerwise_decode_sms: int = 64          # the layerwise policy's fixed decode partition
    preemption: bool = True                 # mux: a short prompt may preempt a long prefill between layers
    mixed_chunks: bool = False              # mux: TBT-sized prompt chunks beside decode where they beat the split

    def validate(self) -> None:
        from appliance.slo.policies import POLICIES

        if self.attention_backend not in BACKEND_NAMES:
            raise ConfigError(f"attention backend {self.attention_backend!r} is unknown; choose one of "
                              f"{', '.join(BACKEND_NAMES)}")
        if self.max_graph_batch is not None and self.max_graph_batch < 1:
            raise ConfigError(f"max_graph_batch must be >= 1, got {self.max_graph_batch}")
        if self.planner not in POLICIES:
            raise ConfigError(f"planner {self.planner!r} is unknown; choose one of {', '.join(POLICIES)}")
        if self.chunk_budget is not None and self.chunk_budget < 1:
            raise ConfigError(f"chunk_budget must be >= 1, got {self.chunk_budget}")
        if self.prefill_graph_rows < 0:
            raise ConfigError(f"prefill_graph_rows must be >= 0 (0: no prefill graphs), got {self.prefill_graph_rows}")
        for name in ("page_size", "max_num_seqs", "max_prefill_tokens", "max_waiting", "layers_per_step",
                     "partition_granularity", "layerwise_decode_sms"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class Completion:
    """Result of the synchronous API for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int


class Engine:
    def __init__(self, model: DecoderForCausalLM, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        self.model, self.tokenizer = model, tokenizer
        mcfg = model.config
        # before compile and warm-up: a sliding window shorter than the context is refused at once
        mcfg.check_max_model_len(config.max_model_len or mcfg.max_model_len)
        param = next(model.parameters())
        device, cuda = param.device, param.device.type == "cuda"
        self.startup: dict[str, float] = {}
        self.compiled = False
        if config.compile if config.compile is not None else cuda:
            self.compiled = compile_layers(model)
        self.partitions = self._partitions(device)
        reserve = 0
        if cuda or self.compiled:
            start = time.perf_counter()
            reserve = self._profile_activations(config.max_prefill_tokens if cuda else 32)
            self.startup["warm_up_s"] = time.perf_counter() - start
        num_pages = self._pool_size(device, param.dtype, reserve)
        self.kv_cache = KVCache(mcfg, num_pages, config.page_size, param.dtype, device)
        # dynamic NTK rotates a prompt's K by the prompt's length, so equal prefixes need not share pages
        prefix_caching = config.enable_prefix_caching and not mcfg.rope.length_dependent
        if config.enable_prefix_caching and not prefix_caching:
            log.info("prefix caching is off: with %s rope scaling K depends on the sequence length", mcfg.rope.type)
        self.pool = PagePool(num_pages, config.page_size, prefix_caching)
        capacity = num_pages * config.page_size
        self.max_model_len = config.max_model_len or min(mcfg.max_model_len, capacity)
        if self.max_model_len > capacity:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the KV cache ({num_pages} pages of "
                              f"{config.page_size} = {capacity} tokens); lower it or give the cache more memory")
        self.scheduler = Scheduler(self.pool, mcfg.num_layers, self._planner(device), config.max_num_seqs)
        self.runner = ModelRunner(model, self.kv_cache, config.attention_backend)
        self.executor = Executor(self.runner, self.partitions)
        self._prefills_mark = 0  # the executor's prefill launches already handed to the planner
        if cuda and config.cuda_graph:
            start = time.perf_counter()
            self.executor.capture(self.max_graph_batch)
            self.startup["graph_capture_s"] = time.perf_counter() - start
            self.startup["graph_memory_bytes"] = self.executor.graph_memory_bytes()
        if self.predictor is not None and self.executor.multiplexed:
            self.predictor.decode_partitions = [p.decode_sms for p in self.partitions.splits]
        self.executor.pad_prefills(self._gemm_table(), config.max_prefill_tokens,
                                   self.predictor.sm_count if self.predictor is not None else 0)
        if self.prefill_graph_rows:
            start = time.perf_counter()
            self.executor.capture_prefill(self.prefill_graph_rows)
            self.startup["prefill_graph_capture_s"] = time.perf_counter() - start
            self.startup["graph_memory_bytes"] = self.executor.graph_memory_bytes()
        graphs = self.runner.graphs
        log.info("engine: attention %s, compiled %s, decode graphs %s, %s, %d KV pages of %d tokens",
                 self.runner.backend_name, self.compiled,
                 f"{graphs.sizes[0]}..{graphs.sizes[-1]}" if graphs else "off",
                 f"SM partitions (decode/prefill) {', '.join(f'{p.decode_sms}/{p.prefill_sms}' for p in self.partitions.splits)}"
                 if self.executor.multiplexed else "no SM partitions", num_pages, config.page_size)
        self.eos_token_ids = set(tokenizer.eos_token_ids if tokenizer else mcfg.eos_token_ids)
        self._detok: dict[str, Detokenizer] = {}
        self._counter = itertools.count()
        self.num_preemptions = 0

    def _partitions(self, device: torch.device) -> PartitionSet:
        """SM partitions when multiplexing (default: CUDA and a spatial policy), else the null partition."""
        cfg = self.config
        want = cfg.multiplex if cfg.multiplex is not None else (
            device.type == "cuda" and cfg.planner in SPATIAL_POLICIES and partitions_available())
        if not want:
            return PartitionSet.null()
        if device.type != "cuda":
            raise ConfigError(f"--multiplex needs a CUDA device; the model is on {device}")
        return PartitionSet.create(device, cfg.partition_granularity)

    def _planner(self, device: torch.device):
        """The policy's planner; the contract (and for mux, or chunked without a budget but with a profile, the
        predictor) come from the config's files."""
        from appliance.predictor.profile import load_predictor
        from appliance.slo.contract import default_contract, load_contract
        from appliance.slo.policies import PolicyOptions, build_planner

        cfg = self.config
        self.contract = load_contract(cfg.slo) if cfg.slo else default_contract()
        self.predictor = None
        tune_chunks = cfg.planner == "chunked" and cfg.chunk_budget is None and cfg.profile is not None
        if cfg.planner == "mux" or tune_chunks:
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            self.predictor = load_predictor(cfg.profile, self.model.config, gpu)
        options = PolicyOptions(max_prefill_tokens=cfg.max_prefill_tokens, layers_per_step=cfg.layers_per_step,
                                chunk_budget=cfg.chunk_budget, preemption=cfg.preemption,
                                layerwise_decode_sms=cfg.layerwise_decode_sms, mixed_chunks=cfg.mixed_chunks)
        planner = build_planner(cfg.planner, options, self.contract, self.predictor)
        if tune_chunks:
            log.info("chunked prefill: a budget of %d tokens per step, the largest whose step the predictor (%s) "
                     "keeps within the contract's TBT target of %.0f ms", planner.token_budget, self.predictor.source,
                     self.contract.slo_for(None).tbt_ms)
        return planner

    def slo_class(self, name: str | None) -> str | None:
        """Check a request's SLO class against the contract (RequestError naming the classes when unknown)."""
        if name is not None and name not in self.contract.classes:
            raise RequestError(f"SLO class {name!r} is not in contract {self.contract.name!r}; classes: "
                               f"{', '.join(self.contract.classes)}", "slo_class")
        return name

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | torch.dtype | None = None,
                        device: str | torch.device = "cpu", load_format: str = "auto",
                        config: EngineConfig | None = None) -> "Engine":
        model = load_model(path, dtype=dtype, device=device, load_format=load_format)
        tokenizer = Tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        return cls(model, tokenizer, config)

    @property
    def max_graph_batch(self) -> int:
        return self.config.max_graph_batch or min(self.config.max_num_seqs, 256)

    @property
    def prefill_graph_rows(self) -> int:
        """Prefill launches of up to this many tokens run as piecewise graphs (0: none, as without CUDA, decode
        graphs or a graph-capable attention backend; never above a step's prefill tokens)."""
        cfg = self.config
        capable = (cfg.cuda_graph and next(self.model.parameters()).is_cuda
                   and self.runner.backend.supports_cuda_graph)
        return min(cfg.prefill_graph_rows, cfg.max_prefill_tokens) if capable else 0

    def _gemm_table(self):
        """The profile's GEMM row buckets (None without), padding graph-sized launches within this engine's
        prefill graphs; a profile measured with other prefill graphs is used as it is, with a warning."""
        gemm = self.predictor.gemm if self.predictor is not None else None
        if gemm is None:
            return None
        rows = self.prefill_graph_rows
        if gemm.graph_rows != rows:
            log.warning("the profile was measured with prefill graphs up to %d rows, this engine runs them up to %d: "
                        "its prefill predictions may be off (profile again with the same --prefill-graph-rows)",
                        gemm.graph_rows, rows)
            gemm = dataclasses.replace(gemm, graph_rows=rows)
            self.predictor.latency = dataclasses.replace(self.predictor.latency, gemm=gemm)
        return gemm

    def _profile_activations(self, num_tokens: int) -> int:
        """Run the warm-up forwards (compiling the layers) on a throw-away KV cache of a few pages and return the
        device memory the largest prefill step needs beyond the weights, plus sampling and graph headroom."""
        mcfg, cfg = self.model.config, self.config
        param = next(self.model.parameters())
        tmp = KVCache(mcfg, -(-num_tokens // cfg.page_size) + 1, cfg.page_size, param.dtype, param.device)
        cuda = param.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(param.device)
            base = torch.cuda.memory_allocated(param.device)
        runner = ModelRunner(self.model, tmp, cfg.attention_backend)
        runner.warm_up(num_tokens)
        if not cuda:
            return 0
        peak = torch.cuda.max_memory_allocated(param.device) - base
        del runner, tmp
        torch.cuda.empty_cache()
        sampling = cfg.max_num_seqs * mcfg.vocab_size * 4 * 6  # logits, probs, sort values + indices, noise
        graphs = self.max_graph_batch * mcfg.vocab_size * 4 + GRAPH_RESERVE_BYTES if cfg.cuda_graph else 0
        # prefill graphs: fixed buffers and a pool for one layer's activations at their largest size, taken as twice
        # the warm-up prefill's peak per token
        rows = min(cfg.prefill_graph_rows, num_tokens) if cfg.cuda_graph else 0
        graphs += 2 * peak * rows // num_tokens
        # with SM partitions: graph sets and a prefill attention workspace per partition
        return peak + sampling + graphs * len(self.partitions.partitions) + PREFILL_WORKSPACE_BYTES * (
            len(self.partitions.partitions) if not self.partitions.full.is_null else 0)

    def _pool_size(self, device: torch.device, dtype: torch.dtype, reserve: int = 0) -> int:
        """Pages for the KV cache: explicit, or what the memory budget holds after `reserve` bytes for activations,
        but no more than twice what max_num_seqs requests of full length need (a small model on a large GPU would
        otherwise take it all)."""
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        per_page = KVCache.bytes_per_page(self.model.config, cfg.page_size, dtype)
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(cfg.gpu_memory_utilization * total) - (total - free) - reserve
        else:
            budget = CPU_DEFAULT_KV_BYTES
        if budget < per_page:
            raise ConfigError(f"KV cache budget of {budget} bytes holds no page ({per_page} bytes per page of "
                              f"{cfg.page_size} tokens); raise --kv-cache-memory or --gpu-memory-utilization")
        model_len = cfg.max_model_len or self.model.config.max_model_len
        useful = 2 * cfg.max_num_seqs * -(-model_len // cfg.page_size)
        return min(budget // per_page, useful)

    # ---- requests ---------------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, add_special_tokens: bool = True) -> Request:
        """Tokenize and validate; raises RequestError naming the bad field. Touches no engine state."""
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; send token ids", "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt")
        if not ids:
            raise RequestError("prompt is empty", "prompt")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has none", "stop")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens "
                               "and at least one must be left to generate", "prompt", CONTEXT_LENGTH_EXCEEDED)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                               f"context of {self.max_model_len} tokens", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
        rid = request_id if request_id is not None else f"req-{next(self._counter)}"
        return Request(rid, ids, params)

    def submit(self, request: Request) -> str:
        if request.request_id in self.scheduler.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use", "request_id")
        self.slo_class(request.slo_class)
        limit = self.config.max_waiting
        if self.config.slo:
            limit = min(limit, self.contract.overload.queue_limit)
        if len(self.scheduler.waiting) >= limit:
            raise CapacityError(f"{len(self.scheduler.waiting)} requests are waiting (limit {limit}); retry later")
        admission = getattr(self.scheduler.planner, "admission_check", None)
        retry = admission(self.scheduler, request) if admission is not None else None
        if retry is not None:
            raise CapacityError(f"the server is too busy to meet this request's TTFT target (SLO contract "
                                f"{self.contract.name!r} sheds load); retry after {retry:.0f} s", retry_after=retry)
        if self.tokenizer is not None:
            self._detok[request.request_id] = Detokenizer(self.tokenizer, request.prompt_token_ids,
                                                          request.sampling.stop)
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self.submit(self.make_request(prompt, params, request_id))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free all its pages now; False if it is not (or no longer) here.

        Kernels already launched for it run to their end first, so its pages never go to another request while
        they may still be written."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self.executor.settle(request_id)
        self.scheduler.finish(request, "abort", aborted=True)
        self.executor.release(request_id)
        self._detok.pop(request_id, None)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- steps ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: merge prefills that finished, plan, launch (decode waits for its tokens, prefill may
        finish iterations later), record the decode step. With nothing to launch, wait for in-flight prefill."""
        outputs = self._merge(self.executor.poll())
        plan = self.scheduler.schedule()
        for rid in self.scheduler.drain_preempted():
            self.executor.release(rid)
            self.num_preemptions += 1
        if plan.empty:
            if self.executor.has_inflight():
                self.executor.wait()
                return outputs + self._merge(self.executor.poll())
            if self.scheduler.has_work() and not outputs:
                raise RuntimeError(f"planner {self.scheduler.planner.name!r} planned nothing with "
                                   f"{len(self.scheduler.requests)} requests pending")
            return outputs
        sampled = self.executor.launch(plan, self.scheduler.requests)
        self._observe(plan)
        outputs += [self._output(r, token) for r, token in self.scheduler.update_decode(plan, sampled)]
        return outputs + self._merge(self.executor.poll())

    def _observe(self, plan: StepPlan) -> None:
        """Hand a decode step that ran beside prefill layers, prefill layers that ran on a partition beside decode,
        and a mixed step, to the planner (online refinement of its contention models), before the step's tokens
        change the batch's contexts."""
        finished, self._prefills_mark = self.executor.prefills_since(self._prefills_mark)
        observe_prefill = getattr(self.scheduler.planner, "observe_prefill", None)
        if observe_prefill is not None:
            for obs in finished:
                if obs.beside_decode:  # (on all SMs nothing runs beside it: the predictor keeps to partitions)
                    observe_prefill(prefill_items(obs.works), obs.layers, obs.prefill_sms, obs.ms)
        mixed_ms, observe_mixed = self.executor.last_mixed_ms, getattr(self.scheduler.planner, "observe_mixed", None)
        if plan.mixed and plan.prefill and mixed_ms is not None and observe_mixed is not None:
            observe_mixed(prefill_items(plan.prefill), decode_load(self.scheduler.requests, plan.decode), mixed_ms)
        seen, observe = self.executor.last_decode, getattr(self.scheduler.planner, "observe_decode", None)
        if seen is None or not seen.concurrent or observe is None:
            return
        observe(decode_load(self.scheduler.requests, plan.decode), seen.decode_sms, prefill_items(seen.concurrent),
                seen.ms)

    def _merge(self, done: list) -> list[RequestOutput]:
        """Record prefill works whose layers have all run; a prompt's last chunk brings its first token."""
        return [self._output(r, token) for work, tok in done for r, token in self.scheduler.complete_prefill(work, tok)]

    def _output(self, r: Request, token: int) -> RequestOutput:
        sp = r.sampling
        detok = self._detok.get(r.request_id)
        stop_token = token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids)
        stop_string = detok.push(token, visible=not stop_token) if detok else False
        reason = None
        if stop_token or stop_string:
            reason = "stop"
        elif len(r.output_token_ids) >= sp.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
        text = ""
        if detok:
            if reason and not stop_string:
                detok.flush()
            text = detok.delta(finished=reason is not None)
        if reason:
            self.scheduler.finish(r, reason)
            self.executor.release(r.request_id)
            self._detok.pop(r.request_id, None)
        return RequestOutput(
            request_id=r.request_id, new_token_ids=[token], new_text=text, finished=reason is not None,
            finish_reason=reason, num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=r.num_cached_tokens or 0,
            num_output_tokens=len(r.output_token_ids), text=detok.text if (detok and reason) else None)

    # ---- synchronous API --------------------------------------------------------------------------------------
    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts to completion (continuously batched) and return them in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, plist)]
        for r in requests:
            self.submit(r)
        texts = {r.request_id: "" for r in requests}
        while any(not r.status.done for r in requests):
            for out in self.step():
                if out.request_id in texts:  # other requests may be in flight too
                    texts[out.request_id] += out.new_text
        return [Completion(r.request_id, r.prompt_token_ids, list(r.output_token_ids), texts[r.request_id],
                           r.finish_reason, r.num_cached_tokens or 0) for r in requests]
