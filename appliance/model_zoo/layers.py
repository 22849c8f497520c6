"""Building blocks shared by every decoder in the zoo: RMSNorm with fused residual add, rotary embedding (its maths
in rope.py), merged linear layers, the split-K output projections, gated MLP, paged self-attention and the decoder
layer.

Inputs are flat token batches ([num_tokens, hidden]); attention reads its batch layout from the forward context.
Under tensor parallelism (a config from `ModelConfig.sharded`) each layer holds rank `rank`'s share, Megatron-style:
QKV and gate/up column-parallel (their rows of the checkpoint's), O and down row-parallel (parallel.py).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from appliance.attention import paged_attention, rms_norm, rope_paged_attention, rotate
from appliance.model_zoo.config import ModelConfig, RopeConfig
from appliance.model_zoo.parallel import Rows, RowParallelLinear, Target
from appliance.model_zoo.rope import rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual); x may be a SplitKLinear's partial
        products, summed here (in the kernel that adds and normalises)."""
        if residual is None:
            return self._norm(x)
        x = settle(x, residual.dtype) + residual
        return self._norm(x), x


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding, cos/sin computed from positions on the fly in fp32."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        # on the CPU, as `reset_buffers` makes them, even where the model is built on the meta device: there the
        # maths would run through torch's Python meta kernels, whose first use imports torch._dynamo (seconds)
        with torch.device("cpu"):
            self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)
        # set by `build_table`: cos and sin of every position [positions, 2, head_dim], attention then rotates q and k
        self.register_buffer("cos_sin", None, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute inv_freq in fp32 (after the module was materialised from the meta device in another dtype)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope).to(self.inv_freq.device)

    def build_table(self, positions: int | None, dtype: torch.dtype, device: torch.device) -> bool:
        """Tabulate cos/sin of positions [0, positions) for attention to apply (rope_paged_attention); None drops
        the table. False where no table can serve: dynamic NTK rotates by the sequence's length too."""
        if positions is None or self.rope.length_dependent:
            self.cos_sin = None
            return False
        cos, sin = rope_cos_sin(torch.arange(positions, device=device), self.inv_freq.to(device), self.rope, dtype)
        self.cos_sin = torch.stack((cos, sin), dim=1).contiguous()
        return True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope, q.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def row_product(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor | None:
    """x @ weight.T as a reduction, where x is one row being compiled on a GPU for a linear layer without bias: the
    product written as Inductor's own decomposition of a one-row matrix product writes it (fp32 products summed over
    the input features, rounded to x's dtype), so that the single-token graph is the same graph whether or not
    Inductor's coordinate-descent tuning (which makes that decomposition) is on; None otherwise (a GEMM)."""
    if not (x.is_cuda and linear.bias is None and x.dim() == 2 and x.shape[0] == 1
            and torch.compiler.is_compiling()):
        return None
    return matvec(x, linear.weight)


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as fp32 products summed over the input features, rounded to x's dtype."""
    return (x.float().unsqueeze(2) * weight.t().float().unsqueeze(0)).sum(dim=1).to(x.dtype)


class MergedLinear(nn.Linear):
    """One GEMM for several checkpoint projections (q/k/v, gate/up); `shards` maps each checkpoint name to the rows
    of its tensor this layer holds (all of them on one rank), stacked in order."""

    def __init__(self, in_features: int, shards: dict[str, Rows], bias: bool) -> None:
        super().__init__(in_features, sum(rows.size for rows in shards.values()), bias=bias)
        self.shards: dict[str, tuple[int, Rows]] = {}
        offset = 0
        for name, rows in shards.items():
            self.shards[name] = (offset, rows)
            offset += rows.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = row_product(x, self)
        return super().forward(x) if product is None else product

    def checkpoint_targets(self, name: str) -> dict[str, Target]:
        """Checkpoint tensor name -> where its rows go (the projections sit beside this layer in the checkpoint)."""
        parent = name.rsplit(".", 1)[0]
        return {f"{parent}.{shard}.{kind}": Target(f"{name}.{kind}", 0, offset, rows)
                for shard, (offset, rows) in self.shards.items() for kind in ("weight", "bias")
                if getattr(self, kind) is not None}


class SplitKLinear(nn.Linear):
    """A linear layer that reduces over many input features into few (the output and down projections). Compiled on
    a GPU for 2 to `SPLIT_K_MAX_ROWS` rows, it returns its product as `SPLIT_K` fp32 partial products over slices of
    the input features, [SPLIT_K, rows, out], one batched GEMM, for the reader to sum (`settle`, which the next
    norm fuses into its kernel): cuBLAS would split K there too, but then sums the partials in a kernel of its own.
    Otherwise (one row: `row_product`; more rows, eager, CPU) a plain linear layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.splits(x):
            return partial_products(x, self.weight, SPLIT_K)
        product = row_product(x, self)
        return super().forward(x) if product is None else product

    def splits(self, x: torch.Tensor) -> bool:
        """Whether x's product is returned as partial products."""
        rows, k = x.shape
        return (x.is_cuda and self.bias is None and k % SPLIT_K == 0 and torch.compiler.is_compiling()
                and 2 <= rows <= SPLIT_K_MAX_ROWS)


SPLIT_K = 2  # partial products of a SplitKLinear
SPLIT_K_MAX_ROWS = 16  # the most rows a SplitKLinear splits


def partial_products(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """x @ weight.T as `slices` fp32 products over equal slices of the input features, [slices, rows, out]: one
    batched GEMM over views of x and weight (a GPU's GEMM writes fp32 from bf16 inputs; elsewhere it runs in fp32)."""
    rows, k = x.shape
    xs = x.view(rows, slices, k // slices).transpose(0, 1)
    ws = weight.view(-1, slices, k // slices).permute(1, 2, 0)
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())


def settle(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A layer's output as a [rows, features] tensor of `dtype`: SplitKLinear's partial products summed. Summed as
    separate tensors, whose count a compiled graph then takes as a constant (a dynamic graph makes a symbol of the
    first dimension of an input and, not knowing how many, would sum them in a kernel of their own)."""
    return x if x.dim() == 2 else functools.reduce(torch.add, x.unbind(0)).to(dtype)


def reducing_linear(cfg: ModelConfig, total_in: int, bias: bool, rank: int) -> nn.Linear:
    """The output or down projection: split-K on one rank, row-parallel (the ranks' all-reduce sums) beyond."""
    if cfg.tp_size == 1:
        return SplitKLinear(total_in, cfg.hidden_size, bias=bias)
    return RowParallelLinear(total_in, cfg.hidden_size, bias, rank, cfg.tp_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, rank: int = 0) -> None:
        super().__init__()
        size, total = cfg.intermediate_size, cfg.unsharded.intermediate_size
        rows = Rows(rank * size, size, total)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate_proj": rows, "up_proj": rows}, bias=cfg.mlp_bias)
        self.down_proj = reducing_linear(cfg, total, cfg.mlp_bias, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, rank: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        full = cfg.unsharded
        q = Rows(rank * cfg.q_size, cfg.q_size, full.q_size)
        kv = Rows(cfg.kv_head_start(rank) * cfg.head_dim, cfg.kv_size, full.kv_size)
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias=cfg.qkv_bias)
        self.o_proj = reducing_linear(cfg, full.q_size, cfg.o_bias, rank)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.rotary.cos_sin is not None:  # attention normalises and rotates (its kernel, with the K/V write)
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
            out = rope_paged_attention(qkv, positions, self.rotary.cos_sin, self.num_heads, *norms)
            return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, rank: int = 0) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer, rotary, rank)
        self.mlp = MLP(cfg, rank)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        """Returns (mlp output, residual); the caller adds them (the next layer's norm does it fused). The mlp output
        may be partial products (SplitKLinear): `settle` sums them."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
