"""The roofline prior against a profile's measured solo steps: the mean relative error and the median of measured /
prior per SM count, for prefills of 1k tokens or more, shorter ones, and decode. The figures of docs/SLO.md
("Roofline prior") come from it:

    PYTHONPATH=. python scripts/prior_error.py configs/models/llama-3.1-8b h200 \
        docs/data/profile-llama-3.1-8b-h200-2026-11-22.samples.jsonl
    PYTHONPATH=. python scripts/prior_error.py configs/models/llama-3.1-70b h200 \
        docs/data/goodput-tp2-70b-2026-11-29/profile-llama-3.1-70b-tp2-h200.samples.jsonl

The samples log's header names the tensor-parallel size it was measured with."""
from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from appliance.model_zoo.config import ModelConfig
from appliance.predictor.roofline import DEVICES, RooflineModel
from appliance.predictor.shapes import DecodeLoad, PrefillItem


def main(model_dir: str, device: str, samples: str) -> None:
    opener = gzip.open if samples.endswith(".gz") else open
    with opener(samples, "rt") as f:
        header, *rows = [json.loads(line) for line in f]
    model = ModelConfig.from_file(Path(model_dir) / "config.json").sharded(header.get("tensor_parallel_size", 1))
    prior = RooflineModel(model, DEVICES[device])
    ratios: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("kind") == "prefill":
            group = "prefill >= 1k tokens" if r["new"] >= 1024 else "prefill < 1k tokens"
            predicted = prior.prefill_ms([PrefillItem(r["new"], r["reused"])], r["sms"])
        elif r.get("kind") == "decode":  # `context`: each request's tokens
            group = "decode"
            predicted = prior.decode_ms(DecodeLoad(r["batch"], r["batch"] * (r["context"] - 1)), r["sms"])
        else:
            continue
        ratios[group][r["sms"]].append(r["ms"] / predicted)
    for group, by_sms in ratios.items():
        every = np.concatenate([np.array(v) for v in by_sms.values()])
        medians = "  ".join(f"{sms}: {np.median(v):.2f}" for sms, v in sorted(by_sms.items()))
        print(f"{group}: {len(every)} samples, mean error {np.mean(np.abs(every - 1)):.0%}; measured / prior by SMs: "
              f"{medians}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
