"""Decode GEMMs alone, per way of running them: each projection of the decoder (QKV, output, gate/up, down, the LM
head) at several batch sizes, as cuBLAS runs it for the model (`F.linear`, weights stored out x in), with the weights
stored in x out (`x @ w`, another cuBLAS kernel family), and, with `--autotune`, as Inductor's max-autotune picks
among cuBLAS and its Triton templates; with `--reduction`, as Inductor's tuned reduction of the products (the form
it gives a one-row product, here laid out [N, M] so that a program reads each weight row once for all rows; checked
against F.linear first); with `--split-k S,..`, as S fp32 partial products in one batched GEMM (SplitKLinear's form,
whose sum the next kernel does; F.linear's figure includes cuBLASLt's own split-K reduction where it splits). Each
figure is one call, timed as a CUDA graph of `--layers` calls over distinct weights (as a decode graph replays them:
no call finds its weights in L2), against the bytes it must move.

    PYTHONPATH=. python tests/gpu/decode_gemm_bench.py [--batches 1,8,32,64,128] [--layers 32] [--autotune 1,64]
        [--reduction 2,4,8] [--split-k 2,4] [--hidden 4096] [--intermediate 14336] [--heads 32] [--kv-heads 8]
        [--head-dim 128] [--vocab 128256] [--json OUT]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def projections(a: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """(in, out) features of each decode GEMM (Llama-3.1-8B by default)."""
    qkv = (a.heads + 2 * a.kv_heads) * a.head_dim
    return {"qkv": (a.hidden, qkv), "o": (a.heads * a.head_dim, a.hidden), "gate_up": (a.hidden, 2 * a.intermediate),
            "down": (a.intermediate, a.hidden), "lm_head": (a.hidden, a.vocab)}


def graph_ms(call, layers: int) -> float:
    """One call's device time: a CUDA graph of `layers` calls (call(i) for i < layers), replayed."""
    from appliance.bench.ceilings import time_cuda

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):  # warm-up off the graph (cuBLAS workspaces, Triton loads)
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            call(i)
    return time_cuda(graph.replay, iters=20) / layers * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--autotune", default="", help="batches to also time with Inductor's max-autotune (slow)")
    ap.add_argument("--reduction", default="", help="batches to also time as Inductor's tuned reduction (slow)")
    ap.add_argument("--split-k", default="", help="partial products to also time as a batched GEMM (e.g. 2,4)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemm_bench needs a CUDA device")
    from appliance.bench.ceilings import measure_ceilings
    from appliance.model_zoo.layers import partial_products

    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = measure_ceilings().copy_bytes_per_s  # the engine bench's ceiling: read + write of a 2 GiB copy
    batches = [int(b) for b in args.batches.split(",")]
    tuned = {int(b) for b in args.autotune.split(",") if b}
    reduced = {int(b) for b in args.reduction.split(",") if b}
    splits = [int(s) for s in args.split_k.split(",") if s]
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s")
    rows = []
    for name, (k, n) in projections(args).items():
        layers = 2 if name == "lm_head" else args.layers  # one LM head a step; two copies keep it out of L2
        weights = [torch.randn(n, k, dtype=dt, device=dev) / k ** 0.5 for _ in range(layers)]
        transposed = [w.t().contiguous() for w in weights]
        for b in batches:
            x = torch.randn(b, k, dtype=dt, device=dev)
            floor = (n * k + b * k + b * n) * 2 / bw * 1e3
            ms = {"F.linear (out x in)": graph_ms(lambda i: F.linear(x, weights[i]), layers),
                  "x @ w (in x out)": graph_ms(lambda i: x @ transposed[i], layers)}
            if b in tuned:
                torch._dynamo.reset()
                fn = torch.compile(lambda x_, w_: F.linear(x_, w_), mode="max-autotune-no-cudagraphs", dynamic=False)
                ms["max-autotune"] = graph_ms(lambda i: fn(x, weights[i]), layers)
            if b in reduced:
                from torch._inductor import list_mode_options

                torch._dynamo.reset()
                fn = torch.compile(lambda x_, w_: (w_[:, None, :] * x_[None, :, :]).sum(-1).t(), dynamic=False,
                                   options=list_mode_options("max-autotune-no-cudagraphs"))
                torch.testing.assert_close(fn(x, weights[0]), F.linear(x, weights[0]), rtol=2e-2, atol=2e-2)
                ms["inductor reduction"] = graph_ms(lambda i: fn(x, weights[i]), layers)
            for slices in splits:
                if k % slices == 0:
                    torch.testing.assert_close(partial_products(x, weights[0], slices).sum(0),
                                               F.linear(x.float(), weights[0].float()), rtol=2e-2, atol=2e-2)
                    ms[f"{slices} fp32 partials"] = graph_ms(lambda i: partial_products(x, weights[i], slices),
                                                             layers)
            for variant, t in ms.items():
                rows.append({"gemm": name, "in": k, "out": n, "batch": b, "variant": variant, "ms": t,
                             "floor_ms": floor, "ratio": t / floor})
                print(f"{name:8s} {k:6d}x{n:<6d} b={b:<4d} {variant:22s} {t * 1e3:8.1f} us  floor {floor * 1e3:7.1f} us"
                      f"  {t / floor:5.2f}x")
        weights = transposed = None
        torch.cuda.empty_cache()
    step = {}
    for b in batches:  # one decode step's GEMMs per variant: 32 layers of four, plus the LM head
        for variant in {r["variant"] for r in rows if r["batch"] == b}:
            sel = [r for r in rows if r["batch"] == b and r["variant"] == variant]
            if len(sel) == len(projections(args)):
                total = sum(r["ms"] * (1 if r["gemm"] == "lm_head" else args.layers) for r in sel)
                floor = sum(r["floor_ms"] * (1 if r["gemm"] == "lm_head" else args.layers) for r in sel)
                step[f"b={b} {variant}"] = {"ms": total, "floor_ms": floor, "ratio": total / floor}
                print(f"step b={b:<4d} {variant:22s} {total:6.3f} ms  floor {floor:6.3f}  {total / floor:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12, "rows": rows, "step": step},
                      f, indent=1)


if __name__ == "__main__":
    main()
