"""``mxport export``: a model (HF directory, GGUF, or the embedded default) -> an MXFP8 checkpoint.

The checkpoint is for vLLM / SGLang."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ..checkpoint.export import (
    DTYPES,
    FP8_DTYPES,
    align_decisions,
    check_dry_run,
    check_options,
    export_checkpoint,
    open_source,
    plan,
    prepare_out,
)
from ..checkpoint.naming import DEFAULT_FORMAT
from ..checkpoint.writers import parse_size
from ..policy import PrecisionPolicy
from ._choices import EXPORT_FP8, Dtype, Format, Fp8Dtype, Quant, export_fp8
from ._common import ExcludeOpt, ModelSourceArg, console, emit_json, json_option, json_to_stdout, user_errors
from .app import app

_ExportJson = json_option("the result (or the dry-run plan)")


@app.command("export")
def export_cmd(
    source: ModelSourceArg = None,
    out: str = typer.Option(None, "-o", "--out", metavar="OUT",
                            help="Output directory (required unless --dry-run)."),
    fmt: Format = typer.Option(DEFAULT_FORMAT, "--format", help="Checkpoint format."),
    quant: Quant = typer.Option("mxfp8", "--quant",
                                help="Weight format: mxfp8 (FP8 + E8M0 per 32), mxfp4 (E2M1 + E8M0 per 32) "
                                     "or nvfp4 (E2M1 + E4M3 per 16 + a float32 global scale; q/k/v and "
                                     "gate/up share it). 4-bit: --format modelopt or compressed-tensors, "
                                     "weight-only unless --activation nvfp4."),
    activation: str = typer.Option("none", "--activation", metavar="<none|nvfp4>",
                                   help="none: weight-only. nvfp4 (with --quant nvfp4 --format modelopt): "
                                        "W4A4, each linear's input_scale calibrated on the built-in prompts "
                                        "as ModelOpt's NVFP4 recipe does (the model is loaded once)."),
    fp8_dtype: Fp8Dtype = typer.Option("e4m3", "--fp8-dtype", metavar="<" + "|".join(EXPORT_FP8) + ">",
                                       callback=export_fp8,
                                       help="FP8 element type. Every format's consumers read E4M3 values "
                                            "(vLLM's loaders; SGLang 0.5.23 registers E4M3 whatever the "
                                            "config says), so e5m2 is refused."),
    exclude: ExcludeOpt = None,
    include: list[str] = typer.Option(None, "--include", metavar="PATTERN",
                                      help="Quantize only linear/expert weights matching this "
                                           "fnmatch pattern (repeatable)."),
    keep_first: int = typer.Option(0, "--keep-first", min=0,
                                   help="Keep the first N decoder layers in high precision."),
    keep_last: int = typer.Option(0, "--keep-last", min=0,
                                  help="Keep the last N decoder layers in high precision."),
    dtype: Dtype = typer.Option(None, "--dtype",
                                help="Cast kept floating tensors to this dtype (default: keep each "
                                     "tensor's dtype)."),
    keep_unaligned: bool = typer.Option(False, "--keep-unaligned",
                                        help="Keep weights whose K (last dimension) is not whole blocks (a "
                                             "multiple of 32; 16 for nvfp4) in their source dtype (vLLM, "
                                             "SGLang and TE refuse them); without it such a weight stops "
                                             "the export."),
    nonzero_scales: bool = typer.Option(False, "--nonzero-scales",
                                        help="Scale byte 1 instead of 0 (for FlashInfer's TRT-LLM MXFP8 "
                                             "kernels, NeMo-RL's rule); decoded values stay the same."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard, e.g. 5GB, 500MB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Print each tensor's decision and why; write nothing."),
    json_out: _ExportJson = None,
):
    """Export a model as an MXFP8 (or --quant mxfp4 / nvfp4) checkpoint that vLLM (modelopt,
    compressed-tensors) or SGLang (sglang, MXFP8 only) loads.

    Linear-layer weights and fused expert weights become FP8 values + uint8 E8M0 scales (compact, one per 32
    values along K); embeddings, lm_head, norms, biases and MoE routers stay as they are. Patterns are
    fnmatch-style ('*' also matches dots) over tensor names and module names, e.g. --exclude '*.mlp.*'. Output
    goes to a temporary directory renamed into place. Exit 0 ok, 2 bad input.

    --quant mxfp4: packed E2M1 values (two per byte) + E8M0 scales per 32; --quant nvfp4: packed E2M1 + E4M3
    scales per 16 + one float32 global scale per weight (shared where vLLM fuses).

    A weight whose K is not whole blocks (a multiple of 32; 16 for nvfp4) stops the export (exit 2, naming
    it): vLLM, SGLang and TE cannot load it quantized (--keep-unaligned keeps it in its dtype).
    """
    json_to_stdout(json_out)
    with user_errors():
        fmt, quant = Format(fmt).value, Quant(quant).value
        fp8 = FP8_DTYPES[Fp8Dtype(fp8_dtype).value]
        cast = DTYPES[Dtype(dtype).value] if dtype is not None else None
        check_options(fmt, fp8, quant, activation, nonzero_scales, cast)
        parse_size(max_shard_size)
        policy = PrecisionPolicy(include=tuple(include or ()), exclude=tuple(exclude or ()),
                                 keep_first=keep_first, keep_last=keep_last)
        if out is None and not dry_run:
            raise ValueError("-o/--out OUT is required (or use --dry-run)")
        if dry_run:
            return _dry_run(source, policy, keep_unaligned, fmt, quant, json_out)
        options = {"keep_unaligned": keep_unaligned, "nonzero_scales": nonzero_scales, "quant": quant,
                   "activation": activation}
        result = _run_export(source, out, fmt, fp8, policy, cast, max_shard_size, overwrite, options)
    _print_result(result, fmt)
    if json_out:
        emit_json(result.to_dict(), json_out)


def _dry_run(source, policy, keep_unaligned: bool, fmt: str, quant: str, json_out) -> None:
    """``--dry-run``: each tensor's decision, after the refusals a real export would make."""
    reader = open_source(source)
    decisions = align_decisions(plan(reader, policy), keep_unaligned, quant)
    check_dry_run(reader, decisions, quant)
    reader.close()
    _print_plan(decisions, reader.label, quant)
    if json_out:
        emit_json({"source": reader.label, "format": fmt, "quant": quant, "policy": policy.to_dict(),
                   "decisions": [d.to_dict() for d in decisions]}, json_out)


def _print_result(result, fmt: str) -> None:
    n_q = sum(d.quantize for d in result.decisions)
    w4a4 = f" with calibrated input scales ({result.activation.upper()} activations)" if (
        result.activation != "none") else ""
    console.print(f"[green]wrote[/] {result.out} ({fmt}): {n_q} tensors {result.quant.upper()}{w4a4}, "
                  f"{len(result.decisions) - n_q} kept, "
                  f"{result.input_bytes / 1e6:.1f} MB in -> {result.output_bytes / 1e6:.1f} MB out, "
                  f"{len(result.files)} files", highlight=False)
    if not n_q:  # what inspect then reports as a problem: an MXFP8 config over no MXFP8 tensor
        q = result.quant.upper()
        why = ("--keep-unaligned kept every weight" if result.kept_unaligned
               else "--include / --exclude / --keep-first left none")
        console.print(f"[yellow]warning:[/] no tensor is {q} ({why}), yet the config declares {q} "
                      "quantization; check the patterns with --dry-run", highlight=False)
    reasons = {d.name: d.reason for d in result.decisions}
    for name in result.kept_unaligned:
        console.print(f"[yellow]kept in high precision[/] {name}: {reasons[name].removeprefix('kept: ')}",
                      highlight=False)
    if result.nonzero_scales:
        console.print("scale bytes 0 written as 1 (--nonzero-scales)", highlight=False)
    split = {n: outs for n, outs in result.renamed.items() if len(outs) > 1}
    if split:
        first, outs = next(iter(split.items()))
        console.print(f"fused experts written per expert, under the names vLLM's and SGLang's loaders read: "
                      f"{len(split)} tensors -> {sum(map(len, split.values()))} (e.g. {first} -> {outs[0]}, "
                      f"{outs[1]}, ...)", highlight=False)


def _run_export(source, out, fmt, fp8, policy, cast, max_shard_size, overwrite, options):
    from pathlib import Path

    src_dir = Path(source) if source is not None and Path(source).is_dir() else None
    prepare_out(out, overwrite, src_dir)  # fail before loading anything
    with console.status("reading the source model"):
        reader = open_source(source)
    total = sum(reader.nbytes(n) for n in reader.names())
    columns = (TextColumn("[bold]export[/]"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
               TextColumn("{task.description}"))
    calibrating = options.get("activation", "none") != "none"
    with Progress(*columns, console=console, transient=True) as bar:
        # W4A4: the input scales are calibrated (forwards over the built-in prompts) before any tensor is
        # written; the bar's clock starts with the first tensor, so its time remaining is the writing's
        task = bar.add_task("calibrating input scales (forwards over the prompts)" if calibrating else "",
                            total=total, start=not calibrating)

        def progress(name: str, done: int) -> None:
            if not bar.tasks[0].started:
                bar.start_task(task)
            bar.update(task, completed=done, description=name)

        return export_checkpoint(reader, out, fmt=fmt, fp8_dtype=fp8, policy=policy, dtype=cast,
                                 max_shard_size=max_shard_size, overwrite=overwrite, progress=progress,
                                 **options)


def _print_plan(decisions, label: str, quant: str = "mxfp8") -> None:
    table = Table(title=f"export plan for {label}")
    for col in ("tensor", "shape", "dtype", "decision", "why"):
        table.add_column(col, overflow="fold", min_width=30 if col == "tensor" else None)
    for d in decisions:
        table.add_row(d.name, "x".join(map(str, d.shape)) or "scalar", str(d.dtype).removeprefix("torch."),
                      f"[green]{quant.upper()}[/]" if d.quantize else "keep", d.reason)
    console.print(table)
    n_q = sum(d.quantize for d in decisions)
    console.print(f"{n_q} tensors {quant.upper()}, {len(decisions) - n_q} kept", highlight=False)
