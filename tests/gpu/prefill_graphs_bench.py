"""Short prefills with and without piecewise CUDA graphs: each launch's wall time (host launch to the last layer's
event, as `muxd profile` times a prefill) against its GPU time (CUDA events around its layers on the prefill
stream), per prefill partition. Where wall / GPU is well above 1 the host, not the GPU, sets the step's time. Also
chunked prefill's mixed steps (a chunk of those tokens with `--mixed-batch` decode rows, one forward on all SMs,
launch to tokens): wall time only.

    PYTHONPATH=. python tests/gpu/prefill_graphs_bench.py [--model configs/models/llama-3.1-8b] [--sms 20,84,132]
        [--tokens 32,128,286,512] [--reused 0] [--mixed-batch 8] [--rounds 3] [--json OUT]

Dummy weights. Every point is measured `--rounds` times at different moments (rounds interleave the points), and
the table gives each mode's median and the spread (max / min - 1) of its rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.profile.grid import Point
from appliance.profile.timer import StepTimer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--sms", default="20,84,132", help="prefill partitions (SMs)")
    ap.add_argument("--tokens", default="32,128,286,512", help="new tokens per prefill")
    ap.add_argument("--reused", type=int, default=0, help="cached tokens before them")
    ap.add_argument("--mixed-batch", type=int, default=8, help="decode rows of the mixed steps (0: none measured)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-graph-rows", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = Config.flat(model=args.model, load_format="dummy", max_num_seqs=64, max_model_len=32768,
                      enable_prefix_caching=False, multiplex=True, prefill_graph_rows=args.prefill_graph_rows)
    cfg.check()
    engine = build_engine(cfg)
    timer = StepTimer(engine)
    executor = engine.executor
    print(f"prefill graphs: capture {engine.startup.get('prefill_graph_capture_s', 0):.1f} s, all graphs "
          f"{engine.startup.get('graph_memory_bytes', 0) / 2**20:.0f} MiB")
    points = [Point("prefill", int(s), new=int(n), reused=args.reused)
              for s in args.sms.split(",") for n in args.tokens.split(",")]
    full = engine.partitions.full
    if args.mixed_batch:
        points += [Point("mixed", full.prefill_sms, new=int(n), reused=args.reused, batch=args.mixed_batch,
                         context=1024) for n in args.tokens.split(",")]
    largest = executor._prefill_graphs[full.name].sizes[-1]
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for point in points:
            for mode, graphs in (("graphs", True), ("eager", False)):
                engine.runner.use_graphs = graphs
                before = executor.prefill_graph_launches
                wall = timer.measure(point)
                mixed = point.kind == "mixed"  # synchronous: no prefill event, wall time only
                gpu = float("nan") if mixed else executor.prefills[-1].ms  # the last repetition's layers
                fits = not mixed or point.new + point.batch <= largest
                if graphs and fits and executor.prefill_graph_launches == before:
                    raise SystemExit(f"{point.key}: no prefill graph replayed")
                runs.setdefault((point.key, mode), []).append((wall, gpu))
    rows = []
    print("| step | SMs | new | graphs wall ms | GPU ms | wall/GPU | spread | eager wall ms | GPU ms | wall/GPU | "
          "spread | eager/graphs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for point in points:
        row = {"kind": point.kind, "sms": point.sms, "new": point.new, "reused": point.reused, "batch": point.batch}
        for mode in ("graphs", "eager"):
            walls = [w for w, _ in runs[(point.key, mode)]]
            gpus = [g for _, g in runs[(point.key, mode)]]
            row[mode] = {"wall_ms": statistics.median(walls), "gpu_ms": statistics.median(gpus),
                         "spread": max(walls) / min(walls) - 1, "walls": walls}
        rows.append(row)
        g, e = row["graphs"], row["eager"]
        print(f"| {point.kind} | {point.sms} | {point.new} | {g['wall_ms']:.2f} | {g['gpu_ms']:.2f} | "
              f"{g['wall_ms'] / g['gpu_ms']:.2f} | {g['spread']:.0%} | {e['wall_ms']:.2f} | {e['gpu_ms']:.2f} | "
              f"{e['wall_ms'] / e['gpu_ms']:.2f} | {e['spread']:.0%} | {e['wall_ms'] / g['wall_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"startup": engine.startup, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
