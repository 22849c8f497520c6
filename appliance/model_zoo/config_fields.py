"""Types and ranges of the config.json fields muxd reads, checked (pydantic) before ModelConfig interprets them, so
a wrong value is refused with the file, the field, the value and what would be right, instead of a TypeError deep
in parsing or a model built with zero layers. Fields muxd does not read are left alone.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from appliance.errors import ConfigError


def _integral(value: Any) -> Any:
    return int(value) if type(value) is float and value.is_integer() else value


Count = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Fields(BaseModel):
    # A field typed without `| None` may be left out but not set to null: muxd has a default for it, not a meaning
    # for null.
    model_config = ConfigDict(extra="allow", strict=True)


class RopeFields(_Fields):
    rope_type: str | None = None
    type: str | None = None
    rope_theta: Positive = None  # type: ignore[assignment]
    factor: Positive = None  # type: ignore[assignment]
    low_freq_factor: Positive = None  # type: ignore[assignment]
    high_freq_factor: Positive = None  # type: ignore[assignment]
    original_max_position_embeddings: Count = None  # type: ignore[assignment]
    partial_rotary_factor: Positive | None = None
    attention_factor: Positive | None = None
    beta_fast: Finite = None  # type: ignore[assignment]
    beta_slow: Finite = None  # type: ignore[assignment]
    mscale: Finite | None = None
    mscale_all_dim: Finite | None = None
    truncate: bool | None = None


class ConfigFields(_Fields):
    architectures: list[str] | None = None
    vocab_size: Count | None = None
    hidden_size: Count | None = None
    intermediate_size: Count | None = None
    num_hidden_layers: Count | None = None
    num_attention_heads: Count | None = None
    num_key_value_heads: Count | None = None
    head_dim: Count | None = None
    max_position_embeddings: Count = None  # type: ignore[assignment]
    rms_norm_eps: Positive = None  # type: ignore[assignment]
    rope_theta: Positive = None  # type: ignore[assignment]
    partial_rotary_factor: Positive | None = None
    rope_scaling: RopeFields | None = None
    rope_parameters: RopeFields | None = None
    hidden_act: str | None = None
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    tie_word_embeddings: bool | None = None
    use_sliding_window: bool | None = None
    torch_dtype: str | None = None
    dtype: str | None = None
    bos_token_id: TokenId | None = None
    eos_token_id: TokenId | list[TokenId] | None = None


def check_fields(raw: Any, source: str) -> None:
    """Raise ConfigError naming every field of `raw` (a parsed config.json) with a wrong type or range."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must hold a JSON object of model settings, got {type(raw).__name__}")
    try:
        ConfigFields.model_validate(raw)
    except ValidationError as exc:
        problems = []
        paths = [[str(x) for x in e["loc"] if not str(x).startswith(("function-", "list[", "constrained"))]
                 for e in exc.errors()]
        for e, path in zip(exc.errors(), paths):
            if any(len(other) > len(path) and other[:len(path)] == path for other in paths):
                continue  # a union member failed deeper inside: that error says more
            *outer, name = path
            where = f"{name!r} (in {'.'.join(outer)!r})" if outer else repr(name)
            msg = "should be a JSON object" if e["type"] in ("model_type", "dict_type") else e["msg"].lower()
            problems.append(f"field {where} is {e.get('input')!r}: {msg}")
        raise ConfigError(f"{source}: " + "; ".join(dict.fromkeys(problems))) from None
