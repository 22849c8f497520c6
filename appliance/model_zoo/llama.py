"""The decoder of the zoo: Llama 2/3/3.1, Qwen2/2.5 and Qwen3 dense as configurations of one module tree.

Parameter names follow the Hugging Face checkpoints (model.layers.N.self_attn..., lm_head) so that loading is a
name lookup. The forward is split so that a prefill can run any layer range [start, end) and resume later. Under
tensor parallelism (a config from `ModelConfig.sharded`) the model holds rank `rank`'s share; its embedding and
logits are the whole vocabulary's on every rank.
"""
from __future__ import annotations

import torch
from torch import nn

from appliance.attention import set_layer
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.layers import DecoderLayer, RMSNorm, RotaryEmbedding, settle
from appliance.model_zoo.parallel import VocabParallelEmbedding, VocabShard, vocab_logits


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, rank: int = 0) -> None:
        super().__init__()
        if cfg.tp_size == 1:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, rank, cfg.tp_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, rank) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, rank: int = 0) -> None:
        super().__init__()
        self.config, self.rank = cfg, rank
        self.model = DecoderBody(cfg, rank)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        elif cfg.tp_size == 1:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.lm_head = VocabShard(cfg.vocab_size, cfg.hidden_size, rank, cfg.tp_size)

    def rotate_in_attention(self, positions: int | None) -> bool:
        """Let attention apply the rotary embedding, from a cos/sin table of `positions` rows (the backend fuses it
        with its K/V write and q/k norms where the model has them: one kernel where the compiled layer launched four
        or more); None: the layers rotate. False where the model cannot: dynamic NTK rotates by the length too."""
        param = next(self.parameters())
        return self.model.rotary.build_table(positions, param.dtype, param.device)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_into(self, input_ids: torch.Tensor, out: torch.Tensor) -> None:
        """The embeddings of `input_ids` written into `out` (a graph's fixed buffer)."""
        if self.config.tp_size == 1:
            torch.index_select(self.model.embed_tokens.weight, 0, input_ids, out=out)
        else:
            out.copy_(self.embed(input_ids))

    def forward_layers(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                       start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run decoder layers [start, end) on a flat token batch; (hidden, residual) carry over between ranges."""
        for i in range(start, end):
            set_layer(i)
            hidden, residual = self.model.layers[i](positions, hidden, residual)
        return (hidden if residual is None else settle(hidden, residual.dtype)), residual

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head for the given rows (typically each sequence's last token) -> fp32 logits, written
        into `out` (fp32, [rows, vocab]) where given: the conversion is then the copy itself, one kernel."""
        hidden = self.model.norm(hidden) if residual is None else self.model.norm(hidden, residual)[0]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.config.tp_size == 1:
            logits = nn.functional.linear(hidden, weight)
        else:
            logits = vocab_logits(hidden, weight, self.config.vocab_size)
        return logits.float() if out is None else out.copy_(logits)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole model on a flat token batch (inside a forward context) -> fp32 logits for every row."""
        hidden, residual = self.forward_layers(positions, self.embed(input_ids), None, 0, self.num_layers)
        return self.compute_logits(hidden, residual)
