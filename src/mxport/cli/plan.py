"""``mxport plan``: the capacity model — bytes per link and predicted refit time, MXFP8 against BF16."""

from __future__ import annotations

import typer
from rich.table import Table

from ._common import EXIT_CHECK_FAILED, console, emit_json, fail, json_to_stdout, user_errors
from .app import app


@app.command("plan")
def plan_cmd(
    source: str = typer.Argument(None, help="config.json, or a model directory holding one (default: the "
                                            "embedded SmolLM2-135M's)."),
    trainer: str = typer.Option("1", "--trainer",
                                help="Trainer layout, e.g. fsdp=8, tp=2,pp=2 ('1': one rank)."),
    engine: str = typer.Option("tp=1", "--engine", help="Engine layout, e.g. tp=8, tp=8,ep=16."),
    replicas: int = typer.Option(1, "--engine-replicas", min=1, help="Engines (each a full copy) refitted."),
    link_gbps: float = typer.Option(50.0, "--link-gbps", min=1e-6,
                                    help="GB/s of one rank's link (each trainer and engine rank has one)."),
    trainer_gelems: float = typer.Option(14.0, "--trainer-quantize-gelems", min=1e-6,
                                         help="G elements/s one trainer rank quantizes (an H200: about 14)."),
    engine_gelems: float = typer.Option(14.0, "--engine-quantize-gelems", min=1e-6,
                                        help="G elements/s one engine rank quantizes (the BF16 path)."),
    overlap: bool = typer.Option(True, "--overlap/--no-overlap",
                                 help="Quantizing overlaps sending (mxport's sender), or precedes it."),
    kept_bytes: int = typer.Option(2, "--kept-bytes", min=1, max=8,
                                   help="Bytes per element of kept tensors on the wire (BF16 engines: 2)."),
    json_out: str = typer.Option(None, "--json", help="Write the report as JSON to FILE ('-' for stdout)."),
):
    """Predict a refit: bytes per link and seconds, MXFP8 (mxport) against BF16 (gather, send,
    quantize on the engine), for a model config and trainer / engine layouts. See docs/guide-refit.md
    for the model's formulas.

    Exit 0; 1 when an MXFP8 consumer cannot take an engine rank's slice (K per rank not a multiple of 32);
    2 on bad input.
    """
    json_to_stdout(json_out)
    from ..capacity import Hardware, predict_config, read_config
    from ..layout import Layout

    with user_errors():
        t_layout, e_layout = Layout.parse(trainer), Layout.parse(engine)
        hw = Hardware(link_gbps=link_gbps, trainer_quantize_gelems=trainer_gelems,
                      engine_quantize_gelems=engine_gelems, overlap=overlap)
        if source is None:
            from ..models import resolve_source

            with console.status("resolving the embedded model (converted once, ~25 s)"):
                source = str(resolve_source(None).path)
        config = read_config(source)
        with console.status("building the model on the meta device"):
            report = predict_config(config, t_layout, e_layout, hw, engine_replicas=replicas,
                                    kept_bytes=kept_bytes)
    emit_json(report.to_dict(), json_out)
    if json_out != "-":
        _print(report)
    if report.problems:
        raise fail(f"{len(report.problems)} tensor slice(s) an MXFP8 consumer cannot take; first: "
                   f"{report.problems[0]}", EXIT_CHECK_FAILED)


def _print(r) -> None:
    t = Table(title=f"refit of {r.model} ({r.parameters / 1e9:.3g} B parameters, "
                    f"{r.quantized_parameters / 1e9:.3g} B quantized): trainer {r.trainer} -> "
                    f"{r.engine_replicas} x engine {r.engine}, {r.hardware.link_gbps:g} GB/s links")
    for col in ("path", "wire GB", "GB / trainer rank", "GB / engine rank", "gather s", "quantize s",
                "wire s", "refit s"):
        t.add_column(col, justify="right", no_wrap=True)
    for label, p in (("MXFP8", r.mxfp8), ("BF16", r.bf16)):
        t.add_row(label, f"{p.wire_bytes / 1e9:.3f}", f"{p.bytes_per_trainer_rank / 1e9:.3f}",
                  f"{p.bytes_per_engine_rank / 1e9:.3f}", f"{p.gather_seconds:.3f}",
                  f"{p.quantize_seconds:.3f}", f"{p.wire_seconds:.3f}", f"{p.seconds:.3f}")
    console.print(t)
    console.print(f"predicted refit time, BF16 / MXFP8: {r.speedup:.2f}x", highlight=False)
    for problem in r.problems[:5]:
        console.print(f"[bold red]problem:[/] {problem}", highlight=False)
