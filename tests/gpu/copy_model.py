"""A small Llama (head_dim 128, GQA 2) trained in seconds to continue a periodic sequence: with period P, the token at
position t equals the token at t - P. Its greedy predictions are confident and depend on attention reading the right
KV positions, which makes it a fair token-for-token check of attention backends, graphs and prefix caching in bf16.
"""
from __future__ import annotations

from pathlib import Path

import torch

PERIOD = 24
VOCAB = 256


def periodic_prompt(seed: int, length: int, period: int = PERIOD) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, VOCAB, (period,), generator=g).tolist()
    return [base[i % period] for i in range(length)]


def train_copy_model(path: Path, device: str = "cuda", steps: int = 500, seed: int = 0, heads: int = 2,
                     kv_heads: int = 1) -> Path:
    """Train and save (bf16 safetensors, Hugging Face layout) into path; returns path. `heads` query heads of 128
    over `kv_heads` KV heads."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128 * heads, intermediate_size=256 * heads, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    length = 8 * PERIOD  # longer than any test's prompt plus its output
    for _ in range(steps):
        base = torch.randint(3, VOCAB, (64, PERIOD), generator=g)
        x = base.repeat(1, length // PERIOD).to(device)
        logits = model(x).logits[:, PERIOD - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, PERIOD:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().to(torch.bfloat16).save_pretrained(path)
    return path
