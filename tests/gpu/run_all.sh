#!/usr/bin/env bash
# Runs the GPU tests and the engine benchmark on a CUDA machine, one call; prints a short table last.
#   bash tests/gpu/run_all.sh [--quick] [--proof TRACE]   (from the repository root; results under $OUT or ./gpu-results)
# --proof also profiles the 8B shapes on this GPU (`muxd profile`, PROFILE_MINUTES=7, ranges from TRACE) into $out;
# with CALIBRATE_RATE (and CALIBRATE_TRACE, CALIBRATE_REQUESTS=100) it also measures the serving factors and the split
# slowdown: two replays (chunked, then mux), e.g. 1.4 req/s on azure_code_2023.csv, about 3.5 minutes of the budget.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export MUXD_CACHE_DIR=${MUXD_CACHE_DIR:-$(mktemp -d)}  # a cold compile cache: the first start below is cold
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
# GPU_TESTS: the test files to run (default: all of tests/gpu; a cold run of all of them takes about 24 minutes on an
# H200). Each test's outcome is written as it ends (-v), so a run cut short still names what passed and what failed.
python3 -m pytest -v -p no:cacheprovider -rfEs --durations=10 --junitxml "$out/gpu-tests.xml" ${GPU_TESTS:-tests/gpu} \
    2>&1 | tee "$out/gpu-tests.log"
tests=${PIPESTATUS[0]}
bench_args=()
[ "${1:-}" = "--quick" ] && bench_args=(--batches 1,64 --contexts 1024 --prefill 2048,8192 --iters 10)
python3 -m appliance bench engine "${bench_args[@]}" --compare-sync --kernels 1@1024,64@1024 --json "$out/engine-bench.json" \
    --markdown "$out/engine-bench.md" 2>&1 | tee "$out/engine-bench.log"
bench=${PIPESTATUS[0]}
python3 -m appliance bench engine --startup-only --json "$out/startup-warm.json" > "$out/startup-warm.log" 2>&1
python3 -m appliance bench engine --multiplex --batches 64 --contexts 1024 --prefill 8192 --iters 30 \
    --json "$out/multiplex.json" --markdown "$out/multiplex.md" > "$out/multiplex.log" 2>&1
mux=$?
PYTHONPATH=.:${PYTHONPATH:-} python3 tests/gpu/prefill_graphs_bench.py --json "$out/prefill-graphs.json" > "$out/prefill-graphs.md" 2>"$out/prefill-graphs.log"
pgraphs=$?
PYTHONPATH=.:${PYTHONPATH:-} python3 tests/gpu/constrained_decoding_bench.py --json "$out/constrained.json" > "$out/constrained.md" \
    2>"$out/constrained.log"
constrained=$?
PYTHONPATH=.:${PYTHONPATH:-} python3 tests/gpu/decode_attention_bench.py --json "$out/decode-attention.json" \
    > "$out/decode-attention.md" 2>"$out/decode-attention.log"
attention=$?
PYTHONPATH=.:${PYTHONPATH:-} python3 tests/gpu/decode_gemm_bench.py --json "$out/decode-gemm.json" \
    > "$out/decode-gemm.md" 2>"$out/decode-gemm.log"
gemm=$?
proof="skipped"
if [ "${1:-}" = "--proof" ] || [ "${2:-}" = "--proof" ]; then
    trace=${@: -1}
    calibrate=()  # CALIBRATE_RATE=R [CALIBRATE_TRACE=FILE]: measure the serving factors too (its time is in the budget)
    [ -n "${CALIBRATE_RATE:-}" ] && calibrate=(--calibrate-rate "$CALIBRATE_RATE" \
        --calibrate-requests "${CALIBRATE_REQUESTS:-100}" \
        --calibrate-trace "${CALIBRATE_TRACE:-$trace}")
    python3 -m appliance profile -m configs/models/llama-3.1-8b --load-format dummy --out "$out/profile.json" \
        --trace "$trace" --budget-minutes "${PROFILE_MINUTES:-7}" --max-model-len 32768 --no-progress \
        ${calibrate[@]+"${calibrate[@]}"} > "$out/profile.log" 2>&1
    proof="exit $? ($(tail -n 1 "$out/profile.log"))"
fi
echo
echo "| suite | result |"
echo "| --- | --- |"
echo "| tests/gpu | $(tail -n 1 "$out/gpu-tests.log") |"
echo "| bench engine | exit $bench |"
echo "| warm start | $(grep -o 'start-up: .*' "$out/startup-warm.log") |"
echo "| bench engine --multiplex | exit $mux |"
echo "| prefill graphs bench | exit $pgraphs |"
echo "| constrained decoding bench | exit $constrained |"
echo "| decode attention bench | exit $attention |"
echo "| decode GEMM bench | exit $gemm |"
echo "| muxd profile | $proof |"
echo
cat "$out/multiplex.md" 2>/dev/null
echo
cat "$out/prefill-graphs.md" 2>/dev/null
echo
cat "$out/constrained.md" 2>/dev/null
echo
cat "$out/decode-attention.md" 2>/dev/null
echo
cat "$out/engine-bench.md" 2>/dev/null
[ "$tests" = 0 ] && [ "$bench" = 0 ] && [ "$mux" = 0 ]
