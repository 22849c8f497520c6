"""Tune the single-token graph several times on this machine's GPUs (each tuning afresh, in a cache directory of its
own), make each tuning's kernel tilings a table (appliance/engine/tilings.py), start afresh with every table on
every GPU (checking that the kernels it compiles are the table's), and keep the table whose one-row decode steps
were fastest on average over the GPUs: a tuning's own run is no judge, as one-row steps also move with the GPU and
with what the machine's other GPUs do.

    python scripts/tune_tilings.py --runs 4 --gpus 0,1,2,3 --out appliance/engine/tiling_tables/llama-3.1-8b-h200.json

Every run is `muxd bench engine --batches 1` (dummy weights of the model's shapes); a table's score is the sum of
its one-row steps' ratios to their byte floors (measured in the same run), averaged over the GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.engine import tilings  # noqa: E402


def bench(model: str, contexts: str, iters: int, cache: Path, gpu: str, setting: str, out: Path) -> subprocess.Popen:
    """One `bench engine` run of one-row decode rows with its own cache directory and tilings setting."""
    env = dict(os.environ, MUXD_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES=gpu, **{tilings.ENV: setting})
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "appliance", "bench", "engine", "--model", model, "--batches", "1",
           "--contexts", contexts, "--prefill", "512", "--iters", str(iters), "--json", str(out)]
    return subprocess.Popen(cmd, env=env, stdout=open(out.with_suffix(".log"), "w"), stderr=subprocess.STDOUT)


def one_row(result: dict) -> dict[str, dict]:
    """label -> {ms, floor_ms, ratio} of a run's one-row decode rows."""
    return {r["label"]: {k: r[k] for k in ("ms", "floor_ms", "ratio")} for r in result["rows"]
            if r["kind"] == "decode" and r["label"].startswith("decode b=1 ") and r["ms"] == r["ms"]}


def run_all(queues: dict[str, list[tuple]]) -> None:
    """Run bench jobs (cache, setting, out), each GPU its queue one job at a time (their results in out)."""
    running = {}
    queues = {gpu: [job for job in jobs if not (ARGS.reuse and job[2].exists())] for gpu, jobs in queues.items()}
    while any(queues.values()) or running:
        for gpu, jobs in queues.items():
            if gpu not in running and jobs:
                cache, setting, out = jobs.pop(0)
                running[gpu] = (out, bench(ARGS.model, ARGS.contexts, ARGS.iters, cache, gpu, setting, out))
        for gpu, (out, proc) in list(running.items()):
            if proc.poll() is not None:
                del running[gpu]
                if proc.returncode != 0:
                    sys.exit(f"run {out} failed (exit {proc.returncode}); see {out.with_suffix('.log')}")
        time.sleep(2)


def result(out: Path) -> dict:
    return json.loads(out.read_text())


def score(rows: dict[str, dict]) -> float:
    return sum(r["ratio"] for r in rows.values())


def main() -> None:
    work = Path(ARGS.workdir or tempfile.mkdtemp(prefix="muxd-tilings-"))
    work.mkdir(parents=True, exist_ok=True)
    gpus = ARGS.gpus.split(",")
    tunes = [(work / f"tune-{i}", "tune", work / f"tune-{i}.json") for i in range(ARGS.runs)]
    run_all({gpu: tunes[g::len(gpus)] for g, gpu in enumerate(gpus)})
    tunings = []
    for i, (cache, _, out) in enumerate(tunes):
        run = result(out)
        tunings.append({"rows": one_row(run), "kernels": tilings.tuned_kernels(cache / "inductor"),
                        "key": {k: v for k, v in run["startup"]["single_token_tilings"].items()
                                if k not in ("source", "kernels")}})
        print(f"tuning {i}: {len(tunings[-1]['kernels'])} kernels; while tuning: "
              + ", ".join(f"{label} {r['ratio']:.3f}x" for label, r in tunings[-1]["rows"].items()))
    if not all(t["kernels"] for t in tunings):
        sys.exit("a tuning left no tuned kernels in its cache (is the single-token graph tuned on this GPU?)")
    if any(t["key"] != tunings[0]["key"] for t in tunings):
        sys.exit("the runs' keys differ (GPU models or versions): a table is per GPU model")
    # each tuning's tilings as a table, started afresh on every GPU (round r: GPU g takes table (g + r) mod runs)
    for i, t in enumerate(tunings):
        (work / f"table-{i}.json").write_text(json.dumps({"key": t["key"], "kernels": t["kernels"]}))
    evals = {gpu: [(work / f"eval-{(g + r) % ARGS.runs}-{gpu}", str(work / f"table-{(g + r) % ARGS.runs}.json"),
                    work / f"eval-{(g + r) % ARGS.runs}-{gpu}.json") for r in range(ARGS.runs)]
             for g, gpu in enumerate(gpus)}
    run_all(evals)
    for i, t in enumerate(tunings):
        runs = {gpu: result(work / f"eval-{i}-{gpu}.json") for gpu in gpus}
        t["evals"] = {gpu: one_row(run) for gpu, run in runs.items()}
        t["score"] = sum(score(rows) for rows in t["evals"].values()) / len(gpus)
        for gpu, run in runs.items():
            source = run["startup"]["single_token_tilings"]["source"]
            found = tilings.kernel_hashes(work / f"eval-{i}-{gpu}" / "inductor")
            if not source.startswith("file") or not set(t["kernels"]) <= found:
                sys.exit(f"table {i} on GPU {gpu}: the single-token graph took {source}, "
                         f"{len(set(t['kernels']) & found)} of {len(t['kernels'])} table kernels compiled")
        print(f"table {i}: " + "; ".join(f"GPU {gpu} " + ", ".join(f"{label} {r['ratio']:.3f}x"
                                                                  for label, r in rows.items())
                                        for gpu, rows in t["evals"].items()))
    best = min(range(len(tunings)), key=lambda i: tunings[i]["score"])
    table = {"key": tunings[best]["key"], "kernels": tunings[best]["kernels"],
             "tunings": [{"while_tuning": t["rows"], "with_table": t["evals"], "chosen": i == best}
                         for i, t in enumerate(tunings)],
             "made": {"date": time.strftime("%Y-%m-%d"), "command": (  # the options that shape the table
                 f"python scripts/tune_tilings.py --model {ARGS.model} --runs {ARGS.runs} --gpus {ARGS.gpus} "
                 f"--contexts {ARGS.contexts} --iters {ARGS.iters}")}}
    out = Path(ARGS.out)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"kept table {best} (every table kernel compiled on every GPU): {len(table['kernels'])} kernels -> {out}")
    tuned = sum(score(t["rows"]) for t in tunings) / len(tunings)
    print(f"one-row ratios summed: {tunings[best]['score']:.3f} with the kept table (mean over the GPUs), "
          f"{tuned:.3f} for a tuning in its own run (mean): ship the table only if it is not slower")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="configs/models/llama-3.1-8b", help="model directory (dummy weights)")
    parser.add_argument("--runs", type=int, default=4, help="tunings to choose from (each table runs on every GPU)")
    parser.add_argument("--gpus", default="0", help="GPUs to run tunings on at once (comma-separated)")
    parser.add_argument("--contexts", default="1024,8192", help="contexts of the one-row rows that score a tuning")
    parser.add_argument("--iters", type=int, default=30, help="timed steps per row")
    parser.add_argument("--workdir", help="where the runs' caches and results go (default: a new temporary one)")
    parser.add_argument("--reuse", action="store_true", help="keep the results of runs already in --workdir")
    parser.add_argument("--out", required=True, help="the table file to write")
    ARGS = parser.parse_args()
    main()
