"""The vectorised batch layout (positions, slots, page indices) against a per-token reference, the incremental page
mirror of the batch builder, and the attention backend choice."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from appliance.attention import page_layout, resolve_backend_name
from appliance.engine.batch import BatchBuilder, span_tokens
from appliance.engine.request import Request, SamplingParams
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig


def reference_layout(spans, pages, page_size):
    positions, slots, indices, indptr, last = [], [], [], [0], []
    for (a, b), p in zip(spans, pages):
        n_pages = -(-b // page_size)
        for pos in range(a, b):
            positions.append(pos)
            slots.append(p[pos // page_size] * page_size + pos % page_size)
        indices += list(p[:n_pages])
        indptr.append(len(indices))
        last.append(b - (n_pages - 1) * page_size)
    return positions, slots, indices, indptr, last


@pytest.mark.parametrize("seed", range(5))
def test_page_layout_matches_per_token_reference(seed):
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 4, 16]))
    spans, pages = [], []
    for _ in range(int(rng.integers(1, 9))):
        a = int(rng.integers(0, 80))
        b = a + int(rng.integers(1, 40))
        spans.append((a, b))
        pages.append(rng.permutation(1000)[: -(-b // page_size) + int(rng.integers(0, 3))].astype(np.int32))
    starts = np.array([a for a, _ in spans], np.int64)
    ends = np.array([b for _, b in spans], np.int64)
    qo, kv_indptr, kv_indices, last, positions, slots = page_layout(starts, ends, pages, page_size)
    ref = reference_layout(spans, pages, page_size)
    assert positions.tolist() == ref[0] and slots.tolist() == ref[1]
    assert kv_indices.tolist() == ref[2] and kv_indptr.tolist() == ref[3] and last.tolist() == ref[4]
    assert qo.tolist() == [0] + np.cumsum([b - a for a, b in spans]).tolist()


def test_batch_builder_follows_page_tables_as_they_grow_and_are_replaced():
    builder = BatchBuilder(page_size=4, device=torch.device("cpu"))
    r = Request("a", list(range(10, 19)), SamplingParams())
    r.page_table.pages = [7, 3, 9]
    assert builder.pages(r).tolist() == [7, 3, 9]
    r.page_table.pages.append(12)  # the pool grows a table in place
    assert builder.pages(r).tolist() == [7, 3, 9, 12]
    r.page_table.pages = [1, 2, 5]  # reallocated after a preemption: a new list
    assert builder.pages(r).tolist() == [1, 2, 5]
    r.output_token_ids += [50, 51]
    batch = builder.build([r], [(9, 11)])
    assert batch.input_ids.tolist() == [50, 51] and batch.positions.tolist() == [9, 10]
    assert batch.metadata.slot_mapping.tolist() == [5 * 4 + 1, 5 * 4 + 2]
    assert span_tokens(r, 7, 10) == [17, 18, 50]
    padded = builder.build([r], [(10, 11)], pad_rows=3, pad_page=99)
    assert padded.input_ids.tolist() == [51, 0, 0, 0]
    assert padded.metadata.slot_mapping.tolist()[1:] == [99 * 4] * 3
    builder.release("a")
    assert not builder._mirrors


def test_backend_choice_is_explicit_about_what_cannot_run():
    cfg = ModelConfig.from_file(Path(__file__).resolve().parents[2] / "configs/models/llama-3.1-8b/config.json")
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cfg, torch.bfloat16, cpu) == "torch"
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_backend_name("flashinfer", cfg, torch.bfloat16, cpu)
    with pytest.raises(ConfigError, match="unknown"):
        resolve_backend_name("triton", cfg, torch.bfloat16, cpu)


def test_a_capture_cut_replaces_attention_inside_the_forward_context():
    """While piecewise graphs capture, the context's cut hook runs in place of attention (engine/prefill_graphs.py):
    it gets the function that attends, the inputs of one row per token and the rest, for either entry point."""
    from appliance.attention import (ForwardContext, TorchAttention, forward_context, paged_attention,
                                     rope_paged_attention)
    from appliance.attention.metadata import AttentionMetadata

    q, k, v = torch.randn(3, 2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    qkv, positions = torch.cat([q, k, v], dim=1).flatten(1), torch.arange(3)
    table = torch.randn(8, 2, 2).repeat(1, 1, 2)
    seen = []

    def cut(attend, rows, *rest):
        seen.append((rows, rest, attend(*rows, *rest)))
        return torch.full((3, 2, 4), 7.0)

    meta = AttentionMetadata(np.array([0, 3], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32),
                             np.array([3], np.int32), np.array([3], np.int32), 16, torch.zeros(3, dtype=torch.long))
    cache = torch.zeros(1, 2, 1, 16, 1, 4)
    with forward_context(ForwardContext(TorchAttention(), meta, cache)):
        expected = paged_attention(q, k, v), rope_paged_attention(qkv, positions, table, 2)
    with forward_context(ForwardContext(TorchAttention(), meta, cache, cut=cut)):
        out = paged_attention(q, k, v), rope_paged_attention(qkv, positions, table, 2)
    assert seen[0][0] == (q, k, v) and seen[0][1] == () and torch.equal(seen[0][2], expected[0])
    assert seen[1][0] == (qkv, positions) and seen[1][1] == (table, 2, None, None, 0.0)
    assert torch.equal(seen[1][2], expected[1])
    assert all(torch.equal(o, torch.full_like(q, 7.0)) for o in out)
    with pytest.raises(RuntimeError, match="outside forward_context"):
        paged_attention(q, k, v)
