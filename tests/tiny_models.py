"""Tiny random checkpoints of each supported family (built with transformers on CPU) and a tiny BPE tokenizer."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

FAMILIES = {
    # Llama-3.1 style: GQA and llama3 rope scaling (short original context so the scaling matters)
    "llama": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", extra=dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        rope_theta=500000.0)),
    # Qwen2.5 small: qkv bias, tied embeddings
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", extra=dict(tie_word_embeddings=True,
                                                                          rope_theta=1000000.0)),
    # Qwen3: q/k RMSNorm, explicit head_dim different from hidden / heads
    "qwen3": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config", extra=dict(head_dim=32, rope_theta=1000000.0)),
    # Mistral with a sliding window as long as the context, so that it never applies
    "mistral": dict(cls="MistralForCausalLM", cfg="MistralConfig", extra=dict(sliding_window=512)),
}


def build_tiny_checkpoint(family: str, path: Path, vocab_size: int = 256, num_layers: int = 4, seed: int = 0,
                          dtype: torch.dtype = torch.float32, **overrides):
    """Save a random tiny model of `family` in Hugging Face layout; returns the transformers model (eval, fp32).
    `overrides` replace config fields (e.g. rope_scaling, max_position_embeddings)."""
    import transformers

    spec = FAMILIES[family]
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, **spec["extra"])
    cfg = getattr(transformers, spec["cfg"])(**{**fields, **overrides})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, spec["cls"])(cfg).eval()
        if dtype != torch.float32:
            model = model.to(dtype)
        model.save_pretrained(path)
    return model.float()


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "def main():\n    return 0\n",
    "Hello, world! Gr\u00fc\u00dfe aus K\u00f6ln. \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \U0001F600",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))", "stop here STOP now and then continue.",
] * 20


def write_tiny_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE tokenizer into `path` (tokenizer.json + tokenizer_config.json); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|end|>", "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size()
