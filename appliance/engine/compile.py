"""Regional torch.compile of the decoder: each layer is compiled by TorchDynamo + Inductor for a symbolic token
count, attention staying an opaque custom op that reads its batch from the forward context.

Every layer has the same code and no layer index reaches the traced code, so one compiled graph (per residual
variant, and one for a single token) serves all layers and all batch sizes. Inductor's cache lives under muxd's cache
directory, so a second start reuses the generated kernels.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from appliance.engine.toolchain import compile_unavailable_reason
from appliance.model_zoo.llama import DecoderForCausalLM

log = logging.getLogger("muxd.compile")


def cache_dir() -> Path:
    """$MUXD_CACHE_DIR, else $XDG_CACHE_HOME/muxd, else ~/.cache/muxd."""
    root = os.environ.get("MUXD_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "muxd"


def compile_layers(model: DecoderForCausalLM) -> bool:
    """Compile every decoder layer in place; returns False (and logs why) when torch.compile cannot run here."""
    device = next(model.parameters()).device
    reason = compile_unavailable_reason(device)
    if reason:
        log.warning("torch.compile is unavailable (%s); running the model eagerly", reason)
        return False
    inductor_dir = cache_dir() / "inductor"
    inductor_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir))
    for layer in model.model.layers:
        layer.compile(dynamic=True)
    return True
