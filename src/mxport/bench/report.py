"""Presenting benchmark rows.

One rich table, the machine description, and the quantize throughput plot (PNG).
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch
from rich.table import Table

from .._fs import mkstemp_like_open

_THROUGHPUT = re.compile(r"^throughput (\d+)x(\d+)$")


def machine() -> dict:
    """The machine the numbers come from: CPU count, torch threads, versions, CUDA device, fast-path state."""
    from .. import __version__
    from ..quantize import FAST_PATH, NATIVE_PATH

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mxport": __version__,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "native_quantize": NATIVE_PATH.available,
        "native_quantize_disabled_reason": NATIVE_PATH.disabled_reason,
        "fast_quantize": FAST_PATH.available,
        "fast_quantize_disabled_reason": FAST_PATH.disabled_reason,
    }


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000 or a < 0.01:
        return f"{v:.3g}"
    return f"{v:.3f}" if a < 10 else f"{v:.1f}"


_GOAL_RE = re.compile(r"^\s*(?:ratio\s*)?(>=|<=)\s*([0-9.eE+-]+)")
_RANGE_RE = re.compile(r"^\s*([0-9.eE+-]+)\s*<=\s*ratio\s*<=\s*([0-9.eE+-]+)\s*$")


def goal_met(row: dict) -> bool | None:
    """Whether a row meets a goal written as ``ratio >= X`` / ``ratio <= X`` / ``X <= ratio <= Y`` (a
    prediction within a band of the measurement); None for other goals."""
    ratio = row.get("ratio")
    if row.get("metric") in ("skipped", "error") or not isinstance(ratio, (int, float)) or isinstance(ratio,
                                                                                                      bool):
        return None
    goal = str(row.get("goal", ""))
    band, m = _RANGE_RE.search(goal), _GOAL_RE.search(goal)
    try:
        if band is not None:
            return float(band.group(1)) <= ratio <= float(band.group(2))
        if m is None:
            return None
        bound = float(m.group(2))
    except ValueError:  # a malformed number: not a goal this reads
        return None
    return ratio >= bound if m.group(1) == ">=" else ratio <= bound


#: terminals narrower than this get the table without its baseline column (it would fold every row into a
#: column a few characters wide)
WIDE_TABLE_COLUMNS = 150


def rows_table(rows: list[dict], title: str = "mxport bench (medians)", width: int | None = None) -> Table:
    """One table of rows: benchmark, metric, value, unit, baseline, ratio (= value / baseline), goal, met.
    ``width``: the terminal's columns; below :data:`WIDE_TABLE_COLUMNS` the baseline column is left out (a
    caption says where to find it: a wider terminal, or ``--json``)."""
    wide = width is None or width >= WIDE_TABLE_COLUMNS
    table = Table(title=title, caption=None if wide else
                  f"baselines: in a terminal of {WIDE_TABLE_COLUMNS}+ columns, or with --json")
    for col, justify in (("benchmark", "left"), ("metric", "left"), ("value", "right"), ("unit", "left"),
                         ("baseline", "left"), ("ratio", "right"), ("goal", "left"), ("met", "left")):
        if wide or col != "baseline":
            table.add_column(col, justify=justify, overflow="fold")
    for r in rows:
        if r["metric"] in ("skipped", "error"):
            style = "yellow" if r["metric"] == "skipped" else "bold red"
            label = f"[{style}]{r['metric']}[/]"  # its reason in the baseline column, or after it when narrow
            label = label if wide else f"{label}: {r['note']}"
            cells = [r["benchmark"], label, "", "", r["note"], "", "", ""]
        else:
            met = goal_met(r)
            cells = [r["benchmark"], r["metric"], _fmt(r["value"]), r["unit"], r["baseline"],
                     _fmt(r["ratio"]), r["goal"], "" if met is None else ("yes" if met else "[red]no[/]")]
        if not wide:
            del cells[4]  # the baseline column
        table.add_row(*cells)
    return table


def throughput_series(rows: list[dict]) -> list[tuple[int, float, float | None]]:
    """``(numel, mxport GB/s, torchao GB/s or None)`` from the quantize ``throughput NxM`` rows, by size.

    The torchao figure is ``value / ratio`` (the row's ratio is mxport relative to torchao); ratio 0 means no
    torchao baseline.

    >>> throughput_series([{"benchmark": "quantize", "metric": "throughput 64x64",
    ...                     "value": 2.0, "ratio": 4.0}])
    [(4096, 2.0, 0.5)]
    """
    out = []
    for r in rows:
        m = _THROUGHPUT.match(r["metric"]) if r["benchmark"] == "quantize" else None
        if m is None:
            continue
        numel = int(m.group(1)) * int(m.group(2))
        out.append((numel, r["value"], r["value"] / r["ratio"] if r["ratio"] > 0 else None))
    return sorted(out)


def write_plot(rows: list[dict], path: str | os.PathLike, title: str = "") -> Path:
    """Write a PNG of quantize throughput (GB/s moved) against tensor size, mxport vs torchao, atomically.

    Raises ValueError when ``rows`` hold no quantize throughput rows (run the ``quantize`` benchmark).
    """
    series = throughput_series(rows)
    if not series:
        raise ValueError("plot: no quantize throughput rows to plot (include the 'quantize' benchmark)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sizes = [s for s, _, _ in series]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.plot(sizes, [m for _, m, _ in series], "o-", label="mxport.quantize")
    ao = [(s, a) for s, _, a in series if a is not None]
    if ao:
        ax.plot([s for s, _ in ao], [a for _, a in ao], "s--", label="torchao to_mx (RCEIL)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("elements (square BF16 tensor)")
    ax.set_ylabel("GB/s moved (2 B in + 1 B out + scales)")
    ax.set_title(title or "BF16 -> MXFP8 E4M3 rowwise quantize")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save a matplotlib figure as PNG atomically (temp file in the same folder, then rename) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = mkstemp_like_open(path, suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def script_main(name: str, argv: list[str] | None = None) -> list[dict]:
    """Entry point of the thin scripts in benchmarks/.

    Run benchmark ``name`` (``--quick``: the quick mode), print its table and its rows. Unknown options exit
    2 (argparse); ``--help`` prints the help and runs nothing."""
    import argparse

    from rich.console import Console

    from . import run_benchmark

    about = f"mxport benchmark: {name} (the rows of `mxport bench --only {name}`)"
    parser = argparse.ArgumentParser(description=about)
    parser.add_argument("--quick", action="store_true", help="the quick mode (fewer sizes and runs)")
    args = parser.parse_args(argv)
    rows = run_benchmark(name, quick=args.quick)
    Console().print(rows_table(rows, title=f"{name} (medians)"))
    for r in rows:
        print(r)
    return rows
