"""``mxport inspect``: look inside an MXFP8 (or MXFP4 / NVFP4) checkpoint of any of the three formats; exit 1
on problems."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..checkpoint.inspect import inspect_checkpoint
from ._common import EXIT_CHECK_FAILED, JsonOut, console, emit_json, json_to_stdout, user_errors
from .app import app


@app.command("inspect")
def inspect_cmd(
    path: str = typer.Argument(..., metavar="PATH", help="Checkpoint directory (or one .safetensors file)."),
    json_out: JsonOut = None,
    no_stats: bool = typer.Option(False, "--no-stats",
                                  help="Skip decoding the values (faster on big models)."),
):
    """Look inside an MXFP8 checkpoint (modelopt, compressed-tensors, sglang) and check it; MXFP4 / NVFP4
    checkpoints (modelopt, compressed-tensors) too.

    Per tensor: name, shape, dtype, role (values / scales / kept); per quantized weight: the block scales'
    power-of-two range (E8M0: E-127; NVFP4: floor(log2) of E4M3 scale x global scale) and decoded value
    statistics; totals and the ratio to BF16; checks that every value tensor has its block scales (and 4-bit
    its global scale) and every scale its values. Exit 0 clean, 1 problems found, 2 bad input.
    """
    json_to_stdout(json_out)
    columns = (TextColumn("inspect"), BarColumn(), MofNCompleteColumn(), TextColumn("weights"),
               TimeElapsedColumn())
    with user_errors(), Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=None)
        report = inspect_checkpoint(
            path, stats=not no_stats,
            on_progress=lambda done, total: bar.update(task, completed=done, total=total))
    if json_out:
        emit_json(report, json_out)
    _print(report)  # with --json -: on stderr (the console follows json_to_stdout)
    if report["problems"]:
        raise typer.Exit(EXIT_CHECK_FAILED)


#: the weights table's columns after ``values``: header (two lines, so that the table fits in 80 columns); the
#: block scales' power-of-two range (E8M0: E - 127; NVFP4: floor(log2) of the decoded block scale)
PAIR_COLUMNS = ("scale\nshape", "scale 2^\nmin..max", "absmax", "mean |x|", "zero\nblocks")


def _table(title: str, first: str, rest) -> Table:
    """A table whose first column (tensor names) folds and whose other columns never wrap: at 80 columns the
    names take what is left, every column stays."""
    t = Table(title=title)
    t.add_column(first, overflow="fold")
    for col in rest:
        t.add_column(col, no_wrap=True)
    return t


def _pair_row(x: dict) -> tuple[str, ...]:
    if "absmax" not in x:
        return (x["values"], str(x["scale_shape"]), "-", "-", "-", "-")
    return (x["values"], str(x["scale_shape"]), f"{x['scale_exp_min']}..{x['scale_exp_max']}",
            f"{x['absmax']:.4g}", f"{x['mean_abs']:.4g}", f"{x['zero_block_fraction']:.2%}")


def _print(r: dict) -> None:
    fmt = r["format"] or "not MXFP8 (no values/scale pairs)"
    quant = f", {r['quant'].upper()} weights" if r.get("quant") else ""
    console.print(f"[bold]{r['path']}[/]: format {fmt}{quant}"
                  + (f" (from {r['format_source']})" if r["format"] else ""), highlight=False)
    t = _table("tensors", "name", ("shape", "dtype", "role"))
    for x in r["tensors"]:
        t.add_row(x["name"], str(x["shape"]), x["dtype"], x["role"])
    console.print(t)
    if r["pairs"]:
        p = _table(f"{(r.get('quant') or 'mxfp8').upper()} weights", "values", PAIR_COLUMNS)
        for x in r["pairs"]:
            p.add_row(*_pair_row(x))
        console.print(p)
    tot = r["totals"]
    console.print(f"{tot['tensors']} tensors, {tot['bytes'] / 1e6:.2f} MB "
                  f"(values {tot['values_bytes'] / 1e6:.2f}, scales {tot['scales_bytes'] / 1e6:.2f}, kept "
                  f"{tot['kept_bytes'] / 1e6:.2f}); {tot['ratio_to_bf16']:.3f}x of BF16", highlight=False)
    for w in r["warnings"]:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    for prob in r["problems"]:
        console.print(f"[bold red]problem:[/] {prob}", highlight=False)
    if not r["problems"]:
        console.print("[green]no problems found[/]")
