"""How one transformer layer's four GEMMs (QKV, O, gate+up, down) scale with the number of tokens on an SM partition:
the time per token is not smooth where the library's kernel choice changes (cuBLAS chooses for the whole GPU, not
for the SMs a green context leaves it), and a linear latency model cannot follow such steps.

    python scripts/gemm_shapes.py [--model configs/models/llama-3.1-8b] [--sms 20,52,132] [--tokens 128:1024:32]
        [--pad N] [--blas default|cublas|cublaslt] [--target-sms] [--json OUT]
"""
from __future__ import annotations

import argparse
import json

import torch

from appliance.model_zoo.config import ModelConfig
from appliance.multiplex.gemm_probe import time_gemms
from appliance.multiplex.partitions import PartitionSet


def layer_linears(cfg: ModelConfig, device: str) -> list[torch.nn.Linear]:
    """One layer's GEMMs (QKV, O, gate+up, down) with random bf16 weights."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    shapes = [(cfg.hidden_size, q + 2 * kv), (q, cfg.hidden_size), (cfg.hidden_size, 2 * cfg.intermediate_size),
              (cfg.intermediate_size, cfg.hidden_size)]
    return [torch.nn.Linear(i, o, bias=False, device=device, dtype=torch.bfloat16) for i, o in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--sms", default="20,52,132", help="prefill partitions (SMs) to time on")
    ap.add_argument("--tokens", default="128:1024:32", help="start:stop:step of token counts (stop included)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--pad", type=int, default=1, help="pad the rows up to a multiple of this")
    ap.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default")
    ap.add_argument("--target-sms", action="store_true", help="tell cuBLASLt how many SMs each partition has (the SM "
                    "carveout: the GPU's SMs less the partition's) so that it picks its kernel for them")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    cfg = ModelConfig.from_file(f"{args.model}/config.json")
    parts = PartitionSet.create(0)
    streams = {parts.total_sms: parts.full.prefill_stream, **{p.prefill_sms: p.prefill_stream for p in parts.splits}}
    wanted = [int(s) for s in args.sms.split(",")]
    missing = [s for s in wanted if s not in streams]
    if missing:
        raise SystemExit(f"no prefill partition of {missing} SMs; this GPU offers {sorted(streams)}")
    a, b, c = (int(v) for v in args.tokens.split(":"))
    linears = layer_linears(cfg, "cuda")
    inputs = {w: torch.randn(-(-b // args.pad) * args.pad, w, device="cuda", dtype=torch.bfloat16)
              for w in {x.in_features for x in linears}}
    rows = []
    for tokens in range(a, b + 1, c):
        row = {"tokens": tokens}
        for sms in wanted:
            if args.target_sms:
                torch._C._set_sm_carveout_experimental(parts.total_sms - sms)
            with torch.inference_mode():
                row[str(sms)] = time_gemms(linears, inputs, -(-tokens // args.pad) * args.pad, streams[sms],
                                           args.iters)
        rows.append(row)
    print(f"{torch.cuda.get_device_name(0)}: one layer's GEMMs of {args.model}, ms (and us per token); "
          f"rows padded to a multiple of {args.pad}, BLAS {args.blas}"
          f"{', kernels chosen for each partition' if args.target_sms else ''}")
    print("tokens " + " ".join(f"{s:>16} SMs" for s in wanted))
    for row in rows:
        print(f"{row['tokens']:6d} " + " ".join(f"{row[str(s)]:9.3f} ({row[str(s)] / row['tokens'] * 1e3:5.2f})"
                                               for s in wanted))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "model": args.model, "pad": args.pad, "blas": args.blas,
                       "target_sms": args.target_sms,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
