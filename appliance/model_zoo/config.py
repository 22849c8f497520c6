"""ModelConfig: the shape of one decoder-only model, read from a Hugging Face `config.json`.

Llama (2, 3, 3.1), Qwen2/Qwen2.5 and Qwen3 dense are one decoder; the differences are flags here (qkv bias, q/k norm,
tied embeddings, rope scaling). Accepts both the transformers 4.x and 5.x spellings of the fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
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
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True, "head_dim": 128},  # transformers' Qwen3Config default
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
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
    """Rope parameters as transformers reads them (the maths is in rope.py)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0                 # llama3
    high_freq_factor: float = 4.0                # llama3
    original_max_position: int = 8192            # llama3, yarn; dynamic: max_position_embeddings
    attention_factor: float | None = None        # yarn: None derives it from factor (and mscale)
    beta_fast: float = 32.0                      # yarn
    beta_slow: float = 1.0                       # yarn
    mscale: float | None = None                  # yarn
    mscale_all_dim: float | None = None          # yarn
    truncate: bool = True                        # yarn

    @property
    def length_dependent(self) -> bool:
        """A token's rotation depends on its sequence's length, not only on its position (dynamic NTK), so equal
        prefixes of different sequences do not have equal K."""
        return self.type == "dynamic"


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
    sliding_window: int | None = None  # attention sees only this many tokens on some layer (see check_max_model_len)
    # tensor parallelism: with tp_size > 1 the head counts and intermediate_size above are one rank's share (see
    # `sharded`) and `full` is the whole model's config
    tp_size: int = 1
    full: "ModelConfig | None" = field(default=None, compare=False, repr=False)

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
        num_layers = int(need("num_hidden_layers"))
        partial = float((raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                                raw.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0:
            raise ModelLoadError(f"{source}: field 'partial_rotary_factor' is {partial}; only 1.0 (rotary embedding "
                                 "over the whole head) is supported")
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=_head_dim(raw, family, hidden, num_heads, source),
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
            sliding_window=_sliding_window(raw, arch, num_layers, source),
        )

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """The config.json at `path`, its top-level fields replaced by `overrides` where given (vLLM's
        --hf-overrides)."""
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found (a model directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
        if overrides:
            return cls.from_dict(_overridden(raw, overrides), source=f"{path} with --hf-overrides")
        return cls.from_dict(raw, source=str(path))

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model is defined for: max_position_embeddings, stretched by yarn or dynamic rope
        scaling to factor x the original context (as vLLM derives it)."""
        rope = self.rope
        if rope.type in ("yarn", "dynamic"):
            return max(self.max_position_embeddings, int(rope.factor * rope.original_max_position))
        return self.max_position_embeddings

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a context in which the model's sliding window would cut attention short: muxd has no
        sliding-window attention, so it serves such a model only where the window covers every whole sequence."""
        window = self.sliding_window
        if window is not None and max_model_len > window:
            raise ConfigError(
                f"config.json field 'sliding_window' is {window}: this model's attention sees only the last {window} "
                f"tokens and muxd does not implement sliding-window attention, so with a context of {max_model_len} "
                f"tokens it would compute attention wrongly beyond {window}; serve it with --max-model-len {window} "
                "or less")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def unsharded(self) -> "ModelConfig":
        """The whole model's config (itself without tensor parallelism)."""
        return self.full or self

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head on each rank (the vocabulary split evenly, the last rank padded)."""
        return -(-self.vocab_size // self.tp_size)

    def sharded(self, tp_size: int) -> "ModelConfig":
        """One rank's share under `tp_size`-way tensor parallelism (attention heads, KV heads and the MLP split
        evenly; fewer KV heads than ranks are replicated, each rank keeping the one its query heads read). A
        ConfigError names the numbers when the model cannot be split that way."""
        if tp_size == self.tp_size:
            return self
        if self.tp_size != 1:
            return self.unsharded.sharded(tp_size)
        where = f"--tensor-parallel-size {tp_size}"
        if tp_size < 1:
            raise ConfigError(f"{where}: the size must be >= 1")
        if self.num_heads % tp_size:
            raise ConfigError(f"{where}: num_attention_heads={self.num_heads} is not divisible by {tp_size} ranks; "
                              f"use a size that divides it")
        kv = self.num_kv_heads
        if kv >= tp_size and kv % tp_size:
            raise ConfigError(f"{where}: num_key_value_heads={kv} is not divisible by {tp_size} ranks; use a size "
                              f"that divides it")
        if kv < tp_size and tp_size % kv:
            raise ConfigError(f"{where}: num_key_value_heads={kv} is fewer than the ranks and {tp_size} is not a "
                              f"multiple of it, so the KV heads cannot be replicated evenly; use a divisor or a "
                              f"multiple of {kv}")
        if self.intermediate_size % tp_size:
            raise ConfigError(f"{where}: intermediate_size={self.intermediate_size} is not divisible by {tp_size} "
                              "ranks")
        return replace(self, num_heads=self.num_heads // tp_size, num_kv_heads=max(1, kv // tp_size),
                       intermediate_size=self.intermediate_size // tp_size, tp_size=tp_size, full=self)

    def kv_head_start(self, rank: int) -> int:
        """The first of the whole model's KV heads that `rank` holds (replicated heads: the one its queries read)."""
        return rank * self.unsharded.num_kv_heads // self.tp_size

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer; one rank's share under tensor parallelism."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias + 2 * self.head_dim * self.qk_norm
        return attn + 3 * h * i + (2 * i + h) * self.mlp_bias + 2 * h

    def num_params(self) -> int:
        """Parameter count (for sizing and logs); one rank's under tensor parallelism."""
        h, v = self.hidden_size, self.vocab_per_rank
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * self.layer_params + h + head


def _head_dim(raw: dict[str, Any], family: dict[str, Any], hidden: int, num_heads: int, source: str) -> int:
    """config.json's head_dim; absent, the family's default as transformers has it (Qwen3: 128), else
    hidden_size / num_attention_heads."""
    if raw.get("head_dim"):
        return int(raw["head_dim"])
    if family.get("head_dim"):
        return int(family["head_dim"])
    if hidden % num_heads:
        raise ConfigError(f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={num_heads}; "
                          "give head_dim explicitly")
    return hidden // num_heads


def _sliding_window(raw: dict[str, Any], arch: str, num_layers: int, source: str) -> int | None:
    """The window of the layers that use sliding-window attention, as transformers builds the model, or None."""
    if arch == "LlamaForCausalLM":
        return None  # Llama attention has no window whatever the config says
    if arch == "MistralForCausalLM":
        window = raw.get("sliding_window", 4096)  # MistralConfig's default when the field is absent
    else:  # Qwen2/Qwen3: the window only where use_sliding_window is set, on the layers layer_types names
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window") else None
        if window is not None:
            types = raw.get("layer_types") or ["sliding_attention" if i >= int(raw.get("max_window_layers", 28))
                                               else "full_attention" for i in range(num_layers)]
            if "sliding_attention" not in types:
                return None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"{source}: field 'sliding_window' is {window!r}; expected a positive integer or null")
    return window


def _overridden(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields with `overrides` in their place. transformers 5 saves the rope in 'rope_parameters',
    which wins over 'rope_scaling' and 'rope_theta' (`_parse_rope`): an override of those two is made there too,
    'rope_scaling' replacing the scaling whole, as it replaces the field."""
    out = {**raw, **overrides}
    params = raw.get("rope_parameters")
    rope_fields = {"rope_scaling", "rope_theta"} & set(overrides)
    if isinstance(params, dict) and "rope_parameters" not in overrides and rope_fields:
        theta = overrides.get("rope_theta", params.get("rope_theta"))
        scaling = overrides.get("rope_scaling", params)
        out["rope_parameters"] = {**(scaling or {}), **({"rope_theta": theta} if theta is not None else {})}
    return out


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
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise ConfigError(f"{source}: rope_scaling of type {rope_type!r} needs a numeric 'factor' >= 1, got "
                          f"{factor!r}")
    max_pos = int(raw.get("max_position_embeddings", 4096))
    if rope_type == "dynamic":
        # transformers scales dynamic NTK from max_position_embeddings, whatever else the config says
        original = max_pos
    else:
        # a top-level original_max_position_embeddings wins (Phi-3 style), then rope_scaling's, then the context
        original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
            or max_pos
    attention = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(original),
        attention_factor=None if attention is None else float(attention),
        # transformers treats 0 / null like absent for these
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
