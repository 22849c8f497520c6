"""SLO-aware routing against Ray Serve's power-of-two-choices on one bursty trace slice, as docs/PERFORMANCE.md
reports it: `muxd bench --routers slo,pow2` and then `--routers pow2,slo` (each starts `muxd cluster` per router:
engine replicas of the embedded model on a local Ray cluster), the two replays of each router pooled by `muxd
bench pool`'s rules (attainment over every request, TTFT percentiles over every first token). Running both orders
cancels the drift of a shared machine's load over the minutes the runs take. Writes DIR/comparison.md (and .json).

    python scripts/compare_routers.py --out bench-routers       # about 4 minutes on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.bench.pool import pool, read_point  # noqa: E402
from appliance.slo.contract import load_contract  # noqa: E402

CONTRACT = ROOT / "configs" / "slo" / "cpu-cluster.yaml"
ROUTERS = ("slo", "pow2")


def bench(order: tuple[str, ...], out: Path, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "appliance", "bench", "--trace", str(args.trace), "--window", args.window,
               "--max-requests", str(args.requests), "--request-rate", str(args.rate), "--routers", ",".join(order),
               "--cluster-args", f"--replicas {args.replicas} --replica-cpus {args.replica_cpus}",
               "--serve-args", f"--slo {args.slo}", "--slo", str(args.slo), "--save-detailed", "--no-progress",
               "--result-dir", str(out)]
    subprocess.run(command, check=True, cwd=ROOT)
    return command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(f"bench-routers-{time.strftime('%Y%m%d-%H%M%S')}"))
    parser.add_argument("--trace", type=Path, required=True,
                        help="the full Azure LLM inference code 2023 trace (azure_code_2023.csv)")
    parser.add_argument("--window", default="855:865", help="the trace's burst (Azure code: 327 requests in 10 s)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=2.5, help="re-timed average rate, the burst pattern kept")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--slo", type=Path, default=CONTRACT)
    args = parser.parse_args()
    contract = load_contract(args.slo)
    orders = {"ab": ROUTERS, "ba": tuple(reversed(ROUTERS))}
    commands = {name: bench(order, args.out / name, args) for name, order in orders.items()}
    rows, runs = [], {}
    for router in ROUTERS:
        paths = [args.out / name / f"result-router_{router}.json" for name in orders]
        points = [read_point(p) for p in paths]
        pooled = pool(points, contract, sources=[str(p) for p in paths])
        runs[router] = [{"order": name, "slo_attainment": p["slo_attainment"], "p99_ttft_ms": p["p99_ttft_ms"]}
                        for name, p in zip(orders, points)]
        rows.append((router, pooled))
    lines = ["| router | requests | attainment | p50 TTFT (ms) | p90 TTFT (ms) | p99 TTFT (ms) | contract kept | "
             "per run (attainment, p99 TTFT) |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for router, p in rows:
        per_run = "; ".join(f"{r['order']}: {100 * r['slo_attainment']:.1f} %, {r['p99_ttft_ms']:.0f} ms"
                            for r in runs[router])
        lines.append(f"| {router} | {p.requests} | {100 * p.attainment:.1f} % | {p.ttft_ms['p50']:.0f} | "
                     f"{p.ttft_ms['p90']:.0f} | {p.ttft_ms['p99']:.0f} | {'yes' if p.passed else 'no'} | {per_run} |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comparison.md").write_text(table + "\n")
    (args.out / "comparison.json").write_text(json.dumps(
        {"routers": {router: p.as_dict() for router, p in rows}, "runs": runs,
         "commands": {k: shlex.join(v) for k, v in commands.items()}}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
