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
import ast
import importlib
import inspect
import json
import math
import os
import random
import re
import sys
import sysconfig
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "appliance" / "model_zoo" / "embedded"

# --------------------------------------------------------------------------
# Special tokens and chat template
# --------------------------------------------------------------------------

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT]  # ids 0..5 in this order

# Every turn is "<|role|>\n{content}<|end|>\n"; the assistant's turn ends with
# <|end|>, which is the EOS token. Message content may be a string or an
# OpenAI-style list of parts (only "text" parts are rendered). Unknown roles
# are rendered as user turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = message['role'] if message['role'] in ['system', 'user', 'assistant'] else 'user' %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set ns = namespace(text='') %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{% set ns.text = ns.text + part['text'] %}{% endif %}{% endfor %}"
    "{% set content = ns.text %}{% endif %}"
    "{{ '<|' + role + '|>\\n' + content | trim + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

IDENTITY = (
    "I am the embedded demo model of muxd, a very small language model trained on "
    "the documentation of the Python standard library. Ask me what a Python module, "
    "class or function does."
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant that answers questions about Python.",
    "You are muxd's embedded model. Answer questions about the Python standard library.",
    "Answer briefly.",
]

# --------------------------------------------------------------------------
# Corpus extraction
# --------------------------------------------------------------------------

# Directories / modules never read: tests, GUI toolkits, demos, bundled wheels,
# third-party packages, and novelty modules.
SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
    "tkinter", "turtledemo", "ensurepip", "__pycache__", "lib-dynload",
    "__phello__", "pydoc_data",
}
SKIP_MODULES = {"antigravity", "this", "turtle", "__hello__", "__future__"}

# C-implemented modules whose docstrings are only reachable by importing them.
# All are side-effect free on import (no windows, no network, no terminal I/O).
C_MODULES = [
    "array", "binascii", "builtins", "cmath", "errno", "gc", "itertools",
    "marshal", "math", "select", "sys", "time", "unicodedata", "zlib",
]
BUILTIN_TYPES = [
    "bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
    "list", "object", "range", "set", "slice", "str", "tuple",
]

SIG_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->\s*.*)?$")


def paragraphs(doc: str | None, max_chars: int = 600) -> list[str]:
    """Prose paragraphs of a docstring, each unwrapped onto one line.

    Signature lines ("sqrt(x)", "f(a, b) -> int"), doctest examples, tables
    and very short fragments are dropped; long paragraphs are cut at a
    sentence end.
    """
    if not doc:
        return []
    out = []
    for p in re.split(r"\n\s*\n", doc.strip()):
        lines = [ln.strip() for ln in p.strip().splitlines()]
        lines = [ln for ln in lines if ln and not SIG_LINE.match(ln) and ln != "--"]
        if not lines or lines[0].startswith((">>>", "...", "..", ":", "|", "+", "-", "*", "=")):
            continue
        text = " ".join(lines)
        if len(text) < 20 or not re.search(r"[A-Za-z]{3}", text):
            continue
        if len(text) > max_chars:
            cut = text[:max_chars]
            end = cut.rfind(". ")
            text = cut[: end + 1] if end > max_chars // 3 else cut.rsplit(" ", 1)[0] + " ..."
        out.append(text)
    return out


def first_paragraph(doc: str | None, max_chars: int = 600) -> str | None:
    """First prose paragraph of a docstring (within its first three paragraphs)."""
    paras = paragraphs("\n\n".join(re.split(r"\n\s*\n", doc.strip())[:3]) if doc else None, max_chars)
    return paras[0] if paras else None


def stdlib_files(stdlib: Path) -> list[tuple[str, Path]]:
    """(module name, path) for every public pure-Python stdlib module, sorted."""
    out = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(("config-", ".")))
        rel = Path(root).relative_to(stdlib)
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            parts = list(rel.parts) + [fn[:-3]]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not parts:
                continue
            name = ".".join(parts)
            if any(p.startswith("_") or p.startswith("test") for p in parts):
                continue
            if parts[0] in SKIP_MODULES or name in SKIP_MODULES:
                continue
            out.append((name, Path(root) / fn))
    out.sort()
    return out


def signature_of(node: ast.AST) -> str:
    try:
        args = ast.unparse(node.args)
    except Exception:
        return "(...)"
    if args.startswith("self, ") or args == "self":
        args = args[6:] if args != "self" else ""
    elif args.startswith("cls, ") or args == "cls":
        args = args[5:] if args != "cls" else ""
    return f"({args})"


def extract_from_source(name: str, source: str):
    """Yield (kind, qualname, signature, docstring) from a module's AST."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    yield "module", name, "", ast.get_docstring(tree)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield "function", f"{name}.{node.name}", signature_of(node), ast.get_docstring(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            cq = f"{name}.{node.name}"
            yield "class", cq, "", ast.get_docstring(node)
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                    yield "method", f"{cq}.{sub.name}", signature_of(sub), ast.get_docstring(sub)


def extract_from_c_modules():
    """Docstrings of a few C modules and the methods of builtin types."""
    warnings.simplefilter("ignore")
    items = []
    for modname in C_MODULES:
        try:
            mod = importlib.import_module(modname)
        except Exception:
            continue
        items.append(("module", modname, "", inspect.getdoc(mod)))
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if inspect.isbuiltin(obj) or inspect.isroutine(obj):
                kind = "function"
            elif inspect.isclass(obj):
                kind = "class"
            else:
                continue
            qual = attr if modname == "builtins" else f"{modname}.{attr}"
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = ""
            items.append((kind, qual, sig if kind == "function" else "", inspect.getdoc(obj)))
    for tname in BUILTIN_TYPES:
        t = getattr(__import__("builtins"), tname)
        for attr in sorted(vars(t)):
            if attr.startswith("_"):
                continue
            obj = getattr(t, attr)
            if not callable(obj):
                continue
            try:
                sig = str(inspect.signature(obj)).replace("(self, ", "(").replace("(self)", "()")
            except (TypeError, ValueError):
                sig = ""
            items.append(("method", f"{tname}.{attr}", sig, inspect.getdoc(obj)))
    return items


def pydoc_topics() -> dict[str, str]:
    """The language-reference topics that back ``help('for')`` etc."""
    try:
        from pydoc_data.topics import topics
    except Exception:
        return {}
    return {k: topics[k] for k in sorted(topics)}


QUESTIONS = {
    "function": [
        "What does {q} do?", "What does the {q} function do?", "Explain {q}.",
        "What is {q} used for?", "Tell me about {q}.", "How does {q} work?",
        "Can you describe {q}?", "What is {q}?",
    ],
    "method": [
        "What does {q} do?", "What does the {q} method do?", "Explain {q}.",
        "What is {q} used for?", "Tell me about {q}.", "How does {q} work?",
    ],
    "class": [
        "What is {q}?", "What is the {q} class?", "Explain the {q} class.",
        "What is {q} used for?", "Tell me about {q}.", "Describe {q}.",
    ],
    "module": [
        "What is the {q} module?", "What is the {q} module for?",
        "Tell me about the {q} module.", "What does the {q} module do?",
        "Explain Python's {q} module.", "What is {q} in Python?",
    ],
    "topic": [
        "Explain {q} in Python.", "What is {q} in Python?", "Tell me about {q}.",
        "How does {q} work in Python?",
    ],
}

FOLLOW_UPS = ["Tell me more.", "Can you give more detail?", "Go on.", "What else should I know?"]
SIG_QUESTIONS = ["What arguments does {q} take?", "What is the signature of {q}?", "How do I call {q}?"]

GREETINGS = [
    ("Hello!", "Hello! " + IDENTITY),
    ("Hi", "Hi! " + IDENTITY),
    ("Who are you?", IDENTITY),
    ("What are you?", IDENTITY),
    ("What can you do?", "I can answer short questions about the Python standard library, "
     "such as what a module, class or function does. I am a very small model, so my answers "
     "may be wrong."),
    ("Tell me about yourself.", IDENTITY),
    ("Thank you!", "You are welcome!"),
    ("Thanks.", "You are welcome!"),
]

TOPIC_NAMES = {
    "assignment": "assignment statements", "async": "async functions", "atom-identifiers": "identifiers",
    "attribute-access": "attribute access", "augassign": "augmented assignment", "break": "the break statement",
    "class": "class definitions", "comparisons": "comparisons", "continue": "the continue statement",
    "dict": "dictionary displays", "exceptions": "exceptions", "for": "the for statement",
    "function": "function definitions", "global": "the global statement", "if": "the if statement",
    "import": "the import statement", "lambda": "lambda expressions", "lists": "list displays",
    "nonlocal": "the nonlocal statement", "pass": "the pass statement", "raise": "the raise statement",
    "return": "the return statement", "slicings": "slicings", "try": "the try statement",
    "while": "the while statement", "with": "the with statement", "yield": "the yield statement",
    "booleans": "boolean operations", "numbers": "numeric literals", "strings": "string literals",
    "typesseq": "sequence types", "typesmapping": "mapping types", "truth": "truth value testing",
    "context-managers": "context managers", "specialnames": "special method names",
}


def heldout(name: str, every: int = 16) -> bool:
    """Deterministic held-out split (~1/16) by top-level module or topic name.

    Splitting by top-level module keeps a held-out module's docstrings out of
    every training stream (chat, doc pages and source alike). Topics are
    passed as "topic-<name>".
    """
    top = name.split(".")[0]
    return zlib.crc32(top.encode()) % every == 0


def group_of(kind: str, qual: str) -> str:
    """Top-level module an item belongs to; undotted non-module names are builtins."""
    if kind == "module" or "." in qual:
        return qual.split(".")[0]
    return "builtins"


def build_corpus(seed: int):
    """Return ({stream name: (train docs, held-out docs)}, corpus statistics)."""
    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(stdlib)

    items = []          # (kind, qualname, signature, docstring)
    source_docs = {}    # module name -> source text
    for name, path in files:
        try:
            src = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        source_docs[name] = src
        items.extend(extract_from_source(name, src))
    items.extend(extract_from_c_modules())
    topics = pydoc_topics()

    # (a) Plain text: pydoc-like pages (signature + full docstring) per module.
    pages: dict[str, list[str]] = {}
    for kind, qual, sig, doc in items:
        if not doc:
            continue
        top = group_of(kind, qual)
        header = {"module": f"Help on module {qual}:", "class": f"class {qual}"}.get(kind, f"{qual}{sig}")
        pages.setdefault(top, []).append(f"{header}\n\n{doc.strip()}\n")
    doc_train, doc_held = [], []
    for top in sorted(pages):
        (doc_held if heldout(top) else doc_train).append("\n".join(pages[top]))
    for key, text in topics.items():
        (doc_held if heldout("topic-" + key) else doc_train).append(text.strip())

    src_train, src_held = [], []
    for name in sorted(source_docs):
        (src_held if heldout(name) else src_train).append(source_docs[name])

    # (b) Chat question/answer pairs from docstring paragraphs. Each entry is
    # (split key, list of (question, answer) turns).
    qa: list[tuple[str, list[tuple[str, str]]]] = []
    seen = set()
    for kind, qual, sig, doc in items:
        ans = first_paragraph(doc)
        if not ans or qual in seen:
            continue
        seen.add(qual)
        rest = paragraphs(doc)[1:]
        n_q = 2 if kind in ("module", "class") else 1
        for tmpl in rng.sample(QUESTIONS[kind], n_q):
            turns = [(tmpl.format(q=qual), ans)]
            if rest and rng.random() < 0.3:
                turns.append((rng.choice(FOLLOW_UPS), rest[0]))
            qa.append((group_of(kind, qual), turns))
        if kind in ("function", "method") and sig and len(sig) < 160 and rng.random() < 0.25:
            q = rng.choice(SIG_QUESTIONS).format(q=qual)
            qa.append((group_of(kind, qual), [(q, f"The signature is {qual}{sig}. {ans}")]))
    for key, text in topics.items():
        if key not in TOPIC_NAMES:
            continue
        paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
        # Skip the heading and underline of the topic page.
        body = paragraphs("\n\n".join(p for p in paras if not re.fullmatch(r"[\s\S]*\n[*=\-]+\s*", p)))
        if body:
            for tmpl in rng.sample(QUESTIONS["topic"], 2):
                turns = [(tmpl.format(q=TOPIC_NAMES[key]), body[0])]
                if len(body) > 1:
                    turns.append((rng.choice(FOLLOW_UPS), body[1]))
                qa.append(("topic-" + key, turns))

    import jinja2
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    template = env.from_string(CHAT_TEMPLATE)

    def render(messages):
        # Training text is exactly the template rendering followed by nothing:
        # the last assistant turn already ends with <|end|>.
        return template.render(messages=messages, bos_token=BOS, eos_token=EOS, add_generation_prompt=False)

    rng.shuffle(qa)
    chat_train, chat_held = [], []
    for key, turns in qa:
        messages = []
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for q, a in turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        (chat_held if heldout(key) else chat_train).append(render(messages))
    for rep in range(20):
        for q, a in GREETINGS:
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if rep % 4 == 0:
                msgs.insert(0, {"role": "system", "content": SYSTEM_PROMPTS[rep % len(SYSTEM_PROMPTS)]})
            chat_train.append(render(msgs))

    # Plain-text documents are wrapped as <|bos|> text <|end|>.
    def wrap(docs):
        return [BOS + d + EOS for d in docs]

    streams = {
        "chat": (chat_train, chat_held),
        "doc": (wrap(doc_train), wrap(doc_held)),
        "src": (wrap(src_train), wrap(src_held)),
    }
    stats = {
        "modules": len(files), "docstring_items": len(items), "qa_pairs": len(qa),
        "topics": len(topics),
    }
    return streams, stats


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

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
