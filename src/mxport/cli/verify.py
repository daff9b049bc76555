"""``mxport verify``: generate with the MXFP8 twin of a model, score with both, report the drift (exit 1 above
``--max-kl``)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ._choices import Activation, Fp8Dtype, Quant
from ._common import (
    EXIT_CHECK_FAILED,
    ExcludeOpt,
    JsonOut,
    MaxNewTokensOpt,
    ModelSourceArg,
    console,
    emit_json,
    fail,
    json_to_stdout,
    require,
    user_errors,
)
from .app import app


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


def export_command(source: str | None, exclude: list[str], fp8_dtype: str) -> str:
    """The ``mxport export`` command line that keeps ``exclude`` in high precision, complete (source, ``-o``)
    and quoted for a POSIX shell."""
    name = Path(source).name.removesuffix(".gguf") if source else "SmolLM2-135M-Instruct"
    args = ["mxport", "export"] + ([source] if source else []) + ["-o", f"{name}-mxfp8"]
    if fp8_dtype == "e5m2":
        args += ["--format", "sglang", "--fp8-dtype", "e5m2"]  # the one format that declares E5M2 values
    for pattern in exclude:
        args += ["--exclude", pattern]
    return shlex.join(args)


def _print_report(r: dict, source: str | None, exclude: list[str], fp8_dtype: str) -> None:
    t = Table(title=f"mxport verify: {r['model']} ({r.get('quant', 'mxfp8')}, {r['element']}, "
                    f"activation {r['activation']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("gen_kl_error_mean", "gen_kl_error_max", "token_mult_prob_error", "greedy_agreement",
                "tokens", "weight_sqnr_db_min", "weight_sqnr_db_mean", "quantized_tensors", "prompts"):
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
            console.print(f"target_kl {_fmt(s['target_kl'])}: keep layers {s['keep_layers']} "
                          f"in high precision -> gen_kl_error_mean {_fmt(s['gen_kl_error_mean'])} ({status})",
                          highlight=False)
            if s["exclude"]:  # one unwrapped line, so that it can be copied and run as printed
                patterns = list(dict.fromkeys([*exclude, *s["exclude"]]))  # the user's --exclude kept too
                console.print("  " + export_command(source, patterns, fp8_dtype), highlight=False,
                              soft_wrap=True, markup=False)


@app.command()
def verify(
    source: ModelSourceArg = None,
    checkpoint: str = typer.Option(None, "--checkpoint", metavar="DIR", help="Build the MXFP8 twin from this "
                                   "`mxport export` directory instead of quantizing SOURCE here."),
    prompts: str = typer.Option(None, "--prompts", metavar="FILE",
                                help="Prompts file: one per line, or a JSON list of strings / chat message "
                                     "lists (default: the built-in set of 18)."),
    max_new_tokens: MaxNewTokensOpt = 32,
    activation: Activation = typer.Option("none", "--activation", help="none (weight-only) or mxfp8 (W8A8 "
                                                                        "emulation)."),
    fp8_dtype: Fp8Dtype = typer.Option("e4m3", "--fp8-dtype", help="Element format of the MXFP8 weights."),
    quant: Quant = typer.Option("mxfp8", "--quant",
                                help="The weights' format: mxfp8, or mxfp4 / nvfp4 (weight-only, quantized "
                                     "here: E2M1 with E8M0 scales per 32 / E4M3 scales per 16 and a global "
                                     "scale, ModelOpt's rule)."),
    max_kl: float = typer.Option(None, "--max-kl", min=0, help="Exit 1 when gen_kl_error_mean exceeds this."),
    per_layer: bool = typer.Option(False, "--per-layer",
                                   help="Measure each decoder layer's share of the error."),
    target_kl: float = typer.Option(None, "--target-kl", min=0,
                                    help="With --per-layer: suggest the fewest layers to keep in high "
                                         "precision to reach this gen_kl_error_mean."),
    exclude: ExcludeOpt = None,
    device: str = typer.Option("cpu", "--device", help="Device for both models (cpu, cuda, cuda:1, ...)."),
    json_out: JsonOut = None,
):
    """Generate greedily with the MXFP8 twin of a model and score the tokens with both models (--quant
    mxfp4 / nvfp4: the twin's weights in that 4-bit format instead).

    Reports gen_kl_error (KL of the full next-token distributions, MXFP8 || source), token_mult_prob_error
    (NeMo-RL), greedy agreement and the weight SQNR of each quantized tensor. With --per-layer --target-kl it
    prints the `mxport export` command that keeps the suggested layers in high precision.

    Exit 0 ok; 1 when gen_kl_error_mean exceeds --max-kl; 2 on bad input.
    """
    json_to_stdout(json_out)
    activation, fp8_dtype, quant = Activation(activation).value, Fp8Dtype(fp8_dtype).value, Quant(quant).value
    with user_errors():
        require("transformers")
        from ..policy import PrecisionPolicy
        from ..verify import verify as run_verify

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
                raise fail("--exclude applies when quantizing here, not with --checkpoint "
                           "(export with --exclude)")
            report = run_verify(source, checkpoint=checkpoint, policy=policy, prompts=prompts,
                                max_new_tokens=max_new_tokens, activation=activation, fp8_dtype=fp8_dtype,
                                max_kl=max_kl, per_layer=per_layer, target_kl=target_kl, device=device,
                                progress=progress, quant=quant)
    if json_out:
        emit_json(report, json_out)
    if report.get("prompt_note"):
        console.print(report["prompt_note"], highlight=False, markup=False, soft_wrap=True)
    _print_report(report, source, exclude or [], fp8_dtype)  # --json -: on stderr
    if not report["passed"]:
        console.print(f"[red]gen_kl_error_mean {_fmt(report['gen_kl_error_mean'])} exceeds --max-kl "
                      f"{_fmt(max_kl)}[/]", highlight=False)
        raise typer.Exit(EXIT_CHECK_FAILED)
