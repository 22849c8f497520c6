"""`build_engine(config)`: everything heavy about starting an engine, in order — load the model and tokenizer,
compile the layers, create the SM partitions, warm up and size the KV cache from what is left of memory, build the
planner from the contract and the latency predictor, capture the decode and prefill CUDA graphs.

With tensor parallelism rank 0 (this process) starts the other ranks (engine/ranks.py); each of them (`serve_rank`)
loads its share of the model and builds its executor in the same order as rank 0 (the warm-up, the KV cache's size
and the graph captures are collectives), then runs the steps rank 0 sends."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from appliance.attention import pdl, resolve_backend_name
from appliance.config import SPATIAL_POLICIES, Config
from appliance.engine.compile import cache_dir, compile_layers, pin_triton_defaults
from appliance.engine.engine import Engine
from appliance.engine.executor import Executor
from appliance.engine.graphs import capture_sizes
from appliance.engine.kv_cache import KVCache, PagePool
from appliance.engine.memory_guard import MemoryBudget, cuda_reserve_guard
from appliance.engine.partitions import PartitionSet, partitions_available
from appliance.engine.planners.base import Planner
from appliance.engine.planners.registry import build_planner
from appliance.engine.ranks import Rank, RankGroup, join_as, leave
from appliance.engine.runner import ModelRunner
from appliance.engine.scheduler import Scheduler
from appliance.engine.tp_executor import FollowerExecutor, FollowerRunner, LeaderExecutor, LeaderRunner
from appliance.errors import ConfigError
from appliance.model_zoo.llama import DecoderForCausalLM
from appliance.model_zoo.loader import load_model, resolve_model_dir
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.predictor.catalog import find_profile
from appliance.predictor.gemm_table import GemmTable
from appliance.predictor.predictor import Predictor
from appliance.predictor.profile import load_predictor

CPU_DEFAULT_KV_BYTES = 512 << 20
GRAPH_RESERVE_BYTES = 512 << 20  # graph pool, attention workspaces of the captured sizes
PREFILL_WORKSPACE_BYTES = 160 << 20  # a prefill attention backend's workspaces
log = logging.getLogger("muxd.engine")


def load_tokenizer(config: Config) -> Tokenizer | None:
    """The model directory's tokenizer (None without tokenizer.json), with --chat-template applied."""
    path = resolve_model_dir(config.model.model_dir)
    template = config.model.chat_template_source()
    if not (Path(path) / "tokenizer.json").is_file():
        if template is not None:
            raise ConfigError("--chat-template needs a tokenizer; this model directory has no tokenizer.json")
        return None
    return Tokenizer(path, template)


def build_engine(config: Config, model: DecoderForCausalLM | None = None,
                 tokenizer: Tokenizer | None = None) -> Engine:
    """Build a ready engine: the model and tokenizer from `config.model` unless given (a given model comes
    without a tokenizer unless one is given too)."""
    tp = config.parallel.tensor_parallel_size
    if model is None:
        if config.model.seed is not None:
            # vLLM's --seed: seeds the sampling generator once, so a run that receives the same requests in the same
            # order samples the same tokens; a request's own `seed` still fixes its output on its own
            torch.manual_seed(config.model.seed)
        if tp > 1:
            return _build_parallel(config)
        model = _load(config)
        tokenizer = load_tokenizer(config)
    elif tp > 1:
        raise ConfigError(f"--tensor-parallel-size {tp}: every rank loads its own share of the model; build the "
                          "engine from the config alone")
    return _Builder(config, model).build(tokenizer)


def _load(config: Config, rank: Rank | None = None) -> DecoderForCausalLM:
    return load_model(resolve_model_dir(config.model.model_dir), dtype=config.resolved_dtype(),
                      device=rank.device if rank else config.runtime.resolved_device(),
                      load_format=config.model.load_format, rank=rank.index if rank else 0,
                      tp_size=rank.size if rank else 1, overrides=config.model.config_overrides())


def _build_parallel(config: Config) -> Engine:
    """Rank 0 of a tensor-parallel engine: start the other ranks, then build as they do."""
    par = config.parallel
    group = RankGroup.start(par.tensor_parallel_size, config.runtime.resolved_device(), par.dist_timeout,
                            serve_rank, config)
    try:
        with group.guard():
            return _Builder(config, _load(config, group.rank), group).build(load_tokenizer(config))
    except BaseException:
        group.close()
        raise


def serve_rank(config: Config, index: int, size: int, store_port: int, conn) -> None:
    """A rank other than 0 (its process's entry): join the ranks, load its share, build its executor as rank 0
    builds its own, then run the steps rank 0 sends until it says stop."""
    rank = join_as(index, size, store_port, config.runtime.resolved_device(), config.parallel.dist_timeout)
    if _Builder(config, _load(config, rank), rank=rank).build_follower().follow(conn):
        leave(together=True)  # with rank 0, which leaves as it says stop (after a failure the process just exits)


class _Builder:
    def __init__(self, config: Config, model: DecoderForCausalLM, group: RankGroup | None = None,
                 rank: Rank | None = None) -> None:
        self.config, self.model, self.group = config, model, group
        self.rank = group.rank if group is not None else rank
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda = self.device.type == "cuda"
        self.startup: dict[str, float] = {}
        self.graph_rows = 0  # prefill launches of up to this many tokens replay piecewise graphs
        # --gpu-memory-utilization's share, measured with the weights loaded and nothing else of the engine's
        self.budget = MemoryBudget.measure(self.device, config.cache.gpu_memory_utilization) if self.cuda else None

    def build(self, tokenizer: Tokenizer | None) -> Engine:
        start = time.perf_counter()
        engine = self._build(tokenizer)
        self.startup["build_s"] = time.perf_counter() - start  # (what a rebuild around the same weights repeats)
        return engine

    def build_follower(self) -> FollowerExecutor:
        """A rank other than 0: the same steps in the same order (several are collectives), no scheduler."""
        return self._build(None)

    def _build(self, tokenizer: Tokenizer | None):
        follower = self.rank is not None and self.rank.index > 0
        pin_triton_defaults()  # before any kernel compiles
        if self.config.scheduler.policy == "auto":  # mux where SM partitions exist, serial on a CPU
            self.config = self.config.replace(policy="mux" if self.cuda else "serial")
            log.info("policy: %s (the default on %s)", self.config.scheduler.policy, "CUDA" if self.cuda else "CPU")
        cfg, model, mcfg = self.config, self.model, self.model.config
        sched_cfg, cache_cfg, rt = cfg.scheduler, cfg.cache, cfg.runtime
        # before compile and warm-up: a sliding window shorter than the context is refused at once
        max_len = cfg.model_len(mcfg)
        mcfg.check_max_model_len(max_len)
        fused = self.cuda and rt.fused_rope and resolve_backend_name(rt.attention_backend, mcfg, self.dtype,
                                                                      self.device) == "flashinfer"
        model.rotate_in_attention(max_len if fused else None)
        pdl.set_enabled(rt.pdl)
        compiled = False
        if rt.compile if rt.compile is not None else self.cuda:
            compiled = compile_layers(model)
            if getattr(model, "tilings", None) is not None:
                self.startup["single_token_tilings"] = model.tilings.describe()
        partitions = self._partitions()
        reserve = 0
        if self.cuda or compiled:
            start = time.perf_counter()
            reserve = self._profile_activations(sched_cfg.max_num_batched_tokens if self.cuda else 32, partitions)
            self.startup["warm_up_s"] = time.perf_counter() - start
        num_pages = self._pool_size(reserve)
        if self.rank is not None:  # page numbers mean the same on every rank
            num_pages = self.rank.agree_min(num_pages)
        kv_cache = KVCache(mcfg, num_pages, cache_cfg.block_size, self.dtype, self.device)
        self.startup["kv_pages"] = num_pages
        predictor = self._predictor()  # every rank: prefill graphs are captured at its GEMM buckets
        if predictor is not None:
            predictor.host = predictor.host.with_loop(rt.async_scheduling)
        # a step samples one token per running request at most: the token buffer holds them all
        max_rows = max(sched_cfg.max_num_seqs, self.max_graph_batch)
        if follower:
            runner = FollowerRunner(model, kv_cache, rt.attention_backend, max_rows, rt.decode_kernel, rt.decode_blas)
            return self._capture(FollowerExecutor(runner, partitions), predictor)
        # dynamic NTK rotates a prompt's K by the prompt's length, so equal prefixes need not share pages
        prefix_caching = cache_cfg.enable_prefix_caching and not mcfg.rope.length_dependent
        if cache_cfg.enable_prefix_caching and not prefix_caching:
            log.info("prefix caching is off: with %s rope scaling K depends on the sequence length", mcfg.rope.type)
        pool = PagePool(num_pages, cache_cfg.block_size, prefix_caching)
        capacity = num_pages * cache_cfg.block_size
        max_model_len = cfg.model.max_model_len or min(cfg.model_len(mcfg), capacity)
        if max_model_len > capacity:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the KV cache ({num_pages} pages of "
                              f"{cache_cfg.block_size} = {capacity} tokens); lower it or give the cache more memory")
        contract = sched_cfg.contract
        planner = self._planner(predictor, partitions)
        scheduler = Scheduler(pool, mcfg.num_layers, planner, sched_cfg.max_num_seqs)
        runner = (ModelRunner if self.group is None else LeaderRunner)(model, kv_cache, rt.attention_backend, max_rows,
                                                                       rt.decode_kernel, rt.decode_blas)
        runner.logprobs_mode = cfg.model.logprobs_mode
        executor = Executor(runner, partitions) if self.group is None else LeaderExecutor(runner, partitions,
                                                                                          self.group)
        self._capture(executor, predictor)
        graph_rows = self.graph_rows
        graphs = runner.graphs
        splits = ", ".join(f"{p.decode_sms}/{p.prefill_sms}" for p in partitions.splits)
        log.info("engine: attention %s, compiled %s, decode graphs %s, %s, %d KV pages of %d tokens",
                 runner.backend_name, compiled, f"{graphs.sizes[0]}..{graphs.sizes[-1]}" if graphs else "off",
                 f"SM partitions (decode/prefill) {splits}" if executor.multiplexed else "no SM partitions",
                 num_pages, cache_cfg.block_size)
        # as vLLM words them (scripts and people grep for these)
        log.info("{} KV cache size: {:,} tokens".format("GPU" if self.cuda else "CPU", capacity))
        log.info("Maximum concurrency for {:,} tokens per request: {:.2f}x".format(max_model_len,
                                                                                  capacity / max_model_len))
        engine = Engine(cfg, model, tokenizer, kv_cache, pool, scheduler, executor, contract, predictor,
                        max_model_len)
        engine.startup, engine.compiled = self.startup, compiled
        engine.max_graph_batch, engine.prefill_graph_rows = self.max_graph_batch, graph_rows
        return engine

    def _capture(self, executor: Executor, predictor: Predictor | None) -> Executor:
        """Decode graphs, the prefill padding and the prefill graphs (captures are collectives on several ranks)."""
        rt, partitions = self.config.runtime, executor.partitions
        if self.cuda and rt.cuda_graph:
            start = time.perf_counter()
            executor.capture(self.graph_sizes)
            self.startup["graph_capture_s"] = time.perf_counter() - start
            self.startup["graph_memory_bytes"] = executor.graph_memory_bytes()
            if executor.one_row_graphs:  # partitions whose one row pads to the two-row graph, and their timings
                self.startup["one_row_padded"] = [name for name, c in executor.one_row_graphs.items() if c["padded"]]
                self.startup["one_row_ms"] = {name: [c["one_row_ms"], c["two_row_ms"]]
                                              for name, c in executor.one_row_graphs.items()}
        if predictor is not None and executor.multiplexed:
            predictor.decode_partitions = [p.decode_sms for p in partitions.splits]
        graph_rows = self.graph_rows = self._prefill_graph_rows(executor.runner)
        if predictor is not None:  # the host launches those prefills as graph replays, the rest eagerly
            predictor.host = predictor.host.with_graphs(graph_rows)
        # (chunked runs no prefill launch of its own: its mixed steps replay the graphs at their own sizes)
        table = self._gemm_table(predictor, graph_rows) if self.config.scheduler.policy != "chunked" else None
        executor.pad_prefills(table, self.config.scheduler.max_num_batched_tokens,
                              predictor.sm_count if predictor is not None else 0)
        if graph_rows:
            start = time.perf_counter()
            executor.capture_prefill(graph_rows)
            self.startup["prefill_graph_capture_s"] = time.perf_counter() - start
            self.startup["graph_memory_bytes"] = executor.graph_memory_bytes()
        if self.cuda and self.rank is None:  # (on a tensor-parallel rank, any rank: its collectives would need the
            # others in step)
            start = time.perf_counter()
            executor.warm_kernels(self.config.scheduler.max_num_seqs)
            self.startup["kernel_warm_s"] = time.perf_counter() - start
        cache = self.config.cache
        if self.cuda and cache.kv_cache_bytes is None and cache.num_gpu_blocks_override is None:
            executor.memory_guard = cuda_reserve_guard(self.device, self.budget)
        return executor

    @property
    def max_graph_batch(self) -> int:
        return self.graph_sizes[-1]

    @property
    def graph_sizes(self) -> list[int]:
        """The decode batch sizes captured as CUDA graphs: --cudagraph-capture-sizes, else muxd's ladder up to
        --max-graph-batch (default: min(--max-num-seqs, 256))."""
        rt = self.config.runtime
        if rt.cudagraph_capture_sizes:
            return list(rt.cudagraph_capture_sizes)
        return capture_sizes(rt.max_graph_batch or min(self.config.scheduler.max_num_seqs, 256))

    def _partitions(self) -> PartitionSet:
        """SM partitions when multiplexing (default: CUDA and a spatial policy), else the null partition."""
        rt, policy = self.config.runtime, self.config.scheduler.policy
        want = rt.multiplex if rt.multiplex is not None else (
            self.cuda and policy in SPATIAL_POLICIES and partitions_available())
        if not want:
            return PartitionSet.null()
        if not self.cuda:
            raise ConfigError(f"--multiplex needs a CUDA device; the model is on {self.device}")
        return PartitionSet.create(self.device, rt.partition_granularity)

    def _predictor(self) -> Predictor | None:
        """The latency predictor, for mux and for chunked without a budget but with a profile; for pdmux with a
        profile only so that the executor pads prefill launches to its GEMM buckets as for mux (pdmux plans without
        it)."""
        sched = self.config.scheduler
        if sched.policy == "mux" or (sched.policy == "chunked" and sched.tuned_chunk_budget is None) or (
                sched.policy == "pdmux" and sched.profile is not None):
            gpu = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"
            if sched.profile is None and sched.policy == "mux":
                found = find_profile(self.model.config, gpu, cache_dir())
                if found is not None:
                    log.info("latency profile: %s (found for this model on %s)", found, gpu)
                    return load_predictor(found, self.model.config, gpu)
            return load_predictor(sched.profile, self.model.config, gpu, sched.profile_file)
        return None

    def _planner(self, predictor: Predictor | None, partitions: PartitionSet) -> Planner:
        sched = self.config.scheduler
        splits = (partitions.total_sms, tuple(p.decode_sms for p in partitions.splits)) if partitions.splits else None
        planner = build_planner(sched, sched.contract, predictor, splits)
        if sched.policy == "pdmux":
            log.info("pdmux stream groups (SGLang's prefill/decode SMs -> this GPU's): %s",
                     "; ".join(g.describe() for g in planner.groups))
        if sched.policy == "chunked" and sched.tuned_chunk_budget is None:
            log.info("chunked prefill: a budget of %d tokens per step, the largest whose step the predictor (%s) "
                     "keeps within the contract's TBT target of %.0f ms", planner.token_budget, predictor.source,
                     sched.contract.slo_for(None).tbt_ms)
        return planner

    def _prefill_graph_rows(self, runner: ModelRunner) -> int:
        """Prefill launches of up to this many tokens run as piecewise graphs (0: none, as without CUDA, decode
        graphs or a graph-capable attention backend; never above a step's prefill tokens)."""
        capable = self.cuda and runner.backend.supports_cuda_graph
        return self.config.captured_graph_rows(self.model.config) if capable else 0

    def _gemm_table(self, predictor: Predictor | None, rows: int) -> GemmTable | None:
        """The profile's GEMM row buckets (None without), padding graph-sized launches within this engine's
        prefill graphs. A profile measured with other prefill graphs is used as it is: with smaller ones (launches
        the profile timed eagerly replay graphs here, the same kernels without the host's gaps between them) its
        figures for those launches are upper bounds; with larger ones they are too short, which a warning says."""
        gemm = predictor.gemm if predictor is not None else None
        if gemm is None:
            return None
        if gemm.graph_rows != rows:
            warn = log.warning if rows < gemm.graph_rows else log.info
            warn("the profile was measured with prefill graphs up to %d rows, this engine runs them up to %d: "
                 "its prefill predictions for launches between the two are %s (profile again with the same "
                 "--prefill-graph-rows to match them)", gemm.graph_rows, rows,
                 "too short" if rows < gemm.graph_rows else "upper bounds")
            gemm = dataclasses.replace(gemm, graph_rows=rows)
            predictor.latency = dataclasses.replace(predictor.latency, gemm=gemm)
        return gemm

    def _profile_activations(self, num_tokens: int, partitions: PartitionSet) -> int:
        """Run the warm-up forwards (compiling the layers) on a throw-away KV cache of a few pages and return the
        device memory the largest prefill step needs beyond the weights, plus sampling and graph headroom."""
        mcfg, cfg = self.model.config, self.config
        block = cfg.cache.block_size
        tmp = KVCache(mcfg, -(-num_tokens // block) + 1, block, self.dtype, self.device)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        runner = ModelRunner(self.model, tmp, cfg.runtime.attention_backend)
        runner.warm_up(num_tokens)
        if not self.cuda:
            return 0
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del runner, tmp
        torch.cuda.empty_cache()
        sampling = cfg.scheduler.max_num_seqs * mcfg.vocab_size * 4 * 6  # logits, probs, sort values + indices, noise
        sampling += cfg.scheduler.max_num_seqs * mcfg.vocab_size * 5  # penalised requests' counts and prompt marks
        cuda_graph = cfg.runtime.cuda_graph
        graphs = self.max_graph_batch * mcfg.vocab_size * 4 + GRAPH_RESERVE_BYTES if cuda_graph else 0
        # prefill graphs: fixed buffers and a pool for one layer's activations at their largest size, taken as twice
        # the warm-up prefill's peak per token
        rows = min(cfg.prefill_graph_rows(mcfg), num_tokens) if cuda_graph else 0
        graphs += 2 * peak * rows // num_tokens
        # with SM partitions: graph sets and a prefill attention workspace per partition
        return peak + sampling + graphs * len(partitions.partitions) + PREFILL_WORKSPACE_BYTES * (
            len(partitions.partitions) if not partitions.full.is_null else 0)

    def _pool_size(self, reserve: int = 0) -> int:
        """Pages for the KV cache: explicit, or what the memory budget holds after `reserve` bytes for activations,
        but no more than twice what max_num_seqs requests of full length need (a small model on a large GPU would
        otherwise take it all)."""
        cfg, cache = self.config, self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_page = KVCache.bytes_per_page(self.model.config, cache.block_size, self.dtype)
        if cache.kv_cache_bytes is not None:
            budget = cache.kv_cache_bytes
        elif self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = self.budget.kv_bytes(free, torch.cuda.memory_reserved(self.device), reserve)
        else:
            budget = CPU_DEFAULT_KV_BYTES
        if budget < per_page:
            raise ConfigError(f"KV cache budget of {budget} bytes holds no page ({per_page} bytes per page of "
                              f"{cache.block_size} tokens); raise --kv-cache-memory or --gpu-memory-utilization")
        model_len = cfg.model_len(self.model.config)
        useful = 2 * cfg.scheduler.max_num_seqs * -(-model_len // cache.block_size)
        return min(budget // per_page, useful)
