"""L2 prefetch by one-row decode attention (`--l2-prefetch`): which graphs take it, what each layer's attention is
given (a byte view of its own output projection's weights, capped by the L2 size), and how the forward context
hands it to the backend. The kernel's prefetch form is compiled for sm_90 in test_triton_decode.py."""
from __future__ import annotations

import numpy as np
import torch

from appliance.attention import AttentionMetadata, ForwardContext, forward_context, prefetch, set_layer
from appliance.attention.context import rope_paged_attention
from appliance.attention.flashinfer_backend import _prefetching
from appliance.attention.triton_decode import BalancedTritonDecode, TritonDecode
from appliance.config import Config

MIB = 2**20


def test_off_by_default_and_only_one_row_graphs_on_a_capable_gpu_take_it(monkeypatch):
    assert Config.flat().runtime.l2_prefetch is False and Config.flat(l2_prefetch=True).runtime.l2_prefetch is True
    monkeypatch.setattr(prefetch, "_l2_bytes", lambda index: 50 * MIB if index == 0 else 0)  # device 1: pre-Hopper
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setattr(prefetch, "_enabled", False)
    assert not prefetch.active(cuda0, 1)
    prefetch.set_enabled(True)
    assert prefetch.active(cuda0, 1)
    assert not prefetch.active(cuda0, prefetch.MAX_ROWS + 1)
    assert not prefetch.active(cuda1, 1) and not prefetch.active(torch.device("cpu"), 1)


def test_each_layer_gets_the_start_of_its_own_weights_in_bytes(monkeypatch):
    monkeypatch.setattr(prefetch, "_l2_bytes", lambda index: 8 * MIB)
    monkeypatch.setattr(prefetch, "_enabled", True)
    small = torch.zeros(1024, 1024, dtype=torch.bfloat16)   # 2 MiB: all of it
    large = torch.zeros(4096, 1024, dtype=torch.bfloat16)   # 8 MiB: the first 6 (L2_SHARE of 8)
    strided = torch.zeros(1024, 2048, dtype=torch.bfloat16)[:, ::2]
    cuda0 = torch.device("cuda", 0)
    views = prefetch.targets([small, large, strided], cuda0)
    assert [None if v is None else (v.dtype, v.numel()) for v in views] == [
        (torch.uint8, 2 * MIB), (torch.uint8, int(8 * MIB * prefetch.L2_SHARE)), None]
    assert views[0].data_ptr() == small.data_ptr() and views[1].data_ptr() == large.data_ptr()
    assert prefetch.targets([small], cuda0, rows=2) is None
    assert prefetch.launch_args(views[0], small) == ((views[0], 2 * MIB), {"PREFETCH": True})
    (ptr, nbytes), flags = prefetch.launch_args(None, small)
    assert ptr is small and nbytes == 0 and flags == {"PREFETCH": False}


class _Recorder:
    """A backend with a fused rotary path that records the keywords its calls got."""

    name, supports_cuda_graph = "recorder", True

    def __init__(self):
        self.calls = []

    def prepare(self, metadata):
        pass

    def forward_rope(self, qkv, positions, cos_sin, num_heads, kv, metadata, q_norm=None, k_norm=None, eps=0.0,
                     **extra):
        self.calls.append(extra)
        return qkv.new_zeros(qkv.shape[0], num_heads, cos_sin.shape[-1])


def _metadata() -> AttentionMetadata:
    return AttentionMetadata(qo_indptr=np.array([0, 1]), kv_indptr=np.array([0, 1]), kv_indices=np.array([0]),
                             last_page_len=np.array([1]), seq_lens=np.array([1], np.int32), page_size=16,
                             slot_mapping=torch.zeros(1, dtype=torch.long))


def test_the_context_hands_the_layer_its_own_prefetch_and_nothing_without_one():
    heads, dim = 2, 8
    qkv, positions = torch.zeros(1, (heads + 2) * dim), torch.zeros(1, dtype=torch.long)
    cos_sin = torch.zeros(4, 2, dim)
    kv = torch.zeros(3, 2, 1, 16, 1, dim)  # [layers, 2, pages, page_size, Hkv, D]
    targets = [torch.zeros(3, dtype=torch.uint8), None, torch.zeros(5, dtype=torch.uint8)]
    backend = _Recorder()
    with forward_context(ForwardContext(backend, _metadata(), kv, prefetch=targets)):
        for layer in range(3):
            set_layer(layer)
            rope_paged_attention(qkv, positions, cos_sin, heads)
    assert [c.get("prefetch") for c in backend.calls] == targets and backend.calls[1] == {}
    backend.calls.clear()
    with forward_context(ForwardContext(backend, _metadata(), kv)):
        rope_paged_attention(qkv, positions, cos_sin, heads)
    assert backend.calls == [{}]


def test_only_the_split_kernel_is_given_the_prefetch():
    target = torch.zeros(4, dtype=torch.uint8)
    split = TritonDecode(32, 8, 128, 1, 16, torch.device("cpu"))
    balanced = BalancedTritonDecode(32, 8, 128, 16, 64, torch.device("cpu"))
    assert _prefetching(split, target) == {"prefetch": target}
    assert _prefetching(split, None) == {} and _prefetching(balanced, target) == {}
