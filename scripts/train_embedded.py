#!/usr/bin/env python3
"""Train the embedded default model shipped in ``appliance/model_zoo/embedded/``.

A tiny Llama-architecture causal LM with a byte-level BPE tokenizer, trained
from scratch on CPU from text that exists on every machine with Python: the
standard library's own docstrings and source, plus chat-formatted
question/answer pairs built from those docstrings.

The whole run (data extraction, tokenizer, training, export) is bounded by
``--minutes`` of wall time; training stops when the budget runs out. Every
random choice is seeded, and module lists are sorted, so the corpus is
identical for a given Python version.

Usage:
    .venv/bin/python scripts/train_embedded.py --minutes 20
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from embedded_corpus import (
    ASSISTANT,
    BOS,
    CHAT_TEMPLATE,
    DEFAULT_OUT,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    SYSTEM,
    USER,
    build_corpus,
)


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    add_bos_processor(tok)
    return tok


def add_bos_processor(tok) -> None:
    """encode(text) with special tokens prepends <|bos|>, as Llama tokenizers do; the training streams and chat
    prompts (whose template writes the BOS itself) are encoded without special tokens."""
    from tokenizers import processors

    bos_id = SPECIAL_TOKENS.index(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]),
    ])


def encode_stream(tok, docs) -> np.ndarray:
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.int32)


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------

def model_config(args, vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "torch_dtype": "bfloat16",
    }


def export(out: Path, model, tok, cfg: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    state = {
        k: v.detach().to(torch.bfloat16).contiguous().clone()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"  # tied to model.embed_tokens.weight
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": False,
        "max_new_tokens": 256,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": [SYSTEM, USER, ASSISTANT]}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def sample_generations(out: Path, max_new_tokens: int = 64) -> list[tuple[str, str]]:
    """Greedy generations from the exported checkpoint, loaded in float32."""
    import jinja2
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    chat = jinja2.Environment().from_string(tok_cfg["chat_template"]).render(
        messages=[{"role": "user", "content": "What does json.dumps do?"}],
        bos_token=tok_cfg["bos_token"], eos_token=tok_cfg["eos_token"], add_generation_prompt=True)
    plain = tok_cfg["bos_token"] + "The os module provides"
    results = []
    for prompt in (chat, plain):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
        with torch.no_grad():
            outp = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=gen_cfg["eos_token_id"],
                                  pad_token_id=gen_cfg["pad_token_id"])
        results.append((prompt, tok.decode(outp[0, ids.shape[1]:].tolist(), skip_special_tokens=False)))
    return results


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--minutes", type=float, default=20.0,
                   help="wall-time budget for the whole run; training stops when it runs out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mix", type=str, default="chat=0.5,doc=0.3,src=0.2",
                   help="sampling weights of the training streams")
    p.add_argument("--max-steps", type=int, default=0, help="optional step cap (0: time budget only)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--reserve-s", type=float, default=45.0,
                   help="seconds kept back from the budget for evaluation and export")
    p.add_argument("--autocast", choices=["auto", "bf16", "off"], default="auto",
                   help="bf16 autocast for matmuls (weights and optimizer stay fp32); "
                        "auto: on when the CPU has native bf16 (AVX512-BF16 or AMX)")
    p.add_argument("--no-export", action="store_true")
    args = p.parse_args(argv)

    t0 = time.time()
    deadline = t0 + args.minutes * 60.0
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    def log(msg):
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    if args.autocast == "auto":
        native_bf16 = False
        try:
            native_bf16 = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        except AttributeError:
            pass
        use_bf16 = native_bf16
    else:
        use_bf16 = args.autocast == "bf16"
    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"bf16 autocast {'on' if use_bf16 else 'off'}")
    streams, stats = build_corpus(args.seed)
    for k, (tr, he) in streams.items():
        log(f"stream {k}: {len(tr)} train docs ({sum(map(len, tr)) / 1e6:.2f} MB), "
            f"{len(he)} held-out docs ({sum(map(len, he)) / 1e6:.2f} MB)")
    log(f"corpus stats: {stats}")

    tok_texts = streams["chat"][0] + streams["doc"][0] + streams["src"][0]
    tok = train_tokenizer(tok_texts, args.vocab_size)
    vocab = tok.get_vocab_size()
    log(f"tokenizer: vocab {vocab}")

    data = {}
    for k, (tr, he) in streams.items():
        data[k] = (encode_stream(tok, tr), encode_stream(tok, he))
        n_chars = sum(map(len, tr))
        log(f"tokens {k}: train {len(data[k][0]):,} ({n_chars / max(1, len(data[k][0])):.2f} chars/token), "
            f"held-out {len(data[k][1]):,}")

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model_config(args, vocab)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    model = LlamaForCausalLM(hf_cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters ({n_params * 2 / 2**20:.2f} MiB in bf16)")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
    names = sorted(mix)
    probs = np.array([mix[n] for n in names]) / sum(mix.values())
    gen = np.random.default_rng(args.seed)
    L = args.seq_len

    def sample_batch(split: int, g, n):
        rows = []
        choice = g.choice(len(names), size=n, p=probs)
        for c in choice:
            arr = data[names[c]][split]
            start = int(g.integers(0, len(arr) - L - 1))
            rows.append(arr[start:start + L + 1])
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        return x[:, :-1], x[:, 1:]

    def loss_fn(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(input_ids=x).logits
        logits = logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    train_end = deadline - args.reserve_s
    train_start = time.time()
    budget = max(1.0, train_end - train_start)
    log(f"training for up to {budget:.0f}s (seq {L}, batch {args.batch_size})")

    def lr_at(step, frac):
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        frac = min(1.0, frac)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    step, recent, tokens = 0, [], 0
    while True:
        now = time.time()
        frac = (now - train_start) / budget
        if args.max_steps:
            frac = max(frac, step / args.max_steps)
        if now >= train_end or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(step, frac)
        for gparams in opt.param_groups:
            gparams["lr"] = lr
        x, y = sample_batch(0, gen, args.batch_size)
        loss = loss_fn(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        recent.append(loss.item())
        recent = recent[-50:]
        if step % args.log_every == 0:
            el = time.time() - train_start
            log(f"step {step:5d}  loss {sum(recent[-args.log_every:]) / len(recent[-args.log_every:]):.4f}  "
                f"lr {lr:.2e}  {tokens / el:,.0f} tok/s")
    train_time = time.time() - train_start
    final_train = sum(recent) / max(1, len(recent))
    log(f"trained {step} steps, {tokens:,} tokens in {train_time:.0f}s; "
        f"final train loss (mean of last {len(recent)} steps) {final_train:.4f}")

    model.eval()
    res = {}
    with torch.no_grad():
        for split, label in ((0, "train"), (1, "held-out")):
            g = np.random.default_rng(args.seed + 1)
            losses = []
            for _ in range(max(1, args.eval_windows // 16)):
                x, y = sample_batch(split, g, 16)
                losses.append(loss_fn(x, y).item())
            res[label] = sum(losses) / len(losses)
        # Per-stream held-out losses.
        for k in names:
            arr = data[k][1]
            g = np.random.default_rng(args.seed + 2)
            if len(arr) < 2 * (L + 1):
                continue
            starts = g.integers(0, len(arr) - L - 1, size=32)
            x = torch.from_numpy(np.stack([arr[s:s + L + 1] for s in starts]).astype(np.int64))
            res[f"held-out/{k}"] = loss_fn(x[:, :-1], x[:, 1:]).item()
    log("eval: " + ", ".join(f"{k} loss {v:.4f}" for k, v in res.items()))

    if not args.no_export:
        export(args.out, model, tok, cfg)
        size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
        log(f"exported to {args.out} ({size / 2**20:.2f} MiB)")
        for prompt, completion in sample_generations(args.out):
            log(f"greedy sample:\n--- prompt ---\n{prompt}\n--- completion ---\n{completion}\n---")
    log(f"total wall time {time.time() - t0:.0f}s")
    print(json.dumps({"steps": step, "train_tokens": tokens, "final_train_loss": round(final_train, 4),
                      **{f"{k}_loss": round(v, 4) for k, v in res.items()},
                      "params": n_params, "wall_s": round(time.time() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
