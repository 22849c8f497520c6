"""Balanced Triton decode: waves sweep against flashinfer tensor cores, one layer's time from 32 layers in a graph."""
import sys
import numpy as np
import torch
import flashinfer
sys.path.insert(0, "tests/gpu")
from decode_attention_bench import _graph_us, PAGE
from appliance.attention import AttentionMetadata
from appliance.attention import triton_decode as td
from appliance.bench.ceilings import time_cuda

dev, dt = torch.device("cuda"), torch.bfloat16
h, kvh, d, layers = 32, 8, 128, 32
waves = [2, 4, 8, 16]
print("| batch | ctx | FI tc | " + " | ".join(f"W{w}" for w in waves) + " |")
for ctx, batches in ((1024, (16, 32, 64, 128, 256)), (4096, (16, 32, 64)), (8192, (16, 32))):
    for batch in batches:
        pages_per = -(-ctx // PAGE)
        pages = batch * pages_per
        kv = [torch.randn(2, pages, PAGE, kvh, d, dtype=dt, device=dev) for _ in range(layers)]
        q = torch.randn(batch, h, d, dtype=dt, device=dev)
        indptr = torch.arange(0, pages + 1, pages_per, dtype=torch.int32)
        indices = torch.randperm(pages, dtype=torch.int32)
        last = torch.full((batch,), ctx - (pages_per - 1) * PAGE, dtype=torch.int32)
        ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(pages, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev))
        w.plan(indptr, indices, last, h, kvh, d, PAGE, q_data_type=dt, kv_data_type=dt)
        res = [_graph_us(time_cuda, lambda: [w.run(q, (l[0], l[1])) for l in kv], layers)]
        m = AttentionMetadata(np.arange(batch + 1, dtype=np.int32), indptr.numpy(), indices.numpy(), last.numpy(),
                              np.full(batch, ctx, np.int32), PAGE, None)
        for wv in waves:
            td.BALANCED_WAVES = wv
            dec = td.BalancedTritonDecode(h, kvh, d, batch, pages, dev)
            dec.plan(m)
            res.append(_graph_us(time_cuda, lambda: [dec.run(q, l[0], l[1]) for l in kv], layers))
        print(f"| {batch} | {ctx} | " + " | ".join(f"{r:.1f}" for r in res) + " |", flush=True)
        kv = None
        torch.cuda.empty_cache()
