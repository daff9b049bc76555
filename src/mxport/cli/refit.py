"""``mxport refit``: train a model and sync its MXFP8 weights into running inference processes, step by step."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ._choices import positive
from ._common import EXIT_CHECK_FAILED, console, emit_json, fail, json_to_stdout, require, user_errors
from .app import app

MAX_RECEIVERS = 8


def default_bucket_mb() -> int:
    """Bucket size for this machine: 32 MiB when there are >= 8 GiB of RAM, else 8 MiB (several buckets for a
    135M-parameter model so packing overlaps sending, few enough to keep per-bucket overhead small)."""
    try:
        import os

        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    return 32 if ram >= 8 << 30 else 8


def summarize_step(s: dict) -> dict:
    """One JSON step: the issue's keys (``step``, ``bytes``, ``seconds``, ``gbps``, ``gen_kl_error``,
    ``bit_exact``, ``pointers_stable``) first, then the time split and per-receiver details."""
    recv = s["receivers"]
    return {
        "step": s["step"], "bytes": s["bytes"], "seconds": s["seconds"], "gbps": s["gbps"],
        "gen_kl_error": max(r["gen_kl_error"] for r in recv),
        "bit_exact": all(r["bit_exact"] for r in recv),
        "pointers_stable": all(r["pointers_stable"] for r in recv),
        "version": s["version"], "loss": s["loss"], "buckets": s["buckets"],
        "train_s": s["train_s"], "quantize_s": s["quantize_s"], "pack_s": s["pack_s"],
        "checksum_s": s["checksum_s"], "send_s": s["send_s"],
        "commit_s": max(r["commit_s"] for r in recv),
        "greedy_agreement": min(r["greedy_agreement"] for r in recv),
        "receivers": recv,
    }


@app.command()
def refit(
    source: str = typer.Argument(None, metavar="SOURCE", help="HF model directory or .gguf (default: the embedded "
                                                                "SmolLM2-135M)."),
    steps: int = typer.Option(3, "--steps", min=1, help="Training steps, each followed by one refit."),
    bucket_mb: float = typer.Option(None, "--bucket-mb", max=4096, callback=positive,
                                    help="Bucket size in MiB (default: sized for the machine)."),
    receivers: int = typer.Option(1, "--receivers", min=1, max=MAX_RECEIVERS, help="Inference processes."),
    json_out: str = typer.Option(None, "--json", metavar="FILE|-", help="Write {'steps': [...], 'plan': ..., "
                                                                        "'ok': ...} to FILE ('-': stdout)."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1,
                                       help="Tokens each inference process generates per step."),
    lr: float = typer.Option(1e-5, "--lr", callback=positive, help="AdamW learning rate of the trainer."),
    timeout: float = typer.Option(120.0, "--timeout", callback=positive,
                                  help="Seconds a refit may wait on a peer before failing."),
):
    """Train and refit: a trainer process and R inference processes on loopback gloo.

    Each step the trainer (float32 master weights) takes an AdamW step on a text batch, quantizes the linear
    weights to MXFP8 (default precision policy) straight into its send buffer and broadcasts it in byte buckets;
    each inference process (its model converted once to MXFP8Linear, its weights moved once into one arena)
    receives the buckets in place, validates their checksums (restoring the previous weights on any failure), and
    generates.

    Per step: bytes, seconds (the trainer's whole send -- quantizing bucket by bucket while earlier buckets are on
    the wire, checksums, transfer -- plus the slowest receiver's commit; quant s is the part spent quantizing),
    GB/s, gen_kl_error (trainer vs inference log-probs on the generated tokens, worst receiver), bit_exact (the
    live bytes, re-packed, have the sender's per-bucket checksums and the CRC-32 of the whole stream it sent),
    pointers_stable.

    JSON (--json): {"steps": [{"step", "bytes", "seconds", "gbps", "gen_kl_error", "bit_exact",
    "pointers_stable", ...}], "plan": {...}, "model": ..., "ok": bool}.

    Exit 0 on success; 1 if a step is not bit-exact, pointers moved, or a process failed; 2 on bad input.
    """
    json_to_stdout(json_out)
    from ..refit.plan import ALIGN

    with user_errors():
        require("transformers")  # every process loads the model with it
        mb = default_bucket_mb() if bucket_mb is None else bucket_mb
        bucket_bytes = max(ALIGN, int(mb * (1 << 20)) // ALIGN * ALIGN)
        from ..models import resolve_source

        with console.status("resolving the model (the embedded model is converted once, ~25 s)"):
            src = resolve_source(source)
        if src.kind == "gguf":
            require("gguf", "accelerate")
        # each process loads the model itself: a GGUF is dequantized by transformers in every process (slow)
        model_path = str(src.path / src.gguf_file) if src.kind == "gguf" else str(src.path)
    from ..refit.demo import DemoConfig, DemoFailed, run_demo

    log_dir = tempfile.mkdtemp(prefix="mxport-refit-")
    cfg = DemoConfig(source=model_path, steps=steps, bucket_bytes=bucket_bytes, receivers=receivers,
                     max_new_tokens=max_new_tokens, lr=lr, timeout_s=timeout, log_dir=log_dir)
    rows: list[dict] = []
    t0 = time.perf_counter()
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(), console=console)
    with progress:
        task = progress.add_task(f"starting trainer + {receivers} inference process(es) on {src.label}",
                                 total=steps)

        def on_event(kind: str, rank: int, payload) -> None:
            if kind == "plan":
                progress.update(task, description=f"plan: {payload['tensors']} tensors, "
                                f"{payload['bytes'] / 1e6:.1f} MB in {payload['buckets']} buckets; step 1 ...")
            elif kind == "step":
                row = summarize_step(payload)
                rows.append(row)
                progress.update(task, advance=1, description=(
                    f"step {row['step']}: {row['seconds']:.2f} s, {row['gbps']:.2f} GB/s, "
                    f"gen_kl {row['gen_kl_error']:.2e}, bit_exact {row['bit_exact']}"))

        try:
            result = run_demo(cfg, on_event, timeout_s=max(600.0, timeout * (steps + 4)))
        except DemoFailed as exc:
            raise fail(f"{exc}\n(process logs: {log_dir})", EXIT_CHECK_FAILED) from None
    shutil.rmtree(log_dir, ignore_errors=True)
    ok = bool(rows) and all(r["bit_exact"] and r["pointers_stable"] for r in rows)
    out = {"model": src.label, "receivers": receivers, "bucket_bytes": bucket_bytes, "plan": result["plan"],
           "steps": rows, "ok": ok, "seconds": time.perf_counter() - t0,
           "median_refit_seconds": statistics.median(r["seconds"] for r in rows) if rows else None}
    emit_json(out, json_out)
    table = Table(title=f"mxport refit {src.label} ({receivers} receiver(s), {bucket_bytes / (1 << 20):g} MiB buckets)")
    for col in ("step", "loss", "MB", "refit s", "GB/s", "quant s", "gen_kl", "exact", "ptrs"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(str(r["step"]), f"{r['loss']:.3f}", f"{r['bytes'] / 1e6:.1f}", f"{r['seconds']:.3f}",
                      f"{r['gbps']:.2f}", f"{r['quantize_s']:.3f}", f"{r['gen_kl_error']:.2e}",
                      "yes" if r["bit_exact"] else "[red]NO[/]", "same" if r["pointers_stable"] else "[red]MOVED[/]")
    console.print(table)
    if rows:
        console.print(f"generated (receiver 1, last step): {rows[-1]['receivers'][0]['text']!r}", highlight=False)
    if not ok:
        raise fail("refit check failed: a step was not bit-exact or buffer pointers moved", EXIT_CHECK_FAILED)
