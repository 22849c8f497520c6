"""What constrained decoding (structured output, forced tool calls) costs a decode step: the same batch of decoding
requests stepped with and without a JSON grammar on each, on a model of real shapes with dummy weights, and the two
parts the grammar adds (the host filling the token bitmasks, the device applying them) timed alone.

    PYTHONPATH=. python tests/gpu/constrained_decoding_bench.py [--model configs/models/llama-3.1-8b] [--batch 64]
        [--steps 64] [--context 1024] [--json OUT] [--trace DIR]

A dummy checkpoint has no tokenizer: the benchmark writes one with the model's vocabulary size (the embedded model's
byte-level pieces and concatenations of them), so the grammar compiler sees a vocabulary of the real size.
Only steps where the whole batch decodes are counted. Prints a markdown table; the target is < 5 % of the step.
`--trace DIR` also records 16 constrained and 16 plain steps with torch.profiler: a Chrome trace of each in DIR and the
operators that took the most host and device time, printed. It needs xgrammar (a dependency of muxd), which a bare GPU
machine may lack: bring its wheel along.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from appliance.config import EMBEDDED_MODEL_DIR, Config
from appliance.engine.factory import build_engine
from appliance.engine.grammar import GrammarSpec, apply_masks
from appliance.engine.request import SamplingParams

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                         "score": {"type": "number"}},
                                     "required": ["name", "score"]}}


def model_with_tokenizer(model: str, out: Path) -> Path:
    """A copy of the model directory with a byte-level BPE tokenizer of the model's vocabulary size."""
    shutil.copytree(model, out, dirs_exist_ok=True)
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    spec = json.loads((EMBEDDED_MODEL_DIR / "tokenizer.json").read_text())
    specials = list(spec["added_tokens"])
    special_text = {t["content"] for t in specials}
    base = [p for p, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if p not in special_text]
    vocab: dict[str, int] = {p: i for i, p in enumerate(base)}
    i = 0
    while len(vocab) < vocab_size - len(specials):
        vocab.setdefault(base[i % len(base)] + base[i // len(base) % len(base)], len(vocab))
        i += 1
    for t in specials:
        t["id"] = len(vocab)
        vocab[t["content"]] = t["id"]
    spec["model"]["vocab"], spec["model"]["merges"] = vocab, []
    spec["added_tokens"] = specials
    (out / "tokenizer.json").write_text(json.dumps(spec))
    eos = next(t["id"] for t in specials if t["content"] == "<|end|>")
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "bos_token": "<|bos|>"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


def submit(engine, batch: int, context: int, max_tokens: int, grammar: GrammarSpec | None) -> None:
    """`batch` requests of a `context`-token prompt, sampled, each to exactly `max_tokens` tokens."""
    prompt = [(7 * i + 11) % 1000 + 10 for i in range(context)]
    for _ in range(batch):
        engine.submit(engine.make_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                 ignore_eos=True, grammar=grammar)))


def step_times(engine, batch: int, steps: int, context: int, grammar: GrammarSpec | None) -> list[float]:
    submit(engine, batch, context, steps + 8, grammar)
    times = []
    while engine.has_unfinished():
        full = len(engine.scheduler.decoding) == batch
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        if full and len(engine.scheduler.decoding) == batch:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def mask_parts(engine, batch: int, vocab: int, rounds: int = 50) -> tuple[float, float]:
    """(host ms to fill a batch's bitmasks, device ms to apply them) at the grammar's start state."""
    matchers = [engine.grammars.matcher(GrammarSpec("json_schema", json.dumps(SCHEMA))) for _ in range(batch)]
    logits = torch.randn(batch, vocab, device="cuda")
    import xgrammar as xgr  # defers xgrammar to the measurement

    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    start = time.perf_counter()
    for _ in range(rounds):
        xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask([m._m for m in matchers], bitmask)
    fill = (time.perf_counter() - start) * 1e3 / rounds
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        apply_masks(logits, matchers, list(range(batch)))
    torch.cuda.synchronize()
    both = (time.perf_counter() - start) * 1e3 / rounds
    return fill, max(0.0, both - fill)


def profile_steps(engine, batch: int, context: int, grammar: GrammarSpec | None, out: Path) -> None:
    """16 decode steps of a full batch under torch.profiler (prefill left out): a Chrome trace at OUT.json.gz and the
    top operators printed."""
    from torch.profiler import ProfilerActivity, profile

    submit(engine, batch, context, 40, grammar)
    while len(engine.scheduler.decoding) < batch:
        engine.step()
    for _ in range(2):
        engine.step()
    out.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(16):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    prof.export_chrome_trace(str(out) + ".json.gz")
    for key in ("self_cpu_time_total", "self_device_time_total"):
        print(f"== {out.name}: top operators by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None, help="directory for torch.profiler traces of both kinds of step")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_with_tokenizer(args.model, Path(tmp) / "model")
        # serial: every prompt is prefilled before decoding starts, so the whole batch decodes together
        cfg = Config.flat(model=str(model), load_format="dummy", max_num_seqs=args.batch, policy="serial",
                          max_model_len=args.context + args.steps + 64, enable_prefix_caching=False)
        engine = build_engine(cfg)
        vocab = engine.model.config.vocab_size
        # at least as many array items as steps: no output can end (the grammar closed) before the last step counted
        long = GrammarSpec("json_schema", json.dumps({**SCHEMA, "minItems": args.steps + 8}))
        step_times(engine, args.batch, 4, args.context, long)  # warm-up
        plain = step_times(engine, args.batch, args.steps, args.context, None)
        constrained = step_times(engine, args.batch, args.steps, args.context, long)
        engine.async_scheduling = False  # a grammar's steps are read at once: the plain step without the overlap
        plain_sync = step_times(engine, args.batch, args.steps, args.context, None)
        fill, apply = mask_parts(engine, args.batch, vocab)
        if args.trace:
            engine.async_scheduling = True
            profile_steps(engine, args.batch, args.context, long, Path(args.trace) / "constrained")
            profile_steps(engine, args.batch, args.context, None, Path(args.trace) / "plain")
    result = {"device": torch.cuda.get_device_name(0), "model": args.model, "vocab": vocab, "batch": args.batch,
              "context": args.context, "plain_step_ms": statistics.median(plain),
              "constrained_step_ms": statistics.median(constrained),
              "plain_sync_step_ms": statistics.median(plain_sync),
              "steps_counted": [len(plain), len(constrained), len(plain_sync)],
              "bitmask_fill_ms": fill, "bitmask_apply_ms": apply}
    result["overhead_pct"] = 100 * (result["constrained_step_ms"] / result["plain_step_ms"] - 1)
    result["overhead_vs_sync_pct"] = 100 * (result["constrained_step_ms"] / result["plain_sync_step_ms"] - 1)
    print(f"| {result['device']} | batch {args.batch}, context {args.context}, vocab {vocab} | |\n| --- | --- | --- |")
    for key in ("plain_step_ms", "plain_sync_step_ms", "constrained_step_ms", "overhead_pct", "overhead_vs_sync_pct",
                "bitmask_fill_ms", "bitmask_apply_ms"):
        print(f"| {key} | {result[key]:.3f} | |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
