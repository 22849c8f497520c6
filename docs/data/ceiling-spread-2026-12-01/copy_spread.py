import sys, time
sys.path.insert(0, ".")
import torch
from appliance.bench.ceilings import _time_copy, measure_ceilings
vals = []
for i in range(12):
    s = _time_copy(2 << 30)
    vals.append(2 * (2 << 30) / s / 1e12)
    torch.cuda.empty_cache()
print("fresh allocations:", " ".join(f"{v:.3f}" for v in vals))
src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda"); dst = torch.empty_like(src)
from appliance.bench.ceilings import time_cuda
same = [2 * src.numel() * 2 / time_cuda(lambda: dst.copy_(src)) / 1e12 for _ in range(8)]
print("same buffers:", " ".join(f"{v:.3f}" for v in same))
big = [2 * (8 << 30) / _time_copy(8 << 30) / 1e12 for _ in range(3)]
print("8 GiB:", " ".join(f"{v:.3f}" for v in big))
