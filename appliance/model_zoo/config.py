"""ModelConfig: the shape of one decoder-only model, read from a Hugging Face `config.json`.

Llama (2, 3, 3.1), Qwen2/Qwen2.5 and Qwen3 dense are one decoder; the differences are flags here (qkv bias, q/k norm,
tied embeddings, rope scaling). Accepts both the transformers 4.x and 5.x spellings of the fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from appliance.errors import ConfigError, ModelLoadError
from appliance.model_zoo.config_fields import check_fields

# architecture name -> family defaults that config.json does not spell out
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": None, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True},
}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype, where: str = "dtype") -> torch.dtype:
    """Turn 'bfloat16' / 'torch.float16' / a torch.dtype into a torch.dtype, or raise ConfigError naming `where`."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise ConfigError(f"{where}: unsupported dtype {name}; use one of float32, bfloat16, float16")
    key = str(name).removeprefix("torch.").lower()
    if key not in DTYPES:
        raise ConfigError(f"{where}: unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    dtype: torch.dtype = torch.bfloat16
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        check_fields(raw, source)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: field 'architectures' is {archs!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
        family = ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelLoadError(f"{source}: missing required field {key!r}")
            return raw[key]

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is supported")
        if raw.get("use_sliding_window"):
            raise ModelLoadError(f"{source}: field 'use_sliding_window' is true; sliding-window attention is not "
                                 "supported")
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        num_kv = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv:
            raise ModelLoadError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                                 f"num_key_value_heads={num_kv}")
        attention_bias = bool(raw.get("attention_bias", False))
        qkv_bias = family["qkv_bias"] if family["qkv_bias"] is not None else attention_bias
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=_parse_rope(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(qkv_bias),
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family["qk_norm"],
            dtype=parse_dtype(dtype_name, f"{source}: field 'torch_dtype'"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found (a model directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(path))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (for sizing and logs)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias + 2 * self.head_dim * self.qk_norm
        per_layer = attn + 3 * h * i + (2 * i + h) * self.mlp_bias + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 keeps everything in rope_parameters; 4.x has rope_theta + rope_scaling
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} (field 'rope_scaling') is not supported; "
                          f"supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ConfigError(f"{source}: rope_scaling of type {rope_type!r} needs a 'factor'")
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
