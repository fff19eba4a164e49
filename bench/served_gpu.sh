#!/usr/bin/env bash
# The served benchmarks on the H200 (through the device tool, with .whl carried): radixserve serve with its
# defaults on random:llama3-8b, driven over HTTP by bench.served_suite; results bundled under $OUT. The suite is
# interrupted after SUITE_TIMEOUT_S (555 s: one device command runs at most 600 s) so the bundle is always written.
#   bash bench/served_gpu.sh NAME PHASES [served_suite args...]
#   e.g. bash bench/served_gpu.sh w1w0 w1,w0,w1-nocache
set -uo pipefail
name=$1 phases=$2
shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ulimit -n 65536 2>/dev/null || true
out=/tmp/$name
timeout --signal=INT "${SUITE_TIMEOUT_S:-555}" python3 -m bench.served_suite --serve-args "--model random:llama3-8b --device cuda" --phases "$phases" \
    --out-dir "$out" "$@" 2>&1 | tee "$out.log"
rc=${PIPESTATUS[0]}
cp "$out.log" "$out/suite.log"
cp "$out/summary.json" "$OUT/${name}_summary.json" 2>/dev/null
tar czf "$OUT/${name}.tgz" -C /tmp "$name"
exit "$rc"
