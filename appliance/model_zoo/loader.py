"""Loads a decoder from a local Hugging Face directory (safetensors, single or sharded) or with dummy weights.

The module tree is built on the meta device and materialised once on the target device, so a checkpoint is never held
twice in memory. Under tensor parallelism a rank builds its share of the model and reads only its rows of each
sharded tensor from the files. Every problem is a ModelLoadError naming the file and the tensor or field.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from appliance.errors import ModelLoadError
from appliance.model_zoo.config import ModelConfig, parse_dtype
from appliance.model_zoo.hub_cache import not_found
from appliance.model_zoo.llama import DecoderForCausalLM
from appliance.model_zoo.parallel import Target

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# tensors some checkpoints carry that the model recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# torch.nn.init's in-place initialisers (normal_, kaiming_uniform_, ...), which modules call as they are built
_INITIALISERS = frozenset(getattr(torch.nn.init, name) for name in dir(torch.nn.init)
                          if name.endswith("_") and not name.startswith("_"))


class _SkipInit(TorchFunctionMode):
    """Leaves the initialisers out while the module tree is built on the meta device: they would draw nothing there
    (the weights are loaded or drawn after materialising), yet run torch's Python meta kernels, whose first use
    imports torch._dynamo (seconds of every server start)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:  # each returns the tensor it fills, which nn.init passes on by name
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def resolve_model_dir(path: str | Path) -> Path:
    """A model's directory, which must exist (ModelSettings.model_dir finds a hub id's snapshot in the cache)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(not_found(str(path)))
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory (expected a Hugging Face model directory with config.json)")
    return path


def load_model(path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
               load_format: str = "auto", seed: int = 0, rank: int = 0, tp_size: int = 1,
               overrides: dict[str, Any] | None = None) -> DecoderForCausalLM:
    """Build the model described by `path`/config.json (its fields replaced by `overrides` where given) and fill
    its weights (rank `rank`'s share of them under `tp_size`-way tensor parallelism).

    dtype: None keeps the checkpoint's torch_dtype. load_format: 'auto'/'safetensors' read the weights, 'dummy' draws
    random weights of the right shapes (seeded) for benchmarking sizes without a checkpoint.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    path = resolve_model_dir(path)
    cfg = ModelConfig.from_file(path / "config.json", overrides)
    if dtype is not None:
        cfg = replace(cfg, dtype=parse_dtype(dtype, "--dtype"))
    with torch.device("meta"), _SkipInit():
        model = DecoderForCausalLM(cfg.sharded(tp_size), rank)
    _materialise(model, cfg.dtype, torch.device(device))
    model.model.rotary.reset_buffers()
    if load_format == "dummy":
        _fill_dummy(model, seed)
    else:
        _load_safetensors(model, path)
    return model.eval().requires_grad_(False)


def _materialise(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """`model.to(dtype).to_empty(device=device)` by plain allocations: uninitialised parameters and buffers on `device`
    (floating ones in `dtype`) for those on the meta device; `to_empty` would run torch's Python meta kernels, whose
    first use imports sympy (about a second of every start)."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = torch.nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = empty(buf) if buf.is_meta else buf.to(device)


def _fill_dummy(model: DecoderForCausalLM, seed: int) -> None:
    """Seeded N(0, 0.02) weights drawn on the weights' own device (an 8B model in about a second on a GPU)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def checkpoint_files(path: Path, check: bool = False) -> list[Path]:
    """The safetensors files of a model directory, from the shard index when there is one; with `check`, each
    file's header is read (by the safetensors library, which also refuses a file shorter than its header says:
    a truncated download), so a broken file fails before anything slow, named."""
    files = _checkpoint_files(path)
    if check:
        for file in files:
            with _opened(file, "cpu"):
                pass
    return files


def _opened(file: Path, device: str):
    """safe_open, its errors (a truncated or corrupt file) as a ModelLoadError naming the file."""
    try:
        return safe_open(str(file), framework="pt", device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError (an Exception) or OSError
        raise ModelLoadError(f"{file}: not a readable safetensors file ({exc}); a truncated or interrupted "
                             "download? Fetch it again") from None


def _checkpoint_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a valid shard index (needs a 'weight_map' object): {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard named in {index.name} not found")
        return files
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json (use --load-format dummy "
                         "for random weights)")


def checkpoint_targets(model: DecoderForCausalLM) -> dict[str, Target]:
    """Checkpoint tensor name -> where it (or this rank's rows of it) goes: sharded and merged layers say so, every
    other parameter is its checkpoint tensor whole."""
    targets = {name: Target(name) for name, _ in model.named_parameters()}
    for mod_name, module in model.named_modules():
        describe = getattr(module, "checkpoint_targets", None)
        if describe is not None:
            for name, target in describe(mod_name).items():
                targets.pop(target.param, None)
                targets[name] = target
    return targets


def _load_safetensors(model: DecoderForCausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    tied = model.config.tie_word_embeddings
    device = next(model.parameters()).device
    # tensors are read straight onto the model's device (no second copy in host memory on a GPU)
    load_device = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}" \
        if device.type == "cuda" else "cpu"
    for file in checkpoint_files(path):
        with _opened(file, load_device) as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target = targets.get(name)
                if target is None:
                    raise ModelLoadError(f"{file}: unexpected tensor {name!r} for {model.config.architecture} "
                                         "(does config.json match the weights?)")
                _copy(f, file, name, target, params[target.param].data)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: checkpoint lacks tensor(s) {shown}")


def _copy(f, file: Path, name: str, target: Target, param: torch.Tensor) -> None:
    """Copy checkpoint tensor `name` (only the target's rows of it when it names some) into its parameter."""
    rows = target.rows
    dest = param if rows is None else param.narrow(target.dim, target.offset, rows.size)
    implied = list(dest.shape)
    whole = rows is None or rows.size == rows.total
    if whole:
        tensor = _read(file, name, lambda: f.get_tensor(name))
        shape = tuple(tensor.shape)
    else:
        implied[target.dim] = rows.total
        part = _read(file, name, lambda: f.get_slice(name))
        shape = tuple(part.get_shape())
    if shape != tuple(implied):
        raise ModelLoadError(f"{file}: tensor {name!r} has shape {shape}, config.json implies {tuple(implied)}")
    if not whole:  # read this rank's rows only
        index = [slice(None)] * len(shape)
        index[target.dim] = slice(rows.start, rows.start + rows.size)
        tensor = _read(file, name, lambda: part[tuple(index)])
    dest.copy_(tensor)


def _read(file: Path, name: str, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - the file changed or is corrupt past its header
        raise ModelLoadError(f"{file}: tensor {name!r} cannot be read ({exc})") from None
