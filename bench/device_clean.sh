#!/usr/bin/env bash
# On the device machine (the device tool copies the working tree, other agents' unfinished edits included): set up
# the committed tree of HEAD under /tmp/clean with the carried wheels installed, so a benchmark runs what is committed.
#   source bench/device_clean.sh && cd /tmp/clean && <benchmark command>
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:/tmp/clean PYTHONUNBUFFERED=1
rm -rf /tmp/clean && mkdir -p /tmp/clean
if git rev-parse HEAD >/dev/null 2>&1; then
    git archive HEAD | tar -x -C /tmp/clean && echo "device_clean: HEAD $(git rev-parse --short=12 HEAD)"
else
    cp -r . /tmp/clean && echo "device_clean: no git metadata here; the working tree as copied"
fi
cp -r .whl /tmp/clean/ 2>/dev/null
ulimit -n 65536 2>/dev/null || true
