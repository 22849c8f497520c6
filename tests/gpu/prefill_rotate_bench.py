"""Prefill launches with the rotary + K/V write kernel inside the piecewise prefill graphs (the default) and launched
eagerly between them, in turn in one process (the prefill graphs captured again for each variant), as `muxd bench
engine` times its prefill rows; a one-row decode step beside them as a check that decode is untouched.

    PYTHONPATH=. python tests/gpu/prefill_rotate_bench.py [--model configs/models/llama-3.1-8b] [--rounds 2]

Dummy weights; percentages are of the bf16 GEMM rate measured in the same run.
"""
from __future__ import annotations

import argparse
import time

from appliance.bench import engine_bench
from appliance.config import Config
from appliance.engine import prefill_graphs

PREFILLS = ((128, 0), (512, 0), (2048, 0), (512, 1024))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    start = time.perf_counter()
    config = Config.flat(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096)
    result = engine_bench.run(args.model, batches=(1,), contexts=(1024,), prefills=((512, 0),), iters=20,
                              config=config)
    bench = result.bench
    engine = bench.engine
    print(f"{args.model}: started in {time.perf_counter() - start:.0f} s; prefill graphs up to "
          f"{engine.prefill_graph_rows} rows; copy {result.ceilings['copy_TBps']:.2f} TB/s, GEMM "
          f"{result.ceilings['gemm_TFLOPps']:.0f} TFLOP/s", flush=True)
    for _ in range(args.rounds):
        for inside in (False, True):
            prefill_graphs.ROTATE_IN_GRAPH = inside
            engine.executor.capture_prefill(engine.prefill_graph_rows)
            sets = engine.executor._prefill_graphs.values()
            rotated = sum(call is None for graphs in sets for call in graphs._calls.values())
            rows = [bench.prefill(new, cached) for new, cached in PREFILLS]
            decode = bench.decode(1, 1024)
            print(f"rotary in the graphs: {inside} ({rotated} layers of all sets): " + "; ".join(
                f"{r.label} {r.ms:.3f} ms ({100 / r.ratio:.0f}%)" for r in rows) + f"; decode b=1 {decode.ms:.3f} ms",
                flush=True)


if __name__ == "__main__":
    main()
