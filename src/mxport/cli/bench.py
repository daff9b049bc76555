"""``mxport bench``: run the registered benchmarks and print one table of medians and ratios."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..bench import ERROR, run_benchmark, select
from ..bench.report import goal_met, machine, rows_table, write_plot
from ._choices import Benchmark
from ._common import EXIT_CHECK_FAILED, console, emit_json, fail, json_option, json_to_stdout, user_errors
from .app import app

_BenchJson = json_option("{'rows': [...], 'machine', 'quick', 'seconds'}")


@app.command()
def bench(
    json_out: _BenchJson = None,
    quick: bool = typer.Option(False, "--quick", help="Small tensors and few runs (under a minute here)."),
    only: list[Benchmark] = typer.Option(None, "--only", help="Run only this benchmark (repeatable)."),
    plot: str = typer.Option(None, "--plot", metavar="FILE",
                             help="Write a PNG of quantize throughput vs tensor size to FILE."),
):
    """Run mxport's benchmarks (quantize vs torchao and the memory bound, export, checkpoint, refit).

    Every value is a median after warm-up; each ratio is the value relative to a baseline measured in the same
    run; "met" says whether a "ratio >= X" / "ratio <= X" goal is reached (JSON: true / false / null). A
    missed goal is a finding, not a failure: exit 0 on success, 1 when a benchmark failed (an 'error'
    row), 2 on bad flags.
    """
    json_to_stdout(json_out)
    with user_errors():
        names = select([Benchmark(b).value for b in only or ()])
        if plot is not None and not plot.lower().endswith(".png"):
            raise ValueError(f"--plot must name a .png file, got {plot!r}")
        if plot is not None and "quantize" not in names:
            raise ValueError("--plot needs the 'quantize' benchmark (add --only quantize)")
        parent = Path(plot).parent if plot is not None else None
        if parent is not None and parent.exists() and not parent.is_dir():
            raise NotADirectoryError(f"--plot: {parent} is not a directory")
    rows: list[dict] = []
    t_start = time.perf_counter()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("benchmarks", total=len(names))
        for name in names:
            progress.update(task, description=f"{name} ({'quick' if quick else 'full'})")
            t0 = time.perf_counter()
            rows.extend(run_benchmark(name, quick=quick))
            progress.advance(task)
            console.print(f"[dim]{name}: {time.perf_counter() - t0:.1f} s[/]", highlight=False)
    elapsed = time.perf_counter() - t_start
    for r in rows:
        r["met"] = goal_met(r)
    if json_out:
        emit_json({"rows": rows, "machine": machine(), "quick": quick, "seconds": elapsed}, json_out)
    console.print(rows_table(rows, title=f"mxport bench{' --quick' if quick else ''} "
                                         f"(medians, {elapsed:.0f} s)", width=console.width))
    if plot is not None:
        if not any(r["benchmark"] == "quantize" and r["metric"].startswith("throughput") for r in rows):
            raise fail("--plot: the quantize benchmark gave no throughput rows (see its row)",
                       EXIT_CHECK_FAILED)
        with user_errors():
            console.print(f"plot: {write_plot(rows, plot)}", highlight=False)
    if any(r["metric"] == ERROR for r in rows):
        raise fail("some benchmarks failed (see the 'error' rows)", EXIT_CHECK_FAILED)
