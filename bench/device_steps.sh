#!/usr/bin/env bash
# On the device machine: run several benchmark or test steps in one device call, each under its own time limit, each
# step's output kept under $OUT/steps/NAME.log (and its rc in NAME.rc) even when a later step fails or the call runs
# out of time. Run after `source bench/device_clean.sh && cd /tmp/clean`.
#   bash bench/device_steps.sh BUDGET_S "NAME|LIMIT_S|COMMAND" ...
# A step starts only if its limit fits in what is left of BUDGET_S; otherwise it is recorded as skipped.
set -u
budget=$1
shift
start=$(date +%s)
mkdir -p "$OUT/steps"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/steps/gpu.txt" 2>&1
for step in "$@"; do
    name=${step%%|*}
    rest=${step#*|}
    limit=${rest%%|*}
    cmd=${rest#*|}
    left=$((budget - ($(date +%s) - start)))
    if [ "$limit" -gt "$left" ]; then
        echo "skipped: needs ${limit} s, ${left} s left" > "$OUT/steps/$name.log"
        echo "step $name: skipped (${left} s left)"
        continue
    fi
    t0=$(date +%s)
    timeout --signal=INT --kill-after=10 "$limit" bash -c "$cmd" > "$OUT/steps/$name.log" 2>&1
    rc=$?
    echo "$rc" > "$OUT/steps/$name.rc"
    echo "step $name: rc=$rc in $(($(date +%s) - t0)) s"
    tail -n 6 "$OUT/steps/$name.log" | cut -c1-300
done
