"""Regional torch.compile of the decoder: each layer is compiled by TorchDynamo + Inductor for a symbolic token
count, attention staying an opaque custom op that reads its batch from the forward context.

Every layer has the same code and no layer index reaches the traced code, so one compiled graph (per residual
variant, and one for a single token) serves all layers and all batch sizes. The single-token graph (decode of one
sequence) is compiled on CUDA in Inductor's max-autotune mode (without its CUDA graphs; muxd captures its own): its
coordinate-descent tuning turns the matrix-vector products into fused, tuned reductions (no split-K, the norm before
each projection in the same kernel), so a one-row decode step reads the weights faster. Where muxd ships a tilings
table for the GPU, torch and the model's shapes (tilings.py), each kernel takes the table's tiling and nothing is
tuned; otherwise the tuning runs once, in the engine's warm-up (tens of seconds on an H200), and is cached (a draw:
tunings differ). Other token counts keep the dynamic graph and cuBLAS:
max-autotune's GEMM templates made decode at 8, 64 and 128 rows slower on an H200, not faster. In the dynamic
graph the output projection and the residual add stay apart (`residual_add_apart`): Inductor would make them one addmm,
which ATen runs on CUDA as a copy of the residual into the output and a GEMM that adds it (a copy kernel a layer);
apart, the add joins the next norm's kernel, and the projection is rounded before the add, as transformers does it.
Inductor's and Triton's caches live under muxd's cache directory, so a second start reuses the generated kernels,
their tuned configurations and the binaries of muxd's own Triton kernels.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from appliance.attention import pdl
from appliance.engine import tilings
from appliance.engine.toolchain import compile_unavailable_reason
from appliance.model_zoo.layers import DecoderLayer
from appliance.model_zoo.llama import DecoderForCausalLM

log = logging.getLogger("muxd.compile")


def cache_dir() -> Path:
    """$MUXD_CACHE_DIR, else $XDG_CACHE_HOME/muxd, else ~/.cache/muxd."""
    root = os.environ.get("MUXD_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "muxd"


def use_cache_dirs() -> None:
    """Inductor's cache and Triton's binaries (Inductor's kernels and muxd's own: decode attention, rotary + K/V
    write) under muxd's cache directory, so that a container keeping it starts warm; a directory the user chose
    stays. Importing torch._dynamo already set TORCHINDUCTOR_CACHE_DIR to torch's default (/tmp/torchinductor_USER):
    that one counts as not chosen."""
    inductor = cache_dir() / "inductor"
    inductor.mkdir(parents=True, exist_ok=True)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, _torch_default_inductor_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))


def pin_triton_defaults() -> None:
    """Triton's defaults that muxd's kernels (its own and Inductor's) were measured with, where the user set none:
    floating-point fusion (a * b + c as one FMA) on, which Triton 3.10 turns off by default."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _torch_default_inductor_dir() -> str | None:
    try:  # defers: torch's private helper (2.5 and later), where it exists
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def compile_layers(model: DecoderForCausalLM) -> bool:
    """Compile every decoder layer and the final norm in place; returns False (and logs why) when torch.compile
    cannot run here. On CUDA, `model.tilings` says what the single-token graph's kernels are tiled by."""
    device = next(model.parameters()).device
    reason = compile_unavailable_reason(device)
    if reason:
        log.warning("torch.compile is unavailable (%s); running the model eagerly", reason)
        return False
    use_cache_dirs()
    # a model adds 4 compiled variants of DecoderLayer.forward (2 residual variants x 2 compilers; the single-token
    # one per shape and dtype): room for the several models a process may build (tests), before Dynamo runs eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    dynamic = torch.compile(DecoderLayer.forward, dynamic=True,
                            options={"post_grad_custom_post_pass": residual_add_apart()})
    from torch._inductor import config as inductor_config, list_mode_options  # defers Inductor (1 s)

    tuned = list_mode_options("max-autotune-no-cudagraphs") if device.type == "cuda" else {}
    # the single-token graph's kernels launch with programmatic dependent launch where it is on (attention/pdl.py)
    # and this Inductor has it: Inductor waits in each kernel only before reading what the kernel before it wrote
    launch = {"triton.enable_pdl": True} if pdl.active(device, rows=1) and hasattr(inductor_config.triton,
                                                                                    "enable_pdl") else {}
    fixed = {}
    if device.type == "cuda":
        model.tilings = tilings.choose(tilings.key(model.model.layers[0], device, pdl=bool(launch)))
        fixed = model.tilings.options()
    one_token = torch.compile(DecoderLayer.forward, dynamic=False, options={**tuned, **launch, **fixed} or None)
    for layer in model.model.layers:
        layer.forward = functools.partial(_dispatch, dynamic, one_token, layer)
    # the final norm (and the last residual add) in one kernel, where eagerly it is eight small ones
    norm = model.model.norm
    norm.forward = functools.partial(_final_norm, torch.compile(_add_norm, dynamic=True), norm)
    return True


def _add_norm(norm, hidden: torch.Tensor, residual: torch.Tensor):
    """What is compiled: a function of its own, not RMSNorm.forward, whose code object (where Dynamo keeps compiled
    code) every norm shares: compiled as a method, it grew two more graphs for calls without a residual on a GPU."""
    return type(norm).forward(norm, hidden, residual)


def _final_norm(compiled, norm, hidden: torch.Tensor, residual: torch.Tensor | None = None):
    """The final norm's forward: compiled with the residual add (one graph for one row, one for any other count);
    without a residual (no layer ran before it) eagerly, as no step's latency depends on that case."""
    if residual is None:
        return type(norm).forward(norm, hidden)
    return compiled(norm, hidden, residual)


def _dispatch(dynamic, one_token, layer: DecoderLayer, positions: torch.Tensor, hidden: torch.Tensor,
              residual: torch.Tensor | None):
    """A layer's forward: the single-token graph for one row, the dynamic graph for any other count."""
    compiled = one_token if hidden.shape[0] == 1 else dynamic
    return compiled(layer, positions, hidden, residual)


@functools.lru_cache(maxsize=None)
def residual_add_apart():
    """An Inductor post-grad pass: `addmm(r, a, b)` whose r is a whole matrix (not a broadcast bias) becomes
    `mm(a, b) + r` again, so that Inductor fuses the add into the kernel that reads the sum next (the norm), instead
    of ATen copying r into the GEMM's output first."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # defers Inductor (1 s)

    class ResidualAddApart(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            aten = torch.ops.aten
            for node in list(graph.nodes):
                if node.op != "call_function" or node.target is not aten.addmm.default or node.kwargs \
                        or len(node.args) != 3:
                    continue
                r, a, b = node.args
                values = [getattr(n, "meta", {}).get("val") for n in (r, a, b, node)]
                if any(not isinstance(v, torch.Tensor) for v in values) or values[0].shape != values[3].shape:
                    continue
                try:  # the product's fake value, which Inductor's lowering reads (none: leave the addmm)
                    product = aten.mm.default(values[1], values[2])
                except Exception:  # noqa: BLE001 - whatever fake propagation cannot do, the addmm stays
                    continue
                with graph.inserting_before(node):
                    mm = graph.call_function(aten.mm.default, (a, b))
                    mm.meta["val"] = product
                    add = graph.call_function(aten.add.Tensor, (mm, r))
                    add.meta["val"] = values[3]
                node.replace_all_uses_with(add)
                graph.erase_node(node)

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__,))

    return ResidualAddApart()
