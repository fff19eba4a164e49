#!/usr/bin/env bash
# On the device machine: set up the committed tree under /tmp/clean, with the carried wheels installed, so a benchmark
# runs what is committed and not the copied working tree (other agents' unfinished edits included). Here, first:
#   git archive HEAD --format=tar.gz -o .devtree.tgz      (carry .devtree.tgz and .whl; optionally .triton_cache.tgz,
#                                                          a tar of ~/.triton/cache from an earlier call)
# then on the device: source bench/device_clean.sh && cd /tmp/clean && <benchmark command>
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:/tmp/clean PYTHONUNBUFFERED=1
rm -rf /tmp/clean && mkdir -p /tmp/clean
if [ -f .devtree.tgz ]; then
    tar xzf .devtree.tgz -C /tmp/clean && echo "device_clean: the carried archive of HEAD"
else
    cp -r . /tmp/clean && echo "device_clean: no .devtree.tgz; the working tree as copied"
fi
if [ -f .triton_cache.tgz ]; then
    mkdir -p ~/.triton && tar xzf .triton_cache.tgz -C ~/.triton && echo "device_clean: Triton cache restored"
fi
cp -r .whl /tmp/clean/ 2>/dev/null
ulimit -n 65536 2>/dev/null || true
