"""flashinfer attention against an fp32 reference on fresh random inputs: prefill with and without a cached prefix,
decode, and GQA group sizes 1, 4, 7 and 8 (bf16, head_dim 128, page 16, pages in random order)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from appliance.attention import TorchAttention, page_layout
from appliance.attention.flashinfer_backend import FlashInferAttention
from appliance.attention.metadata import AttentionMetadata

PAGE, DIM = 16, 128
CASES = {  # (cached prefix, new tokens) per sequence
    "prefill": [(0, 37), (0, 5), (0, 128), (0, 1)],
    "prefill_prefix": [(40, 37), (100, 5), (16, 64), (300, 1)],
    "decode": [(0, 1), (299, 1), (76, 1), (1023, 1), (15, 1)],
}


def random_pages(ends: np.ndarray, num_pages: int, gen: torch.Generator) -> list[np.ndarray]:
    """Each sequence's pages, drawn without repeats from the pool in random order."""
    order = torch.randperm(num_pages, generator=gen).numpy().astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum(-(-ends // PAGE))])
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def layout(case: str, num_pages: int, gen: torch.Generator) -> AttentionMetadata:
    seqs = CASES[case]
    starts = np.array([c for c, _ in seqs], np.int64)
    ends = np.array([c + n for c, n in seqs], np.int64)
    qo, kv_indptr, kv_indices, last, _, slots = page_layout(starts, ends, random_pages(ends, num_pages, gen), PAGE)
    return AttentionMetadata(qo, kv_indptr, kv_indices, last, ends.astype(np.int32), PAGE,
                             torch.from_numpy(slots).cuda())


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 8), (28, 4), (64, 8)])
def test_flashinfer_matches_fp32_reference(case, heads, kv_heads):
    gen = torch.Generator().manual_seed(hash((case, heads)) % 2**31)
    num_pages = 256
    meta = layout(case, num_pages, gen)
    t = meta.num_tokens
    cache = torch.randn(2, num_pages + 1, PAGE, kv_heads, DIM, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(t, heads, DIM, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(t, kv_heads, DIM, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(t, kv_heads, DIM, generator=gen).to("cuda", torch.bfloat16)

    ref_cache = cache.float()
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta)
    fi = FlashInferAttention(SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=DIM),
                             torch.bfloat16, torch.device("cuda"))
    fi_cache = cache.clone()
    out = torch.full_like(q, float("nan"))
    fi.prepare(meta)
    out.copy_(fi.forward(q, k, v, fi_cache, meta))
    assert not out.isnan().any()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= 1e-2, f"{case} H={heads} Hkv={kv_heads}: relative error {err:.2e}"
    written = meta.slot_mapping
    assert torch.equal(fi_cache[0].flatten(0, 1)[written], k)  # K/V landed in their slots
    assert torch.equal(fi_cache[1].flatten(0, 1)[written], v)


@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (28, 4)])
def test_cuda_graph_decode_wrapper_matches_eager(heads, kv_heads):
    """The fixed-buffer (CUDA-graph) decode wrapper, captured once and replayed on a new batch, equals eager."""
    gen = torch.Generator().manual_seed(7)
    cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=DIM)
    num_pages = 256
    cache = torch.randn(2, num_pages + 1, PAGE, kv_heads, DIM, generator=gen).to("cuda", torch.bfloat16)
    meta = layout("decode", num_pages, gen)
    bs = meta.num_seqs
    graph_fi = FlashInferAttention(cfg, torch.bfloat16, torch.device("cuda"), graph_batch_size=bs,
                                   max_pages=num_pages + 1)
    q = torch.zeros(bs, heads, DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(bs, kv_heads, DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    slots = meta.slot_mapping.clone()
    static = AttentionMetadata(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.last_page_len, meta.seq_lens,
                               PAGE, slots)
    graph_fi.prepare(static)
    out = graph_fi.forward(q, k, v, cache, static)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graph_fi.forward(q, k, v, cache, static)
    meta2 = layout("decode", num_pages, torch.Generator().manual_seed(8))  # other pages, same batch size
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t))
    slots.copy_(meta2.slot_mapping)
    graph_fi.prepare(AttentionMetadata(meta2.qo_indptr, meta2.kv_indptr, meta2.kv_indices, meta2.last_page_len,
                                       meta2.seq_lens, PAGE, slots))
    graph.replay()
    eager = FlashInferAttention(cfg, torch.bfloat16, torch.device("cuda"))
    eager.prepare(meta2)
    expected = eager.forward(q, k, v, cache.clone(), meta2)
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() < 1e-3


@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (28, 4), (8, 8), (64, 8)])
@pytest.mark.parametrize("rows", [1, 5, 8, 24, 64, 128])
def test_triton_graph_decode_matches_flashinfer(heads, kv_heads, rows):
    """muxd's Triton decode (graph batches; beyond 8 rows the balanced form), captured once on padding rows and
    replayed twice on batches of 1 to 8,200 tokens a row, equals flashinfer's eager decode."""
    gen = torch.Generator().manual_seed(rows * 100 + heads)
    cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=DIM)
    num_pages = 16 * 520 + rows * 70
    cache = torch.randn(2, num_pages + 1, PAGE, kv_heads, DIM, generator=gen).to("cuda", torch.bfloat16)
    triton_fi = FlashInferAttention(cfg, torch.bfloat16, torch.device("cuda"), graph_batch_size=rows,
                                    max_pages=num_pages + 1, triton_decode=True)
    q = torch.zeros(rows, heads, DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(rows, kv_heads, DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    slots = torch.full((rows,), num_pages * PAGE, dtype=torch.long, device="cuda")  # the last page: scratch
    one = np.ones(rows, np.int64)
    qo, kv_indptr, kv_indices, last, _, _ = page_layout(0 * one, one, [np.array([num_pages], np.int32)] * rows, PAGE)
    static = AttentionMetadata(qo, kv_indptr, kv_indices, last, one.astype(np.int32), PAGE, slots)
    triton_fi.prepare(static)
    out = triton_fi.forward(q, k, v, cache, static)  # warm-up (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fi.forward(q, k, v, cache, static)
    long_rows = min(rows, 16)  # the others' lengths up to 1,100 (more rows than the pool holds long ones)
    mixed = torch.cat([torch.randint(1, 8200, (long_rows,), generator=gen),
                       torch.randint(1, 1100, (rows - long_rows,), generator=gen)])
    for lens in ([1] * rows, mixed[torch.randperm(rows, generator=gen)].tolist()):
        ends = np.array(lens, np.int64)
        qo2, indptr2, indices2, last2, _, slots2 = page_layout(ends - 1, ends, random_pages(ends, num_pages, gen),
                                                               PAGE)
        meta = AttentionMetadata(qo2, indptr2, indices2, last2, ends.astype(np.int32), PAGE, slots)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen).to(t))
        slots.copy_(torch.from_numpy(slots2))
        expected_cache = cache.clone()
        triton_fi.prepare(meta)
        graph.replay()
        first = out.clone()
        graph.replay()  # again: the balanced form's counters were left at zero
        assert torch.equal(out, first)
        eager = FlashInferAttention(cfg, torch.bfloat16, torch.device("cuda"))
        eager.prepare(meta)
        expected = eager.forward(q, k, v, expected_cache, meta)
        assert torch.equal(cache, expected_cache)  # the same K/V written
        err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        assert err < 1e-2, f"rows {rows} H={heads} Hkv={kv_heads} lens {lens}: relative error {err:.2e}"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (28, 4), (8, 8)])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_in_attention_matches_rotated_inputs(case, heads, kv_heads, norm):
    """forward_rope (one kernel rotates q and k by a llama-3 table and writes K/V, then attention; with `norm`, each
    head RMS-normalised first, as Qwen3's q/k norms) against forward of q, k, v normalised and rotated in fp32: the
    output, and K/V in their slots."""
    from appliance.attention.kv_write import apply_rope
    from appliance.model_zoo.config import RopeConfig
    from appliance.model_zoo.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(hash((case, heads, norm, "rope")) % 2**31)
    num_pages = 256
    meta = layout(case, num_pages, gen)
    t = meta.num_tokens
    rotary = RotaryEmbedding(DIM, RopeConfig(type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position=8192))
    assert rotary.build_table(2048, torch.bfloat16, torch.device("cuda"))
    width = (heads + 2 * kv_heads) * DIM
    qkv = torch.randn(t, width + 64, generator=gen).to("cuda", torch.bfloat16)[:, :width]  # strided rows
    positions = torch.from_numpy(np.concatenate([np.arange(e - n, e) for e, n in zip(
        meta.seq_lens, meta.query_lens)])).long().cuda()
    cache = torch.randn(2, num_pages + 1, PAGE, kv_heads, DIM, generator=gen).to("cuda", torch.bfloat16)
    fi = FlashInferAttention(SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=DIM),
                             torch.bfloat16, torch.device("cuda"))
    fi.prepare(meta)
    weights = tuple(torch.rand(DIM, generator=gen).cuda() + 0.5 for _ in range(2 * norm))
    q, k, v = apply_rope(qkv.float(), positions, rotary.cos_sin.float(), heads, *weights, *(1e-6,) * norm)
    expected_cache = cache.clone()
    expected = fi.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), expected_cache, meta)
    norms = tuple(w.to("cuda", torch.bfloat16) for w in weights) + (1e-6,) * norm
    out = fi.forward_rope(qkv, positions, rotary.cos_sin, heads, cache, meta, *norms)
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err <= 1e-2, f"{case} H={heads} Hkv={kv_heads}: relative error {err:.2e}"
    written = meta.slot_mapping
    for i in range(2):
        got, want = cache[i].flatten(0, 1)[written].float(), expected_cache[i].flatten(0, 1)[written].float()
        assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
