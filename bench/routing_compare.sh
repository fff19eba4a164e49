#!/usr/bin/env bash
# Issue 4's routing benchmark on the CPU: `radixserve serve --workers 2` under each routing policy, the same
# W2 (shared prefix) and W5 (multi-turn) workloads against each, in one run of this script.
#   bash bench/routing_compare.sh            (results: bench/results/routing_<policy>_<workload>.json)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8031}
POLICIES=${POLICIES:-"round_robin least_load cache_aware"}
for policy in $POLICIES; do
    .venv/bin/radixserve serve --port "$PORT" --workers 2 --device cpu --num-pages 1024 --routing "$policy" \
        > "/tmp/routing_$policy.log" 2>&1 &
    server=$!
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
        kill -0 "$server" 2>/dev/null || { echo "server for $policy died"; exit 1; }
        sleep 1
    done
    .venv/bin/radixserve bench --base-url "http://127.0.0.1:$PORT" --workload w2 --variant shared \
        --num-groups 4 --per-group 4 --prefix-len 256 --input-len 32 --output-len 16 --rate 2 --seed 11 \
        --vocab-size 49152 --name "routing_${policy}_w2" --no-plots --no-progress
    .venv/bin/radixserve bench --base-url "http://127.0.0.1:$PORT" --workload w5 --num-sessions 4 --turns 4 \
        --prefix-len 256 --input-len 32 --output-len 16 --rate 1 --seed 12 --vocab-size 49152 \
        --name "routing_${policy}_w5" --no-plots --no-progress
    kill -INT "$server"; wait "$server" || true
done
.venv/bin/radixserve bench --compare bench/results/routing_*_w2.json --no-plots
.venv/bin/radixserve bench --compare bench/results/routing_*_w5.json --no-plots
