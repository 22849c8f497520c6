"""The embedded model's training corpus: dialogues built from the Python standard library's docstrings and
signatures (`scripts/train_embedded.py` trains on it)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import random
import re
import sysconfig
import warnings
import zlib
from pathlib import Path

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
