"""Where `muxd serve` finds a latency profile when none is named: the cache `muxd profile` writes to (one file per
model shape, GPU name and muxd version), then the profiles shipped inside muxd (measured by the project on its
GPUs). A profile is found by what it describes, never by its file name alone."""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

from appliance import __version__
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.profile import FORMAT, model_shape
from appliance.predictor.roofline import DeviceSpec, device_spec

BUNDLED = Path(__file__).resolve().parent / "profiles"
log = logging.getLogger("muxd.predictor")


def profile_key(model: ModelConfig, gpu_name: str) -> str:
    """The cache file name of a profile of `model`'s shapes (split across its tensor-parallel ranks) on `gpu_name`
    written by this muxd version."""
    ident = model_shape(model) | ({"tensor_parallel_size": model.tp_size} if model.tp_size > 1 else {})
    shape = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    gpu = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"
    return f"{gpu}-{shape}-muxd{__version__}.json"


def _describes(path: Path, model: ModelConfig, gpu_name: str, by_kind: bool = False) -> bool:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if not (isinstance(raw, dict) and raw.get("format") == FORMAT and raw.get("model", {}).get("shape") ==
            model_shape(model) and raw.get("tensor_parallel_size", 1) == model.tp_size):
        return False
    name = raw.get("gpu", {}).get("name")
    if name == gpu_name:
        return True
    kind = _kind(name) if by_kind and isinstance(name, str) else None
    return kind is not None and kind == _kind(gpu_name)


def _kind(gpu: str) -> DeviceSpec | None:
    try:
        return device_spec(gpu)
    except ConfigError:
        return None


def find_profile(model: ModelConfig, gpu_name: str, cache: Path, by_kind: bool = False) -> Path | None:
    """The cached profile for this model and GPU written by this version, else a shipped one that describes them.
    `by_kind` (a simulation naming a GPU by its key, e.g. 'h200'): any cached, then shipped, profile of a GPU of
    that kind."""
    cached = cache / "profiles" / profile_key(model, gpu_name)
    if cached.is_file():
        return cached
    pool = sorted((cache / "profiles").glob(f"*-muxd{__version__}.json")) if by_kind else []
    for path in [*pool, *sorted(BUNDLED.glob("*.json"))]:
        if _describes(path, model, gpu_name, by_kind):
            return path
    return None


def cache_profile(path: Path, model: ModelConfig, gpu_name: str, cache: Path) -> Path:
    """Keep a copy of a freshly written profile where `find_profile` looks."""
    target = cache / "profiles" / profile_key(model, gpu_name)
    target.parent.mkdir(parents=True, exist_ok=True)
    if path.resolve() != target.resolve():
        shutil.copyfile(path, target)
    return target
