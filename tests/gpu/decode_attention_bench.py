"""Decode attention alone, per kernel choice: flashinfer's tensor-core path (its prefill kernel, muxd's choice for GQA
groups of 4 and more), the same with the KV split disabled, the CUDA-core decode kernel, muxd's Triton split-KV
decode (attention/triton_decode.py, which graph batches up to its MAX_BATCH run) and its balanced form
(`--decode-kernel triton` beyond MAX_BATCH rows), at several batch sizes and contexts. Each figure is one layer's
call, timed as a CUDA graph of `--layers` calls over distinct layers' KV (as a decode graph replays them, so that no
call finds the last one's KV in L2), against the bytes it must read.

    PYTHONPATH=. python tests/gpu/decode_attention_bench.py [--batches 1,4,16,64,128] [--contexts 1024,8192]
        [--heads 32] [--kv-heads 8] [--head-dim 128] [--layers 32] [--json OUT] [--scatter]
        [--triton-tilings SPLITS:PAGES_PER_BLOCK:WARPS[:STAGES],...]   (more columns: the Triton kernel tiled otherwise)
        [--balanced-tilings WAVES:MIN_PAGES:PAGES_PER_BLOCK:WARPS[:STAGES],...]   (more columns: the balanced form)
STAGES: the software-pipelining depth of the kernel's page loop (tiles in flight + 1; `scripts/kernel_registers.py
--stages S` shows what it costs in shared memory and programs an SM).
"""
from __future__ import annotations

import argparse
import json

import torch

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16,64,128")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-kv-gib", type=float, default=40.0, help="skip points whose KV would exceed this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--scatter", action="store_true", help="pages in random order, as a served pool hands them out "
                    "(default: each row's pages in order)")
    ap.add_argument("--triton-tilings", default="", help="extra Triton columns, e.g. 16:4:4,32:2:4,0:2:2:4 (splits, "
                    "pages per block, warps, optionally pipelining stages; splits 0: the kernel's choice for the "
                    "batch)")
    ap.add_argument("--balanced-tilings", default="", help="extra balanced columns, e.g. 2:8:4:4,4:4:4:4:2 (programs "
                    "a plan aims at in SMs' worth, least pages of a cut row's item, pages per block, warps, optionally "
                    "pipelining stages)")
    args = ap.parse_args()
    import flashinfer
    import numpy as np

    from appliance.attention import AttentionMetadata
    from appliance.attention.triton_decode import (BALANCED_MIN_PAGES, BALANCED_PAGES_PER_BLOCK, BALANCED_STAGES,
                                                   BALANCED_WARPS, BALANCED_WAVES, NUM_STAGES, NUM_WARPS,
                                                   PAGES_PER_BLOCK, BalancedTritonDecode, TritonDecode)
    from appliance.bench.ceilings import time_cuda

    dev, dt = torch.device("cuda"), torch.bfloat16
    h, kvh, d, layers = args.heads, args.kv_heads, args.head_dim, args.layers
    copy = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    bw = 2 * copy.numel() / time_cuda(lambda: copy.clone(), iters=10)  # read + write bytes per second
    copy = None
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; {h} heads, {kvh} KV heads, dim {d}")
    variants = {"tensor cores": (True, False), "tensor cores, no KV split": (True, True),
                "CUDA cores": (False, False), "muxd Triton": (0, PAGES_PER_BLOCK, NUM_WARPS, NUM_STAGES),
                "muxd balanced": ("balanced", BALANCED_WAVES, BALANCED_MIN_PAGES, BALANCED_PAGES_PER_BLOCK,
                                  BALANCED_WARPS, BALANCED_STAGES)}
    for tiling in filter(None, args.triton_tilings.split(",")):
        fields = [int(x) for x in tiling.split(":")]
        variants[f"Triton {tiling}"] = (*fields, NUM_STAGES)[:4]
    for tiling in filter(None, args.balanced_tilings.split(",")):
        fields = [int(x) for x in tiling.split(":")]
        variants[f"balanced {tiling}"] = ("balanced", *(*fields, BALANCED_STAGES)[:5])
    rows = []
    print("| batch | context | " + " | ".join(f"{v} us" for v in variants) + " | KV floor us |")
    print("| ---: | ---: |" + " ---: |" * (len(variants) + 1))
    for ctx in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            pages_per = -(-ctx // PAGE)
            pages = batch * pages_per
            kv_bytes = layers * pages * 2 * PAGE * kvh * d * 2
            if kv_bytes > args.max_kv_gib * 2**30:
                continue
            kv = [torch.randn(2, pages, PAGE, kvh, d, dtype=dt, device=dev) for _ in range(layers)]  # as muxd's pool
            q = torch.randn(batch, h, d, dtype=dt, device=dev)
            indptr = torch.arange(0, pages + 1, pages_per, dtype=torch.int32)
            order = torch.randperm if args.scatter else torch.arange
            indices = order(pages, dtype=torch.int32)
            last = torch.full((batch,), ctx - (pages_per - 1) * PAGE, dtype=torch.int32)
            floor_us = kv_bytes / layers / bw * 1e6  # one layer's KV read at the copy's rate (bytes moved per second)
            row = {"batch": batch, "context": ctx, "floor_us": floor_us}
            for name, choice in variants.items():
                if choice[0] == "balanced":  # the balanced form, planned as graphs plan it
                    waves, min_pages, ppb, warps, stages = choice[1:]
                    dec = BalancedTritonDecode(h, kvh, d, batch, pages, dev, waves=waves, min_pages=min_pages,
                                               pages_per_block=ppb, num_warps=warps, num_stages=stages)
                    dec.plan(AttentionMetadata(np.arange(batch + 1, dtype=np.int32), indptr.numpy(), indices.numpy(),
                                               last.numpy(), np.full(batch, ctx, np.int32), PAGE, None))
                    row[name] = _graph_us(time_cuda, lambda: [dec.run(q, layer[0], layer[1]) for layer in kv], layers)
                    continue
                if len(choice) == 4:  # muxd's kernel, planned as its graph backends plan it
                    splits, ppb, warps, stages = choice
                    dec = TritonDecode(h, kvh, d, batch, pages, dev, splits=splits or None, pages_per_block=ppb,
                                       num_warps=warps, num_stages=stages)
                    dec.plan(AttentionMetadata(np.arange(batch + 1, dtype=np.int32), indptr.numpy(), indices.numpy(),
                                               last.numpy(), np.full(batch, ctx, np.int32), PAGE, None))
                    row[name] = _graph_us(time_cuda, lambda: [dec.run(q, layer[0], layer[1]) for layer in kv], layers)
                    continue
                tc, nosplit = choice
                ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                    paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
                    paged_kv_indices_buffer=torch.zeros(pages, dtype=torch.int32, device=dev),
                    paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev))
                try:
                    w.plan(indptr, indices, last, h, kvh, d, PAGE, q_data_type=dt, kv_data_type=dt,
                           disable_split_kv=nosplit)

                    row[name] = _graph_us(time_cuda, lambda: [w.run(q, (layer[0], layer[1])) for layer in kv],
                                          layers)
                except Exception as e:  # a kernel flashinfer cannot build for this shape
                    row[name] = float("nan")
                    row[f"{name} error"] = str(e)[:200]
            rows.append(row)
            print(f"| {batch} | {ctx} | " + " | ".join(f"{row[v]:.1f}" for v in variants) + f" | {floor_us:.1f} |",
                  flush=True)
            kv = None
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "rows": rows}, f, indent=1)


def _graph_us(time_cuda, calls, layers: int) -> float:
    """Microseconds a call: `calls` (one per layer) captured in a CUDA graph and replayed."""
    calls()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    return time_cuda(g.replay, iters=10) / layers * 1e6


if __name__ == "__main__":
    main()
