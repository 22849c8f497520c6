"""The decoder of the zoo: Llama 2/3/3.1, Qwen2/2.5 and Qwen3 dense as configurations of one module tree.

Parameter names follow the Hugging Face checkpoints (model.layers.N.self_attn..., lm_head) so that loading is a
name lookup. The forward is split so that a prefill can run any layer range [start, end) and resume later.
"""
from __future__ import annotations

import torch
from torch import nn

from appliance.attention import set_layer
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.layers import DecoderLayer, RMSNorm, RotaryEmbedding


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward_layers(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                       start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run decoder layers [start, end) on a flat token batch; (hidden, residual) carry over between ranges."""
        for i in range(start, end):
            set_layer(i)
            hidden, residual = self.model.layers[i](positions, hidden, residual)
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head for the given rows (typically each sequence's last token) -> fp32 logits."""
        hidden = self.model.norm(hidden) if residual is None else self.model.norm(hidden, residual)[0]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole model on a flat token batch (inside a forward context) -> fp32 logits for every row."""
        hidden, residual = self.forward_layers(positions, self.embed(input_ids), None, 0, self.num_layers)
        return self.compute_logits(hidden, residual)
