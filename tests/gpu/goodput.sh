#!/usr/bin/env bash
# Goodput side by side on the device: each job replays a trace in process against one policy at the given rates
# (`muxd bench sweep --in-process --rates`), Llama-3.1-8B shapes (MODEL=DIR for another) with dummy weights, judged by
# configs/slo/chat-queue.yaml (SLO=FILE for another) at the contract's own attainment (ATTAINMENT=F for a stricter
# one). Jobs naming the same GPU run in turn, GPUs run in parallel;
# results are packed into $OUT/goodput.tgz (one directory per job) and the tables printed last.
#   bash tests/gpu/goodput.sh GPU:TRACE:POLICY:RATES:REQUESTS[:CHUNK_BUDGET[:FLAGS]] ...
#   e.g. bash tests/gpu/goodput.sh 0:.traces/azure_code_2023.csv:mux:1.6:500 1:.traces/azure_code_2023.csv:chunked:1.0:500:1280
# FLAGS adds `muxd serve` flags to one job, '+' between them (0:chat-short:mux:19:500::--no-temporal-prefill).
# TRACE `chat-short` replays the synthetic short-prompt chat workload instead (`--workload chat-short`); TRACE `random`
# a synthetic mix of INPUT_LEN and OUTPUT_LEN (`muxd bench sweep --input-len` forms, e.g. INPUT_LEN=lognormal:800:1.2
# OUTPUT_LEN=lognormal:200:0.6; Poisson arrivals). The served context is MAX_MODEL_LEN where set, else 8192 for
# chat-short and random and 32768 for a trace (as docs/PERFORMANCE.md measures them), so one call can mix both.
# GPU may name several (0,1) for a job run over tensor parallelism (FLAGS -tp+2).
# PROFILE defaults to the shipped H200 profile (another GPU falls back to the roofline prior, with a warning);
# PROFILE=none serves with no profile (the roofline prior, refitted online);
# SERVE_ARGS adds `muxd serve` flags to every job (e.g. SERVE_ARGS=--mixed-chunks), and to the result names.
# MAX_IDLE=S cuts every wait with no request in flight to S seconds (`muxd bench --max-idle`): serial on Azure at its
# capacity (0.09 req/s) spreads 500 requests over 5,540 s, and with MAX_IDLE=0.2 they replay in 136 s.
# SAVE_STEPS=1 keeps every engine step and prefill launch in the point JSONs (`--save-steps`: calibration data for
# `muxd bench diagnose --from-steps/--from-prefills`; the logging takes some host time).
# SKIP=K starts every job's trace at its request K (`--skip`): slices of one long replay, judged together afterwards
# with `muxd bench pool` (docs/BENCH.md, "Slices of one replay").
# SEED=S passes `--seed S` to every job (the synthetic workload's arrivals, lengths and prompt tokens).
# A replay longer than one device command (Mooncake at mux's capacity: 9 minutes) can outlive the command when started
# in its own session, on a machine kept warm by calls that follow at once (a lent machine is held 30 minutes at most):
#   call 1: OUT=/tmp/gp setsid nohup bash tests/gpu/goodput.sh JOB ... > /tmp/gp.log 2>&1 < /dev/null &
#   call 2, 3, ...: for i in $(seq 55); do [ -e /tmp/gp/done ] && break; sleep 10; done;
#                   cp /tmp/gp/goodput.tgz $OUT/ 2>/dev/null; tail -n 5 /tmp/gp.log
# goodput.tgz is packed again after every job, so each poll brings back every job finished so far.
# Each job's directory holds gpu.txt, the name of the GPU it ran on.
# ($out/done appears once the results are packed and the tables printed; `pgrep -f goodput.sh` would match the polling command itself.)
# Each call must follow the last within the machine's idle release (30 s), or the machine and the replay are gone.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
profile=${PROFILE:-appliance/predictor/profiles/llama-3.1-8b-h200.json}
model=${MODEL:-configs/models/llama-3.1-8b}
slo=${SLO:-configs/slo/chat-queue.yaml}
work=$(mktemp -d)
mkdir -p "$out" && rm -f "$out/done"
run_job() {
    IFS=: read -r gpu trace policy rates n budget flags <<< "$1"
    extra="${SERVE_ARGS:-} ${flags//+/ }"
    extra=$(echo $extra)  # trimmed
    maxlen=${MAX_MODEL_LEN:-32768}
    [ "$trace" = chat-short ] || [ "$trace" = random ] && maxlen=${MAX_MODEL_LEN:-8192}
    mix=""
    [ "$trace" = random ] && mix="-$(echo "${INPUT_LEN:-256}-${OUTPUT_LEN:-64}" | tr ':' '_')"
    name="$(basename "${trace%.*}")$mix-$policy${budget:+$budget}-$rates-$n${SKIP:+-skip$SKIP}${SEED:+-seed$SEED}${extra:+-$(echo "$extra" | tr -d ' -')}"
    # the same job on two GPUs (a repeat) keeps both results
    [ "$(printf '%s\n' "${jobs[@]}" | grep -c "^[0-9,]*:${1#*:}$")" -gt 1 ] && name="$name-gpu$gpu"
    serve="--load-format dummy --slo $slo --max-model-len $maxlen $extra"
    [ "$profile" != none ] && serve="$serve --profile $profile"
    [ -n "${budget:-}" ] && serve="$serve --chunk-budget $budget"
    replay="--trace $trace --max-requests $n"
    case "$trace" in *mooncake*) replay="$replay --spread-ties";; chat-short) replay="--workload chat-short --num-prompts $n";;
        random) replay="--trace-format random --input-len ${INPUT_LEN:-256} --output-len ${OUTPUT_LEN:-64} --num-prompts $n";;
    esac
    CUDA_VISIBLE_DEVICES=$gpu timeout "${JOB_TIMEOUT:-86400}" python3 -m appliance bench sweep --in-process -m "$model" \
        $replay --max-model-len "$maxlen" --policies "$policy" --rates "$rates" \
        --slo "$slo" ${ATTAINMENT:+--attainment "$ATTAINMENT"} --serve-args "$serve" --save-detailed \
        ${MAX_IDLE:+--max-idle "$MAX_IDLE"} ${SKIP:+--skip "$SKIP"} ${SEED:+--seed "$SEED"} ${SAVE_STEPS:+--save-steps} \
        --result-dir "$work/$name" --no-progress > "$work/$name.log" 2>&1
    echo "job $1: exit $?" >> "$work/$name.log"
    # which GPU it ran on (the job's name does not say), beside its results
    mkdir -p "$work/$name" && nvidia-smi --query-gpu=name --format=csv,noheader -i "$gpu" > "$work/$name/gpu.txt" 2>/dev/null || true
}
# the results so far, packed after every job: a machine taken back mid-run keeps what finished (a poll copies it)
pack() {
    local tmp="$out/.goodput.$BASHPID.tgz"
    tar czf "$tmp" -C "$work" . 2>/dev/null  # exit 1 (a file changed while read: another GPU's job) still packs
    if [ -s "$tmp" ]; then mv -f "$tmp" "$out/goodput.tgz"; else rm -f "$tmp"; fi
}
declare -A queues
jobs=("$@")
for job in "$@"; do queues[${job%%:*}]+="$job "; done
delay=0
for gpu in "${!queues[@]}"; do  # staggered: two interpreters starting at once once failed to import their packages
    ( sleep "$delay"; for job in ${queues[$gpu]}; do run_job "$job"; pack; done ) &
    delay=$((delay + 20))
done
wait
pack
for log in "$work"/*.log; do echo "== $(basename "$log")"; grep -E "│|capacity|exit|rror" "$log" | tail -8; done
touch "$out/done"
