"""``mxport plan``: the capacity model — bytes per link and predicted refit time, MXFP8 against BF16."""

from __future__ import annotations

import typer
from rich.table import Table

from ._common import EXIT_CHECK_FAILED, JsonOut, console, emit_json, json_to_stdout, user_errors
from .app import app


@app.command("plan")
def plan_cmd(
    source: str = typer.Argument(None, help="config.json, or a model directory holding one (default: the "
                                            "embedded SmolLM2-135M's)."),
    trainer: str = typer.Option("1", "--trainer",
                                help="Trainer layout, e.g. fsdp=8, tp=2,pp=2 ('1': one rank)."),
    engine: str = typer.Option("tp=1", "--engine", help="Engine layout (tp, ep, pp), e.g. tp=8, tp=8,ep=16."),
    replicas: int = typer.Option(1, "--engine-replicas", min=1, help="Engines (each a full copy) refitted."),
    link_gbit: float = typer.Option(None, "--link-gbit", min=1e-6,
                                    help="Gbit/s of one rank's link, as NICs are rated (400 for a 400 Gb/s "
                                         "NIC; default 400). Each trainer and engine rank has one."),
    link_gbytes: float = typer.Option(None, "--link-gbytes", min=1e-6,
                                      help="The same in GB/s (bytes: 50 for a 400 Gb/s NIC)."),
    link_gbps: float = typer.Option(None, "--link-gbps", min=1e-6, hidden=True,
                                    help="Deprecated (ambiguous): GB/s, as --link-gbytes."),
    trainer_gelems: float = typer.Option(14.0, "--trainer-quantize-gelems", min=1e-6,
                                         help="G elements/s one trainer rank quantizes (an H200: about 14)."),
    engine_gelems: float = typer.Option(14.0, "--engine-quantize-gelems", min=1e-6,
                                        help="G elements/s one engine rank quantizes (the BF16 path)."),
    overlap: bool = typer.Option(True, "--overlap/--no-overlap",
                                 help="Quantizing overlaps sending (mxport's sender), or precedes it."),
    shared_gbps: float = typer.Option(None, "--shared-gbps", min=1e-6,
                                      help="GB/s all ranks' transfers share (one host's loopback, a shared "
                                           "NIC); default: independent links."),
    host_copy_gbps: float = typer.Option(
        None, "--host-copy-gbps", min=1e-6,
        help="GB/s one rank copies host memory while every rank does: counts the protocol's pack, checksum "
             "and commit passes (a CPU transport); default: left out."),
    host_checksum_gbps: float = typer.Option(
        None, "--host-checksum-gbps", min=1e-6,
        help="GB/s one rank reads for checksums (default: the copy rate)."),
    host_commit_gbps: float = typer.Option(
        None, "--host-commit-gbps", min=1e-6,
        help="GB/s one engine rank copies at commit, the engine ranks alone (default: the copy rate)."),
    host_diff_gbps: float = typer.Option(
        None, "--host-diff-gbps", min=1e-6,
        help="Stream GB/s one trainer rank diffs against its base (--delta-fraction; default: half the "
             "checksum rate)."),
    host_patch_gbps: float = typer.Option(
        None, "--host-patch-gbps", min=1e-6,
        help="Delta payload GB/s one engine rank parses and applies (default: the copy rate)."),
    bucket_mib: int = typer.Option(32, "--bucket-mib", min=1, help="The refit plan's bucket size in MiB."),
    kept_bytes: int = typer.Option(2, "--kept-bytes", min=1, max=8,
                                   help="Bytes per element of kept tensors on the wire (BF16 engines: 2)."),
    delta_fraction: float = typer.Option(
        None, "--delta-fraction", min=0.0, max=1.0,
        help="Also predict a delta refit sending this fraction of the MXFP8 bytes (what mxport refit --delta "
             "reports as bytes / full_bytes; 0.02 at lr 1e-6 on the embedded model)."),
    json_out: JsonOut = None,
):
    """Predict a refit: bytes per link and seconds, MXFP8 (mxport) against BF16 (gather, send,
    quantize on the engine), for a model config and trainer / engine layouts. See docs/guide-capacity.md
    for the model's formulas.

    Exit 0; 1 when the engine layout cannot take the model (an MXFP8 slice whose K per rank is not a multiple
    of 32, attention heads the engine's tp does not divide); 2 on bad input.
    """
    json_to_stdout(json_out)
    from ..capacity import Hardware, predict_config

    with user_errors():
        link_gbps = _link_gbytes(link_gbit, link_gbytes, link_gbps)
        t_layout, e_layout = _layouts(trainer, engine)
        hw = Hardware(link_gbps=link_gbps, trainer_quantize_gelems=trainer_gelems,
                      engine_quantize_gelems=engine_gelems, overlap=overlap, shared_gbps=shared_gbps,
                      host_copy_gbps=host_copy_gbps, host_checksum_gbps=host_checksum_gbps,
                      host_commit_gbps=host_commit_gbps, host_diff_gbps=host_diff_gbps,
                      host_patch_gbps=host_patch_gbps)
        config = _config(source)
        with console.status("building the model on the meta device"):
            report = predict_config(config, t_layout, e_layout, hw, engine_replicas=replicas,
                                    kept_bytes=kept_bytes, bucket_bytes=bucket_mib << 20,
                                    delta_fraction=delta_fraction)
    emit_json(report.to_dict(), json_out)
    _print(report)  # with --json -: on stderr (the console follows json_to_stdout)
    if report.problems:  # a failed check (exit 1), listed above as problems; not a usage error
        raise typer.Exit(EXIT_CHECK_FAILED)


def _layouts(trainer: str, engine: str):
    """The trainer and engine :class:`~mxport.parallel.Layout` (ValueError for an engine with FSDP)."""
    from ..parallel import Layout

    t_layout, e_layout = Layout.parse(trainer), Layout.parse(engine)
    if e_layout.fsdp > 1:
        raise ValueError(f"--engine {engine!r}: an engine layout takes tp, ep and pp (engines do not shard "
                         "with FSDP)")
    return t_layout, e_layout


def _config(source: str | None) -> dict:
    """The ``config.json`` of ``source`` (default: the embedded model's, converted once)."""
    from ..capacity import read_config

    if source is None:
        from ..models import resolve_source

        with console.status("resolving the embedded model (converted once, ~25 s)"):
            source = str(resolve_source(None).path)
    return read_config(source)


def _link_gbytes(gbit: float | None, gbytes: float | None, deprecated: float | None) -> float:
    """The link's GB/s from one of the three spellings (ValueError for two); 400 Gbit/s when none."""
    spellings = (("--link-gbit", gbit), ("--link-gbytes", gbytes), ("--link-gbps", deprecated))
    given = [(n, v) for n, v in spellings if v is not None]
    if len(given) > 1:
        raise ValueError(f"give the link's rate once: {' and '.join(n for n, _ in given)} were given")
    if deprecated is not None:
        console.print("warning: --link-gbps is GB/s (bytes), which reads as Gb/s (bits): use --link-gbytes "
                      f"{deprecated:g}, or --link-gbit {deprecated * 8:g}", highlight=False, style="yellow")
        return deprecated
    return gbytes if gbytes is not None else (400.0 if gbit is None else gbit) / 8


def _unit(values, units) -> tuple[str, float]:
    """The first of ``units`` (name, size; largest first) in which the largest of ``values`` is at least 1,
    else the last: a small model's table in MB and ms instead of rows of 0.000."""
    top = max(values, default=0)
    return next(((n, s) for n, s in units if top >= s), units[-1])


def _count(n: int) -> str:
    """12_300_000_000 -> "12.3 B"; 1.03e12 -> "1.03 T"."""
    return f"{n / 1e12:.3g} T" if n >= 1e12 else f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def _print(r) -> None:
    """One row per figure, a column per path: readable in 80 columns."""
    console.print(f"refit of {r.model}: {_count(r.parameters)} parameters ({_count(r.quantized_parameters)} "
                  f"quantized); trainer {r.trainer} -> {r.engine_replicas} x engine {r.engine}; "
                  f"{r.hardware.link_gbps * 8:g} Gbit/s ({r.hardware.link_gbps:g} GB/s) links",
                  highlight=False)
    t = Table()
    paths = [r.mxfp8, r.bf16_sharded, r.bf16] + ([r.delta] if r.delta else [])
    for col in ("", "MXFP8", "BF16 sharded", "BF16 bcast") + (("MXFP8 delta",) if r.delta else ()):
        t.add_column(col, justify="right" if col else "left", no_wrap=True)
    bytes_unit = _unit([p.wire_bytes for p in paths], (("GB", 1e9), ("MB", 1e6)))
    secs_unit = _unit([p.seconds for p in paths], (("s", 1.0), ("ms", 1e-3)))
    figures = (("wire {}", "wire_bytes", bytes_unit),
               ("{} per trainer rank", "bytes_per_trainer_rank", bytes_unit),
               ("{} per engine rank", "bytes_per_engine_rank", bytes_unit),
               ("gather {}", "gather_seconds", secs_unit), ("quantize {}", "quantize_seconds", secs_unit),
               ("wire {}", "wire_seconds", secs_unit), ("host passes {}", "host_seconds", secs_unit),
               ("refit {}", "seconds", secs_unit))
    for label, key, (unit, scale) in figures:
        t.add_row(label.format(unit), *(f"{getattr(p, key) / scale:.3f}" for p in paths))
    console.print(t)
    console.print(f"predicted refit time over MXFP8's: BF16 sharded {r.speedup_sharded:.2f}x (each engine "
                  f"rank gets its slice, then quantizes); BF16 gather + broadcast {r.speedup:.2f}x",
                  highlight=False)
    if r.delta:
        host = ("quantize, diff and patch included" if r.hardware.host_copy_gbps is not None else
                "quantize included; the diff and patch passes are counted only with --host-copy-gbps (and "
                "--host-diff-gbps / --host-patch-gbps)")
        ratio = f"{r.delta.seconds / r.mxfp8.seconds:.2f}x" if r.mxfp8.seconds else "-"
        console.print(f"MXFP8 delta ({r.delta_fraction:g} of the bytes) over full MXFP8: {ratio} the time "
                      f"({host})", highlight=False)
    for problem in r.problems[:5]:
        console.print(f"[bold red]problem:[/] {problem}", highlight=False)
    if len(r.problems) > 5:
        console.print(f"... and {len(r.problems) - 5} more problem(s) (--json lists all)", highlight=False)
