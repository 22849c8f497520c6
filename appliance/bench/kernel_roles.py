"""A decode step's kernels by role (`muxd bench engine --kernels`): the QKV, output, gate/up and down projections,
attention, the LM head and the rest, each against the bytes it must read over the copy bandwidth, so that a
profile says which part of the step is furthest from its floor.

Roles come from the kernels' order in a step, not from their names alone (Inductor names a fused matrix-vector
reduction after everything it fused): of each layer's four matmuls the first runs before attention (QKV), the others
after it (output, gate/up, down); after the last layer comes the LM head. A split-K reduction belongs to the matmul
before it; attention is flashinfer's kernels and muxd's Triton decode (KV-split merges included); every other
kernel (norms, rotary, K/V writes, activations, sampling) is "other". A step whose matmuls do not count four per
layer plus one gets no roles.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

PROJECTIONS = ("QKV projection", "output projection", "gate/up projection", "down projection")
LM_HEAD, ATTENTION, OTHER = "LM head", "attention", "other kernels"
ROLES = (PROJECTIONS[0], ATTENTION) + PROJECTIONS[1:] + (LM_HEAD, OTHER)

_LIBRARY_MATMUL = re.compile(r"gemm|gemv|nvjet|cutlass|xmma", re.IGNORECASE)
# a matmul Inductor generates is a reduction or a template kernel; pointwise kernels that read a matmul's output
# (rotary after QKV: "triton_poi_fused_..._cos_mm_mul_...") carry its name too
_INDUCTOR_MATMUL = re.compile(r"^triton_(red|per|tem)_.*_(mm|addmm|bmm)(_|$)")
# muxd's one-row product (model_zoo/layers.py `row_product`) reduces the weight's transpose, unsqueezed, by a sum
_ROW_PRODUCT = {"sum", "t", "unsqueeze"}
_SPLIT_K_REDUCE = re.compile(r"splitk_?reduce", re.IGNORECASE)  # not a split-K GEMM itself ("..._splitK_TNN")
_OWN_ATTENTION = re.compile(r"^decode_(partial|partial_rope|merge|balanced)$")  # attention/triton_decode_kernels.py


@dataclass
class RoleRow:
    role: str
    launches: float         # per step
    ms: float               # device time per step
    floor_ms: float | None  # the role's bytes over the copy bandwidth (None: "other kernels")

    @property
    def ratio(self) -> float | None:
        return self.ms / self.floor_ms if self.floor_ms else None


def kind(name: str) -> str:
    """'matmul', 'split-k' (a split-K reduction), 'attention' or 'other'."""
    if _SPLIT_K_REDUCE.search(name):
        return "split-k"
    if "flashinfer" in name or _OWN_ATTENTION.match(name):
        return ATTENTION
    if _LIBRARY_MATMUL.search(name) or _INDUCTOR_MATMUL.search(name):
        return "matmul"
    if re.match(r"triton_(red|per)_", name) and _ROW_PRODUCT <= set(name.split("_")):
        return "matmul"
    return "other"


def by_role(events: Sequence[tuple[str, float]], steps: int, num_layers: int,
            floors_ms: dict[str, float]) -> list[RoleRow] | str:
    """(name, ms) of every kernel of `steps` whole steps in the order they ran -> a row per role (in ROLES order),
    or why the step's matmuls cannot be told apart. `floors_ms`: each role's floor per step (not "other")."""
    per_step = 4 * num_layers + 1
    matmuls = sum(kind(name) == "matmul" for name, _ in events)
    if matmuls != steps * per_step:
        return (f"{matmuls} matmul kernels in {steps} steps, not {per_step} a step (four a layer and the LM head): "
                "no roles")
    totals = {role: [0, 0.0] for role in ROLES}
    index, role = -1, OTHER
    for name, ms in events:
        k = kind(name)
        if k == "matmul":
            index += 1
            at = index % per_step
            role = LM_HEAD if at == per_step - 1 else PROJECTIONS[at % 4]
            into = role
        elif k == "split-k":  # the matmul before it ("other" before any)
            into = role
        else:
            into = ATTENTION if k == ATTENTION else OTHER
        totals[into][0] += 1
        totals[into][1] += ms
    return [RoleRow(r, n / steps, ms / steps, None if r == OTHER else floors_ms.get(r))
            for r, (n, ms) in totals.items()]


def weight_floors(layers: Iterable, lm_head_bytes: int, kv_bytes: int, copy_bytes_per_s: float) -> dict[str, float]:
    """Each role's floor in ms: the bytes of its weights (and biases) in every layer, the LM head's, the batch's KV
    for attention, over the copy bandwidth."""
    modules = {PROJECTIONS[0]: "self_attn.qkv_proj", PROJECTIONS[1]: "self_attn.o_proj",
               PROJECTIONS[2]: "mlp.gate_up_proj", PROJECTIONS[3]: "mlp.down_proj"}
    nbytes = dict.fromkeys(modules, 0)
    for layer in layers:
        for role, path in modules.items():
            module = layer.get_submodule(path)
            nbytes[role] += sum(p.numel() * p.element_size() for p in module.parameters())
    nbytes[LM_HEAD] = lm_head_bytes
    nbytes[ATTENTION] = kv_bytes
    return {role: b / copy_bytes_per_s * 1e3 for role, b in nbytes.items()}
