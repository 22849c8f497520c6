"""The single-token graph's kernel tilings: a tuning chosen once per GPU model and torch, shipped, instead of a draw.

Inductor's coordinate-descent tuning times each kernel of the single-token graph alone and keeps a neighbouring
tiling whenever it measures 0.1 % faster, so two tunings of the same graph on the same GPU end on different tilings,
and a one-row decode step differs by up to a tenth between them. A tilings table fixes the draw: `muxd`'s tuning tool
(scripts/tune_tilings.py) tunes the graph several times, keeps the tuning whose one-row steps were fastest, and
writes each of its kernels' tilings under the hash Inductor gives a kernel's source in its lookup table
(`autotune_lookup_table`). Where a table matches the GPU, torch, Triton and the layer's shapes, the single-token
graph compiles with coordinate descent off and each kernel takes the table's tiling (no tuning at start-up);
elsewhere Inductor tunes, as before. `MUXD_TILINGS` chooses otherwise: `tune` (always tune, as the tool does) or
the path of a table file.

This module owns the table files (`tiling_tables/MODEL-GPU.json`, MODEL a directory of configs/models), their key
and the choice; compile.py applies it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from appliance.errors import ConfigError

log = logging.getLogger("muxd.compile")

ENV = "MUXD_TILINGS"
SHIPPED = Path(__file__).with_name("tiling_tables")
# the fields of a kernel's tuned configuration that Inductor's lookup table reads
_CONFIG_KEYS = ("num_warps", "num_stages")


def layer_signature(layer: nn.Module) -> str:
    """What shapes a layer's single-token kernels: its parameters' names, shapes and dtypes and its constants
    (norm epsilons), hashed."""
    parts = [f"{type(layer).__name__}"]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in layer.named_parameters()]
    parts += [f"{name}:eps={m.eps}" for name, m in layer.named_modules() if hasattr(m, "eps")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def key(layer: nn.Module, device: torch.device, pdl: bool) -> dict:
    """The key a table must match: the GPU model, torch and Triton versions, the layer's signature and whether its
    kernels launch with programmatic dependent launch (their source differs)."""
    import triton  # defers: only on CUDA

    return {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "layer": layer_signature(layer), "pdl": pdl}


@dataclass
class Choice:
    """What the single-token graph compiles with: `kernels` (source hash -> tiling) or none (Inductor tunes)."""
    source: str  # "tuned", "shipped NAME" or "file PATH"
    key: dict = field(default_factory=dict)
    kernels: dict[str, dict] = field(default_factory=dict)

    def options(self) -> dict:
        """Inductor options of the single-token compile on top of max-autotune's."""
        if not self.kernels:
            return {}
        return {"coordinate_descent_tuning": False, "autotune_lookup_table": self.kernels}

    def describe(self) -> dict:
        return {"source": self.source, "kernels": len(self.kernels), **self.key}


def choose(want: dict) -> Choice:
    """The tilings for the single-token graph of key `want` (see the module's docstring)."""
    from torch._inductor import config as inductor_config  # defers Inductor (1 s)

    if not hasattr(inductor_config, "autotune_lookup_table"):  # (an Inductor without a lookup table)
        return Choice("tuned", want)
    setting = os.environ.get(ENV, "").strip()
    if setting == "tune":
        return Choice("tuned", want)
    if setting:
        try:
            table = load(Path(setting))
        except ConfigError as exc:
            raise ConfigError(f"{ENV}={setting}: {exc}") from None
        if table["key"] != want:
            log.warning("%s=%s: its key %s is not this model's and GPU's %s; Inductor tunes the single-token graph",
                        ENV, setting, table["key"], want)
            return Choice("tuned", want)
        return Choice(f"file {setting}", want, table["kernels"])
    for path in sorted(SHIPPED.glob("*.json")):
        table = load(path)
        if table["key"] == want:
            log.info("single-token graph: the tilings of %s (%d kernels)", path.name, len(table["kernels"]))
            return Choice(f"shipped {path.stem}", want, table["kernels"])
    return Choice("tuned", want)


def load(path: Path) -> dict:
    """A table file: {"key": ..., "kernels": {hash: tiling}, ...}; ConfigError naming the file for anything else."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tilings table {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(table, dict) or not isinstance(table.get("key"), dict) \
            or not isinstance(table.get("kernels"), dict):
        raise ConfigError(f"tilings table {path}: wants an object with 'key' and 'kernels' objects")
    for digest, tiling in table["kernels"].items():
        if not isinstance(tiling, dict) or any(not isinstance(tiling.get(k), int) for k in _CONFIG_KEYS):
            raise ConfigError(f"tilings table {path}: kernel {digest}'s tiling wants integer num_warps and num_stages")
    return table


# ---- reading a tuned cache (the tuning tool) ----------------------------------------------------------------------
_SIZE_HINTS = re.compile(r"size_hints=(\{.*?\})")  # as Inductor's async compile reads a kernel's size hints


def source_hash(source: str) -> str | None:
    """The lookup table's key of an Inductor kernel's source file (its size hints and its Triton function, as
    Inductor hashes them); None for a file that is not a Triton kernel."""
    from torch._inductor.runtime.triton_heuristics import generate_lookup_hash_from_source_code

    if "@triton.jit\n" not in source:
        return None
    hints = _SIZE_HINTS.search(source)
    return generate_lookup_hash_from_source_code(hints.group(1) if hints else str(None),
                                                 source.split("@triton.jit\n")[1])


def tuned_kernels(inductor_dir: Path) -> dict[str, dict]:
    """Source hash -> tiling of every kernel that coordinate descent tuned in an Inductor cache directory (the
    `.best_config` file Inductor keeps beside a kernel's source). Kernels of the same code under two names (the
    first layer's single-token graph and the other layers' compile some of the same kernels) share a hash, so a
    table holds one tiling for both: the one tuned last, the other layers' (a one-row forward tunes each kernel at
    its first launch, the first layer's before the others'; 31 of 32 layers launch theirs)."""
    found = []
    for source in Path(inductor_dir).rglob("*.py"):
        best = _best_config_path(source)
        if best.exists():
            found.append((best.stat().st_mtime_ns, str(source), source, best))
    out = {}
    for _, _, source, best in sorted(found):
        try:
            config = json.loads(best.read_text())
            digest = source_hash(source.read_text())
        except (OSError, ValueError):
            continue
        if digest is None or not config.get("found_by_coordesc"):
            continue
        out[digest] = {k: v for k, v in config.items() if "BLOCK" in k or k in _CONFIG_KEYS}
    return out


def _best_config_path(source: Path) -> Path:
    """Where Inductor keeps the tuned configuration of the kernel in `source`: beside it, named after the source's
    name and torch's own hash."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    key = AutotuneCache._prepare_key(str(source))
    if hasattr(AutotuneCache, "_make_local_cache_key"):
        return Path(AutotuneCache._make_local_cache_key(str(source.parent), key))
    from torch._inductor.codecache import torch_key  # (torch 2.11: the same key, hashed in place)

    return source.parent / f"{hashlib.sha256(key.encode() + torch_key()).hexdigest()}.best_config"


def kernel_hashes(inductor_dir: Path) -> set[str]:
    """The source hashes of every Triton kernel in an Inductor cache directory."""
    out = set()
    for source in Path(inductor_dir).rglob("*.py"):
        try:
            digest = source_hash(source.read_text())
        except (OSError, UnicodeDecodeError):
            continue
        if digest is not None:
            out.add(digest)
    return out
