"""Benchmarks behind ``mxport bench``: each module exposes ``run(quick: bool) -> list[dict]`` rows.

A row holds ``benchmark``, ``metric``, ``value`` (a median), ``unit``, ``baseline`` (what it is compared to,
measured in the same run), ``ratio`` (value relative to that baseline), ``goal`` and an optional ``note``.

The registry :data:`BENCHMARKS` names modules, imported lazily: a module that is not there (yet) gives one
``skipped`` row, a module that fails gives one ``error`` row, so one missing or broken benchmark never hides
the others.
"""

from __future__ import annotations

import importlib
import math
import traceback
from collections.abc import Callable, Iterable

#: benchmark name -> module path (each with ``run(quick: bool = False) -> list[dict]``)
BENCHMARKS: dict[str, str] = {
    "quantize": "mxport.bench.quantize",      # quantize GB/s vs torchao to_mx and the copy_ memory bound
    "export": "mxport.bench.export",          # export_components of TE storage (views, unswizzle) vs quantize
    "checkpoint": "mxport.bench.checkpoint",  # checkpoint export vs a plain safetensors load+save; peak RSS
    "refit": "mxport.bench.refit",            # refit throughput vs a raw dist.broadcast of the same bytes
    "refit_sharded": "mxport.bench.refit_sharded",  # T -> E sharded refit vs gather BF16 + broadcast
    "refit_vllm": "mxport.bench.refit_vllm",  # refit into a real vLLM engine vs a raw broadcast (needs vLLM)
    "refit_delta": "mxport.bench.refit_delta",  # delta refit vs full refit of the same training run
    "mesh_plan": "mxport.bench.mesh_plan",    # sharded refit's plan build at 8 / 64 / 256 trainer ranks
}

ROW_KEYS = ("benchmark", "metric", "value", "baseline", "ratio", "unit", "goal", "note")
SKIPPED, ERROR = "skipped", "error"


def _status_row(name: str, status: str, note: str) -> dict:
    return {"benchmark": name, "metric": status, "value": 0.0, "baseline": "", "ratio": 0.0, "unit": "",
            "goal": "", "note": note}


def check_row(row: dict, source: str) -> dict:
    """Validate one row (all keys of :data:`ROW_KEYS`, ``note`` optional; numbers finite) and return a copy.

    Raises ValueError naming ``source`` and the bad key.
    """
    if not isinstance(row, dict):
        raise ValueError(f"{source}: a row must be a dict, got {type(row).__name__}")
    missing = [k for k in ROW_KEYS if k != "note" and k not in row]
    if missing:
        raise ValueError(f"{source}: row {row.get('metric')!r} lacks keys {missing}")
    out = {k: row.get(k, "") for k in ROW_KEYS}
    for k in ("value", "ratio"):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{source}: row {out['metric']!r} has a non-finite or non-numeric {k}: {v!r}")
        out[k] = float(v)
    for k in ("benchmark", "metric", "baseline", "unit", "goal", "note"):
        out[k] = str(out[k])
    return out


def select(only: Iterable[str] | None) -> list[str]:
    """Benchmark names to run: all of :data:`BENCHMARKS`, or ``only`` (ValueError naming an unknown one)."""
    if not only:
        return list(BENCHMARKS)
    names = list(dict.fromkeys(only))
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"--only: unknown benchmark(s) {unknown}; expected some of {list(BENCHMARKS)}")
    return names


def run_benchmark(name: str, quick: bool = False) -> list[dict]:
    """Import the module registered as ``name`` and return its checked rows (or one skipped / error row)."""
    module_name = BENCHMARKS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return [_status_row(name, SKIPPED, f"{module_name} is not present in this install")]
        return [_status_row(name, ERROR, f"import failed: {type(exc).__name__}: {exc}")]
    except Exception as exc:  # noqa: BLE001 - report any import failure as a row, keep the other benchmarks
        return [_status_row(name, ERROR, f"import failed: {type(exc).__name__}: {exc}")]
    try:
        rows = module.run(quick=quick)
        return [check_row(r, module_name) for r in rows]
    except Exception as exc:  # noqa: BLE001 - one failing benchmark gives an error row, not a crash of all
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return [_status_row(name, ERROR, f"run failed: {last}"[:500])]


def run_all(names: Iterable[str], quick: bool = False,
            on_start: Callable[[str], None] | None = None) -> list[dict]:
    """Run the named benchmarks in order and concatenate their rows.

    ``on_start(name)`` is called before each."""
    rows: list[dict] = []
    for name in names:
        if on_start is not None:
            on_start(name)
        rows.extend(run_benchmark(name, quick=quick))
    return rows
