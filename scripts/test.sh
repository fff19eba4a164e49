#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite. pytest's "no tests collected" (5) counts as failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
