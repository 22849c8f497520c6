"""The reference backend's decode rows attended in groups on the CPU (one SDPA for the rows of the same padded page
count, padded and masked) equal one SDPA a sequence, beside prefill chunks in the same batch, with grouped-query
heads; a row's result does not depend on what else the batch holds, and slots never written (NaN) stay out."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from appliance.attention import AttentionMetadata, TorchAttention, page_layout
from appliance.attention.kv_write import write_kv
from appliance.attention.torch_backend import _groups

PAGE, HKV, H, D, PAGES = 4, 2, 8, 16, 400


def batch(ends: np.ndarray, q_lens: np.ndarray, pages: list[np.ndarray]) -> AttentionMetadata:
    qo, kv_indptr, kv_indices, last, _, slots = page_layout(ends - q_lens, ends, pages, PAGE)
    return AttentionMetadata(qo, kv_indptr, kv_indices, last, ends.astype(np.int32), PAGE, torch.from_numpy(slots))


def one_sdpa_a_sequence(q, cache, pages, starts, ends) -> torch.Tensor:
    out, row = torch.empty_like(q), 0
    for p, start, end in zip(pages, starts.tolist(), ends.tolist()):
        n = end - start
        keys, values = (cache[j][torch.from_numpy(p).long()].flatten(0, 1)[:end] for j in (0, 1))
        mask = torch.arange(end).unsqueeze(0) <= torch.arange(n).unsqueeze(1) + start
        out[row:row + n] = F.scaled_dot_product_attention(
            q[row:row + n].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True).squeeze(0).transpose(0, 1)
        row += n
    return out


@pytest.mark.parametrize("seed", range(4))
def test_grouped_decode_rows_equal_one_sdpa_a_sequence(seed):
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    ends = np.concatenate([rng.integers(1, 12, 6), rng.integers(40, 300, 6), [1, 7]]).astype(np.int64)
    q_lens = np.where(rng.random(len(ends)) < 0.7, 1, np.minimum(ends, rng.integers(2, 9, len(ends))))
    order = rng.permutation(PAGES)
    counts = (ends + PAGE - 1) // PAGE
    pages = [order[a:b].astype(np.int32) for a, b in zip(np.cumsum(counts) - counts, np.cumsum(counts))]
    meta = batch(ends, q_lens, pages)
    tokens = int(meta.qo_indptr[-1])
    q, k, v = (torch.randn(tokens, h, D, generator=gen) for h in (H, HKV, HKV))
    cache = torch.full((2, PAGES, PAGE, HKV, D), float("nan"))  # what no sequence wrote is NaN
    for p, end in zip(pages, ends.tolist()):  # the sequences' K/V before this step
        slots = torch.from_numpy((p[:, None] * PAGE + np.arange(PAGE)).reshape(-1)[:end].astype(np.int64))
        cache.view(2, PAGES * PAGE, HKV, D)[:, slots] = torch.randn(2, end, HKV, D, generator=gen)
    written = cache.clone()
    write_kv(k, v, written, meta.slot_mapping)
    expected = one_sdpa_a_sequence(q, written, pages, ends - q_lens, ends)
    got = TorchAttention().forward(q, k, v, cache.clone(), meta)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    decode = np.flatnonzero(q_lens == 1)
    groups = _groups(decode, meta.kv_indptr)
    assert len(groups) > 1 and sorted(np.concatenate([g for g, _ in groups]).tolist()) == decode.tolist()
    # each decode row alongside one other decode row: the same bits as in the whole batch
    for i in decode.tolist():
        j = decode[decode != i][0]
        pair = batch(ends[[i, j]], q_lens[[i, j]], [pages[i], pages[j]])
        rows = [int(meta.qo_indptr[i]), int(meta.qo_indptr[j])]
        alone = TorchAttention().forward(q[rows], k[rows], v[rows], cache.clone(), pair)
        assert torch.equal(alone[0], got[rows[0]]), i
