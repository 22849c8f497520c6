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
    attention_backend: str = "auto"
    compile: bool | None = None     # None: on CUDA, off on CPU
    cuda_graph: bool = True
    multiplex: bool | None = None
    partition_granularity: int = 16
    layerwise_decode_sms: int = 64
    preemption: bool = True
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
        return cfg

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            page_size=self.page_size, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            kv_cache_memory=parse_size(self.kv_cache_memory) if self.kv_cache_memory else None,
            gpu_memory_utilization=self.gpu_memory_utilization, enable_prefix_caching=self.enable_prefix_caching,
            planner=self.planner, max_waiting=self.max_waiting, slo=self.slo, profile=self.profile,
            chunk_budget=self.chunk_budget, attention_backend=self.attention_backend,
            compile=self.compile, cuda_graph=self.cuda_graph, multiplex=self.multiplex,
            partition_granularity=self.partition_granularity, layerwise_decode_sms=self.layerwise_decode_sms,
            preemption=self.preemption)

    def build_engine(self) -> Engine:
        """Load the model and tokenizer and size the KV cache (the slow part of start-up)."""
        return Engine.from_pretrained(resolve_model_dir(self.model_dir), dtype=self.resolved_dtype(),
                                      device=self.resolved_device(), load_format=self.load_format,
                                      config=self.engine_config())
