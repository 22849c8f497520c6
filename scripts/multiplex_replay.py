"""p99 TBT and TTFT of the `layerwise` engine with prefill and decode multiplexed on SM partitions against the same
engine running prefill and decode one after the other (`serial`, no partitions), replaying the same Mooncake slice
at a fixed request rate in process (token-id prompts, dummy weights). Writes the layerwise run's Chrome-trace timeline.

    PYTHONPATH=. python scripts/multiplex_replay.py --trace PATH/mooncake_conversation.jsonl --rate 0.7 -n 40 --out DIR
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
from pathlib import Path

import torch

from appliance.bench import workload as wl
from appliance.bench.client import InProcessTarget, replay
from appliance.bench.metrics import summarize
from appliance.bench.prompts import PromptSynth
from appliance.bench.traces import load_trace
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.engine import Engine, EngineConfig
from appliance.model_zoo.loader import load_model


async def run_policy(engine: Engine, specs, prompts) -> dict:
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        result = await replay(specs, prompts, InProcessTarget(aengine))
    finally:
        aengine.shutdown()
    return summarize(result.timelines, result.duration)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--trace", required=True)
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.7)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--decode-sms", type=int, default=64)
    ap.add_argument("--layers-per-step", type=int, default=2)
    ap.add_argument("--out", default="gpu-results")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no partitions)")
    ap.add_argument("--timeline", default="timeline-layerwise.json", help="file name of the layerwise timeline")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    specs = wl.select(load_trace(args.trace), max_requests=args.n)
    specs = wl.retime(wl.spread_ties(specs), rate=args.rate)
    specs, clipped = wl.clip_to_context(specs, args.max_model_len - 1)
    cuda = args.device.startswith("cuda")
    model = load_model(args.model, device=args.device, load_format="dummy",
                       dtype=None if cuda else "float32")
    synth = PromptSynth(vocab_size=model.config.vocab_size)
    prompts = [synth.token_ids(s, i) for i, s in enumerate(specs)]
    print(f"{len(specs)} Mooncake requests at {args.rate} req/s ({clipped} clipped to {args.max_model_len} tokens), "
          f"mean prompt {sum(s.prompt_len for s in specs) / len(specs):.0f} tokens, "
          f"mean output {sum(s.output_len for s in specs) / len(specs):.0f} tokens; "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}")
    rows = {}
    for policy, multiplex in (("layerwise", cuda), ("serial", False)):
        config = EngineConfig(planner=policy, multiplex=multiplex, max_num_seqs=64, max_model_len=args.max_model_len,
                              layers_per_step=args.layers_per_step, layerwise_decode_sms=args.decode_sms)
        engine = Engine(model, None, config)
        rows[policy] = asyncio.run(run_policy(engine, specs, prompts))
        if policy == "layerwise":
            engine.executor.timeline.save(out / args.timeline)
            rows[policy]["partition_switches"] = engine.executor.switches
            rows[policy]["prefill_layer_launches"] = engine.executor.layers_launched
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    keys = ("completed", "p50_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "request_throughput")
    print("| policy | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for policy, summary in rows.items():
        print(f"| {policy} | " + " | ".join(f"{summary.get(k, float('nan')):.1f}" for k in keys) + " |")
    (out / "multiplex-replay.json").write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
