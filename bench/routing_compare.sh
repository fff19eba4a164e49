#!/usr/bin/env bash
# The routing benchmark: `radixserve serve --workers 2` under each routing policy, the same W2 (shared prefix)
# and W5 (multi-turn) workloads against each, in one run of this script.
#   bash bench/routing_compare.sh            (results: bench/results/routing_<policy>_<workload>.json)
# Defaults are the CPU run's (bundled model, scaled-down sizes). On GPUs, for example (two workers, one GPU each):
#   RADIXSERVE="python3 -m radixserve" DEVICE=cuda MODEL=random:llama3-8b VOCAB=128256 NUM_PAGES=8192 \
#   W2_SIZES="--num-groups 8 --per-group 16 --prefix-len 2048 --input-len 128 --output-len 128 --rate 8" \
#   W5_SIZES="--num-sessions 16 --turns 4 --prefix-len 1024 --input-len 128 --output-len 128 --rate 2" \
#   NAME_PREFIX=gpu_ bash bench/routing_compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8031}
POLICIES=${POLICIES:-"round_robin least_load cache_aware"}
RADIXSERVE=${RADIXSERVE:-.venv/bin/radixserve}
DEVICE=${DEVICE:-cpu}
MODEL=${MODEL:-bundled}
VOCAB=${VOCAB:-49152}
NUM_PAGES=${NUM_PAGES:-1024}
W2_SIZES=${W2_SIZES:-"--num-groups 4 --per-group 4 --prefix-len 256 --input-len 32 --output-len 16 --rate 2"}
W5_SIZES=${W5_SIZES:-"--num-sessions 4 --turns 4 --prefix-len 256 --input-len 32 --output-len 16 --rate 1"}
NAME_PREFIX=${NAME_PREFIX:-}
for policy in $POLICIES; do
    $RADIXSERVE serve --port "$PORT" --workers 2 --device "$DEVICE" --model "$MODEL" --num-pages "$NUM_PAGES" \
        --routing "$policy" > "/tmp/routing_$policy.log" 2>&1 &
    server=$!
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
        kill -0 "$server" 2>/dev/null || { echo "server for $policy died"; exit 1; }
        sleep 1
    done
    # shellcheck disable=SC2086  # the size lists split into arguments
    $RADIXSERVE bench --base-url "http://127.0.0.1:$PORT" --workload w2 --variant shared $W2_SIZES --seed 11 \
        --vocab-size "$VOCAB" --name "${NAME_PREFIX}routing_${policy}_w2" --no-plots --no-progress
    # shellcheck disable=SC2086
    $RADIXSERVE bench --base-url "http://127.0.0.1:$PORT" --workload w5 $W5_SIZES --seed 12 \
        --vocab-size "$VOCAB" --name "${NAME_PREFIX}routing_${policy}_w5" --no-plots --no-progress
    kill -INT "$server"; wait "$server" || true
done
$RADIXSERVE bench --compare bench/results/"${NAME_PREFIX}"routing_*_w2.json --no-plots
$RADIXSERVE bench --compare bench/results/"${NAME_PREFIX}"routing_*_w5.json --no-plots
