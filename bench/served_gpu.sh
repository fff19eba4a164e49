#!/usr/bin/env bash
# The served benchmarks on the H200 (through the device tool, with .whl carried): radixserve serve with its
# defaults on random:llama3-8b, driven over HTTP by bench.served_suite; results bundled under $OUT. The suite is
# interrupted after SUITE_TIMEOUT_S (555 s: one device command runs at most 600 s) so the bundle is always written.
#   bash bench/served_gpu.sh NAME PHASES [served_suite args...]
#   e.g. bash bench/served_gpu.sh w1w0 w1,w0,w1-nocache
#
# A run longer than one command (W6 for 10 minutes): start it detached in one call, collect it in the next. The
# detached suite is its own process session, so it outlives the command that started it (the device machine keeps
# such processes until it goes back, and it stays held while the next call follows within its idle window):
#   SUITE_TIMEOUT_S=1500 bash bench/served_gpu.sh --detach w6long w6 --w6-duration-s 600 --w6-concurrency 512
#   bash bench/served_gpu.sh --collect w6long 590      (waits up to 590 s for it to end, then bundles under $OUT)
# --detach itself waits DETACH_WAIT_S (default 560) before returning, printing the suite's progress.
set -uo pipefail

bundle() {  # NAME: the suite's output directory and log, bundled under $OUT
    cp "/tmp/$1.log" "/tmp/$1/suite.log" 2>/dev/null
    cp "/tmp/$1/summary.json" "$OUT/${1}_summary.json" 2>/dev/null
    tar czf "$OUT/${1}.tgz" -C /tmp "$1"
}

if [ "${1:-}" = "--collect" ]; then
    name=$2 wait_s=${3:-560}
    for _ in $(seq "$wait_s"); do
        [ -f "/tmp/$name.rc" ] && break
        sleep 1
    done
    tail -n 20 "/tmp/$name.log"
    bundle "$name"
    [ -f "/tmp/$name.rc" ] || { echo "served_gpu: $name still running after ${wait_s} s; bundled what it has"; exit 124; }
    exit "$(cat "/tmp/$name.rc")"
fi

detach=0
if [ "${1:-}" = "--detach" ]; then
    detach=1
    shift
fi
name=$1 phases=$2
shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ulimit -n 65536 2>/dev/null || true
out=/tmp/$name
rm -f "/tmp/$name.rc"
run_suite() {
    timeout --signal=INT "${SUITE_TIMEOUT_S:-555}" python3 -m bench.served_suite \
        --serve-args "--model random:llama3-8b --device cuda" --phases "$phases" --out-dir "$out" "$@" \
        > "$out.log" 2>&1
    echo $? > "$out.rc"
}
if [ "$detach" = 1 ]; then
    export -f run_suite
    export phases out
    setsid bash -c 'run_suite "$@"' run_suite "$@" < /dev/null > /dev/null 2>&1 &
    echo "served_gpu: $name detached (log $out.log); collect with: bash bench/served_gpu.sh --collect $name"
    for _ in $(seq "${DETACH_WAIT_S:-560}"); do
        [ -f "$out.rc" ] && break
        sleep 1
    done
    tail -n 20 "$out.log"
    bundle "$name"
    exit 0
fi
run_suite "$@" &
tail -F --pid=$! "$out.log" 2>/dev/null  # the suite's output as it comes
wait
bundle "$name"
exit "$(cat "$out.rc")"
