"""ServeConfig: everything `muxd serve` / `muxd generate` need, built once from flags and validated before any work.

Also resolves the defaults that depend on the machine (device, dtype) and names the embedded default model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.attention import BACKEND_NAMES
from appliance.engine.engine import Engine, EngineConfig
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig, parse_dtype
from appliance.model_zoo.loader import LOAD_FORMATS, checkpoint_files, resolve_model_dir
from appliance.model_zoo.tokenizer import compile_chat_template

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "model_zoo" / "embedded"
EMBEDDED_NAME = "muxd-embedded"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40, "ki": 2**10,
          "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str, flag: str = "--kv-cache-memory") -> int:
    """'4GiB', '512MB', '1e9'-free plain integers -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{flag}: cannot read {text!r} as a size; write e.g. 4GiB, 512MiB or 1073741824")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass
class ServeConfig:
    model: str = "embedded"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_cache_memory: str | None = None
    gpu_memory_utilization: float = 0.9
    page_size: int = 16
    enable_prefix_caching: bool = True
    planner: str = "serial"                 # the policy (--policy, alias --planner)
    max_waiting: int = 4096
    slo: str | None = None
    profile: str | None = None
    chunk_budget: int | None = None
    max_num_batched_tokens: int | None = None
    seed: int | None = None
    chat_template: str | None = None
    api_key: str | None = None
    max_request_bytes: str = "16MiB"
    shutdown_timeout: float = 30.0
    attention_backend: str = "auto"
    compile: bool | None = None     # None: on CUDA, off on CPU
    cuda_graph: bool = True
    prefill_graph_rows: int = 512
    multiplex: bool | None = None
    partition_granularity: int = 16
    layerwise_decode_sms: int = 64
    preemption: bool = True
    mixed_chunks: bool = False
    trace_dir: str | None = None

    @property
    def model_dir(self) -> Path:
        return EMBEDDED_MODEL_DIR if self.model == "embedded" else Path(self.model).expanduser()

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return EMBEDDED_NAME if self.model == "embedded" else self.model_dir.resolve().name

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self) -> str | None:
        """None keeps the checkpoint's dtype (GPU default); the CPU default is float32, which CPUs run fastest."""
        if self.dtype != "auto":
            return self.dtype
        return None if self.resolved_device().startswith("cuda") else "float32"

    def validate(self) -> ModelConfig:
        """Check every flag and the model directory's config.json now; returns the model's config."""
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if self.prefill_graph_rows < 0:
            raise ConfigError(f"--prefill-graph-rows must be >= 0 (0: no prefill graphs), got {self.prefill_graph_rows}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        from appliance.slo.contract import load_contract
        from appliance.slo.policies import check_policy

        check_policy(self.planner)
        if self.slo is not None:
            load_contract(self.slo)  # every problem of the contract, with its line, before the model loads
        if self.partition_granularity < 8 or self.partition_granularity % 8:
            raise ConfigError(f"--partition-granularity must be a positive multiple of 8 SMs, got "
                              f"{self.partition_granularity}")
        if self.multiplex and not self.resolved_device().startswith("cuda"):
            raise ConfigError("--multiplex needs a CUDA device (SM partitions are green contexts of a GPU)")
        if self.chunk_budget is not None and self.chunk_budget < 1:
            raise ConfigError(f"--chunk-budget must be >= 1, got {self.chunk_budget}")
        if self.dtype != "auto":
            parse_dtype(self.dtype, "--dtype")
        if self.attention_backend not in BACKEND_NAMES:
            raise ConfigError(f"--attention-backend must be one of {', '.join(BACKEND_NAMES)}, "
                              f"got {self.attention_backend!r}")
        device = self.resolved_device()
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device is available on this machine")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        path = resolve_model_dir(self.model_dir)
        cfg = ModelConfig.from_file(path / "config.json")
        if self.load_format != "dummy":
            checkpoint_files(path)  # weights present (or the index's shards) before the slow load starts
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        cfg.check_max_model_len(self.max_model_len or cfg.max_model_len)
        for flag, value in (("--max-num-seqs", self.max_num_seqs), ("--max-waiting", self.max_waiting),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens),
                            ("--block-size", self.page_size)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.request_byte_limit < 1:
            raise ConfigError(f"--max-request-bytes must be at least 1 byte, got {self.max_request_bytes!r}")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key (or MUXD_API_KEY) is empty; give a key or leave it unset")
        if self.chat_template is not None:
            compile_chat_template(self.chat_template_source())
        return cfg

    @property
    def request_byte_limit(self) -> int:
        return parse_size(self.max_request_bytes, "--max-request-bytes")

    def chat_template_source(self) -> str:
        """--chat-template names a file, or is the template itself (inline jinja), as in vLLM."""
        value = str(self.chat_template)
        try:
            path = Path(value).expanduser()
            if path.is_file():
                return path.read_text()
        except OSError:  # an inline template can be too long to be a file name
            pass
        if "{{" in value or "{%" in value:
            return value
        raise ConfigError(f"--chat-template {value!r}: no such file, and not a jinja template either")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            page_size=self.page_size, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            kv_cache_memory=parse_size(self.kv_cache_memory) if self.kv_cache_memory else None,
            gpu_memory_utilization=self.gpu_memory_utilization, enable_prefix_caching=self.enable_prefix_caching,
            planner=self.planner, max_waiting=self.max_waiting, slo=self.slo, profile=self.profile,
            attention_backend=self.attention_backend, compile=self.compile, cuda_graph=self.cuda_graph,
            prefill_graph_rows=self.prefill_graph_rows, multiplex=self.multiplex,
            partition_granularity=self.partition_granularity,
            layerwise_decode_sms=self.layerwise_decode_sms, preemption=self.preemption,
            mixed_chunks=self.mixed_chunks, chunk_budget=self._chunk_budget(),
            **({} if self.max_num_batched_tokens is None else {"max_prefill_tokens": self.max_num_batched_tokens}))

    def _chunk_budget(self) -> int | None:
        """--chunk-budget; unset, None where a profile lets the engine tune it to the contract's TBT target, else
        vLLM's --max-num-batched-tokens (the tokens of one step)."""
        if self.chunk_budget is not None:
            return self.chunk_budget
        return None if self.profile is not None else self.max_num_batched_tokens

    def build_engine(self) -> Engine:
        """Load the model and tokenizer and size the KV cache (the slow part of start-up)."""
        if self.seed is not None:
            # vLLM's --seed: seeds the sampling generator once, so a run that receives the same requests in the same
            # order samples the same tokens; a request's own `seed` still fixes its output on its own
            torch.manual_seed(self.seed)
        engine = Engine.from_pretrained(resolve_model_dir(self.model_dir), dtype=self.resolved_dtype(),
                                        device=self.resolved_device(), load_format=self.load_format,
                                        config=self.engine_config())
        if self.chat_template is not None:
            if engine.tokenizer is None:
                raise ConfigError("--chat-template needs a tokenizer; this model directory has no tokenizer.json")
            engine.tokenizer.set_chat_template(self.chat_template_source())
        return engine
