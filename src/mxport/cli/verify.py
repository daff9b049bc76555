"""``mxport verify``: generate with the MXFP8 twin of a model, score with both, report the drift (exit 1 above
``--max-kl``)."""

from __future__ import annotations

import math

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ._common import EXIT_CHECK_FAILED, console, emit_json, fail, json_to_stdout, user_errors
from .app import app

_FP8 = {"e4m3": "e4m3", "e5m2": "e5m2"}


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


def _print_report(r: dict) -> None:
    t = Table(title=f"mxport verify: {r['model']} ({r['fp8_dtype']}, activation {r['activation']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("gen_kl_error_mean", "gen_kl_error_max", "token_mult_prob_error", "greedy_agreement", "tokens",
                "weight_sqnr_db_min", "weight_sqnr_db_mean", "mxfp8_layers", "prompts"):
        t.add_row(key, _fmt(r[key]))
    if r.get("max_kl") is not None:
        t.add_row("max_kl", _fmt(r["max_kl"]))
        t.add_row("result", "[green]pass[/]" if r["passed"] else "[red]FAIL[/]")
    console.print(t)
    pl = r.get("per_layer")
    if pl:
        lt = Table(title="per-layer share of gen_kl_error (only that layer quantized)")
        lt.add_column("layer", justify="right")
        lt.add_column("gen_kl_error_mean", justify="right")
        lt.add_column("share", justify="right")
        for row in pl["layers"]:
            lt.add_row(str(row["layer"]), _fmt(row["gen_kl_error_mean"]), f"{100 * row['share']:.1f}%")
        console.print(lt)
        s = pl.get("suggestion")
        if s:
            status = "[green]met[/]" if s["met"] else "[red]not met[/]"
            console.print(f"target_kl {_fmt(s['target_kl'])}: keep layers {s['keep_layers']} in high precision "
                          f"-> gen_kl_error_mean {_fmt(s['gen_kl_error_mean'])} ({status})", highlight=False)
            if s["exclude"]:
                console.print("  mxport export " + " ".join(f"--exclude '{p}'" for p in s["exclude"]),
                              highlight=False)


@app.command()
def verify(
    source: str = typer.Argument(None, help="Model directory or GGUF file (default: the embedded SmolLM2-135M)."),
    checkpoint: str = typer.Option(None, "--checkpoint", help="Build the MXFP8 twin from this `mxport export` "
                                   "directory instead of quantizing SOURCE here."),
    prompts: str = typer.Option(None, "--prompts", help="Prompts file: one per line, or a JSON list of strings / "
                                "chat message lists (default: the built-in set of 18)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1, help="Greedy generation budget per prompt."),
    activation: str = typer.Option("none", "--activation", help="none (weight-only) or mxfp8 (W8A8 emulation)."),
    fp8_dtype: str = typer.Option("e4m3", "--fp8-dtype", help="Element format of the weights: e4m3 or e5m2."),
    max_kl: float = typer.Option(None, "--max-kl", help="Exit 1 when gen_kl_error_mean exceeds this."),
    per_layer: bool = typer.Option(False, "--per-layer", help="Measure each decoder layer's share of the error."),
    target_kl: float = typer.Option(None, "--target-kl", help="With --per-layer: suggest the fewest layers to "
                                    "keep in high precision to reach this gen_kl_error_mean."),
    exclude: list[str] = typer.Option(None, "--exclude", help="Keep matching layers in high precision "
                                      "(PrecisionPolicy pattern, repeatable, e.g. 'model.layers.3.*')."),
    device: str = typer.Option("cpu", "--device", help="Device for both models (cpu, cuda, cuda:1, ...)."),
    json_out: str = typer.Option(None, "--json", help="Write the report as JSON to FILE ('-' for stdout)."),
):
    """Generate greedily with the MXFP8 twin of a model and score the tokens with both models.

    Reports gen_kl_error (KL of the full next-token distributions, MXFP8 || source), token_mult_prob_error
    (NeMo-RL), greedy agreement and the weight SQNR of each quantized tensor.
    """
    json_to_stdout(json_out)
    from ..policy import PrecisionPolicy
    from ..verify import verify as run_verify

    with user_errors():
        if activation not in ("none", "mxfp8"):
            raise fail(f"--activation must be 'none' or 'mxfp8', got {activation!r}")
        if fp8_dtype not in _FP8:
            raise fail(f"--fp8-dtype must be 'e4m3' or 'e5m2', got {fp8_dtype!r}")
        if target_kl is not None and not per_layer:
            raise fail("--target-kl needs --per-layer")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            tasks: dict[str, int] = {}

            def progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total)
                bar.update(tasks[stage], completed=done, total=total)

            policy = PrecisionPolicy(exclude=tuple(exclude)) if exclude else None
            if policy is not None and checkpoint is not None:
                raise fail("--exclude applies when quantizing here, not with --checkpoint (export with --exclude)")
            report = run_verify(source, checkpoint=checkpoint, policy=policy, prompts=prompts, max_new_tokens=max_new_tokens,
                                activation=activation, fp8_dtype=_FP8[fp8_dtype], max_kl=max_kl,
                                per_layer=per_layer, target_kl=target_kl, device=device, progress=progress)
    if json_out:
        emit_json(report, json_out)
    if json_out != "-":
        _print_report(report)
    if not report["passed"]:
        console.print(f"[red]gen_kl_error_mean {_fmt(report['gen_kl_error_mean'])} exceeds --max-kl "
                      f"{_fmt(max_kl)}[/]", highlight=False)
        raise typer.Exit(EXIT_CHECK_FAILED)
