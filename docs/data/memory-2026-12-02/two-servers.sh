#!/usr/bin/env bash
# run from the repository root with PYTHONPATH=.: mem.py (the idle releases, KV pages), then two servers at 0.45 on one GPU
OUT=${OUT:-.}
timeout 260 python3 docs/data/memory-2026-12-02/mem.py configs/models/llama-3.1-8b > $OUT/mem.txt 2>&1; echo "rc=$?" >> $OUT/mem.txt
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> $OUT/mem.txt
M=configs/models/llama-3.1-8b
wait_ready() { for i in $(seq 1 150); do curl -sf localhost:$1/ready >/dev/null && return 0; sleep 1; done; return 1; }
python3 -m appliance serve $M --load-format dummy --gpu-memory-utilization 0.45 --max-model-len 8192 --port 8001 > $OUT/a.log 2>&1 &
A=$!
wait_ready 8001; echo "A ready rc=$?" >> $OUT/two.txt
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> $OUT/two.txt
python3 -m appliance serve $M --load-format dummy --gpu-memory-utilization 0.45 --max-model-len 8192 --port 8002 > $OUT/b.log 2>&1 &
B=$!
wait_ready 8002; echo "B ready rc=$?" >> $OUT/two.txt
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> $OUT/two.txt
for p in 8001 8002; do
  curl -s localhost:$p/v1/completions -H 'Content-Type: application/json' \
    -d '{"model":"llama-3.1-8b","prompt":"Hello there","max_tokens":8}' >> $OUT/two.txt; echo >> $OUT/two.txt
done
kill -TERM $A $B; wait
grep -h "KV cache\|concurrency\|budget\|memory" $OUT/a.log $OUT/b.log >> $OUT/two.txt
