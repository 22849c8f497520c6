"""The step log's allocator counts on CUDA."""
from __future__ import annotations

import torch

from appliance.engine.steplog import ALLOCATOR_COUNTS, _allocations


def test_allocator_counts_read_the_same_figures_as_torchs_flattened_statistics():
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # at least one allocation from the driver
    counts = _allocations()
    flat = torch.cuda.memory_stats()
    assert counts == {name: int(flat.get(key, 0)) for name, key in ALLOCATOR_COUNTS.items()}
    assert counts["device_allocs"] >= 1
    del block
