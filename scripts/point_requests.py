"""One row per request of a `muxd bench --save-detailed` point JSON (plain or gzipped): start on the replay's clock,
prompt and output tokens, TTFT, and the request's p99 and largest inter-token gap. These are the `*.requests.csv`
files kept beside the measured summaries under docs/data/.

    PYTHONPATH=. python scripts/point_requests.py POINT.json[.gz] OUT.requests.csv
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

from appliance.bench.pool import read_point
from appliance.errors import ApplianceError

HEADER = ["start_s", "input_tokens", "output_tokens", "ttft_ms", "p99_tbt_ms", "max_tbt_ms"]


def request_rows(point: dict) -> list[list[str]]:
    """The point's requests in replay order; times in the point are seconds, rows are milliseconds."""
    t0 = min(point["start_times"])
    rows = []
    for start, n_in, n_out, ttft, itl in zip(point["start_times"], point["input_lens"], point["output_lens"],
                                             point["ttfts"], point["itls"]):
        gaps = np.asarray(itl, dtype=float) * 1e3
        p99 = f"{np.percentile(gaps, 99):.1f}" if gaps.size else ""
        worst = f"{gaps.max():.1f}" if gaps.size else ""
        rows.append([f"{start - t0:.3f}", str(n_in), str(n_out), f"{ttft * 1e3:.1f}", p99, worst])
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        rows = request_rows(read_point(Path(argv[0])))
    except ApplianceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(argv[1], "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(HEADER)
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
