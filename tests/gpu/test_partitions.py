"""Green-context SM partitions: each split's decode and prefill streams run on disjoint SM sets of the granted sizes;
the full partition's streams use every SM; decode graphs captured on a partition keep its SM limit."""
from __future__ import annotations

import pytest
import torch

from appliance.engine.partitions import PartitionError, PartitionSet

pytest.importorskip("triton")  # the SM probe is a Triton kernel (the GPU machine has it; CPU installs do not)
from smid import _smid_kernel, sms_used  # noqa: E402


@pytest.fixture(scope="module")
def partitions():
    return PartitionSet.create(0, granularity=16)


def test_every_split_is_disjoint_and_of_the_granted_size(partitions):
    assert partitions.total_sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert [p.decode_sms for p in partitions.splits] == list(range(16, partitions.total_sms - 15, 16))
    for p in partitions.splits:
        decode, prefill = sms_used(p.decode_stream), sms_used(p.prefill_stream)
        assert len(decode) == p.decode_sms, p
        assert len(prefill) == p.prefill_sms, p
        assert not decode & prefill, p
        assert p.decode_sms + p.prefill_sms == partitions.total_sms
    full = partitions.full
    assert len(sms_used(full.decode_stream)) == partitions.total_sms
    assert len(sms_used(full.prefill_stream)) == partitions.total_sms


def test_a_graph_captured_on_a_partition_keeps_its_sms(partitions):
    p = partitions.for_decode(32)
    out = torch.full((1 << 16,), -1, dtype=torch.int32, device="cuda")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=p.decode_stream):
        _smid_kernel[(out.numel(),)](out)
    graph.replay()  # replayed on the (all-SM) current stream
    torch.cuda.synchronize()
    assert len(set(out.unique().tolist())) == p.decode_sms == 32


def test_bad_granularity_is_refused():
    with pytest.raises(PartitionError, match="multiple of 8"):
        PartitionSet.create(0, granularity=12)
