"""Summarise a diagnose step log: host launch time of mixed and decode steps by size, graphs or not."""
import json, statistics, sys
from collections import defaultdict
steps = json.load(open(sys.argv[1]))
def med(v): return statistics.median(v) if v else float("nan")
mixed = [s for s in steps if s["mixed"] and s.get("host_launch_ms") is not None]
b = defaultdict(list)
for s in mixed:
    t = s["prefill_tokens"]
    key = ("<=512" if t <= 512 else "<=1024" if t <= 1024 else "<=2048" if t <= 2048 else "<=4096" if t <= 4096 else ">4096",
           s.get("prefill_graphs"))
    b[key].append(s)
print("mixed steps:", len(mixed))
for k in sorted(b, key=str):
    v = b[k]
    print(f"  tokens {k[0]:>6} graphs {k[1]!s:5}: {len(v):4d} steps, host launch median {med([s['host_launch_ms'] for s in v]):.2f} ms, "
          f"cpu {med([s['host_cpu_ms'] for s in v]):.2f}, device {med([s['device_ms'] for s in v if s.get('device_ms')]):.2f}, decode rows {med([s['decode'] for s in v]):.0f}")
dec = [s for s in steps if s["decode"] and not s["mixed"] and s.get("host_launch_ms") is not None]
b = defaultdict(list)
for s in dec:
    n = s["decode"]
    b[1 if n < 8 else 8 if n < 32 else 32 if n < 128 else 128].append(s)
for k in sorted(b):
    v = b[k]
    print(f"  decode batch {k:>3}+: {len(v):4d} steps, host launch median {med([s['host_launch_ms'] for s in v]):.3f} ms, "
          f"gap {med([s['gap_ms'] for s in v if s.get('gap_ms') is not None]):.3f}, plan {med([s['plan_ms'] for s in v]):.3f}, "
          f"device {med([s['device_ms'] for s in v if s.get('device_ms')]):.3f}, wall {med([s['launch_ms'] for s in v if s.get('launch_ms')]):.3f}")
