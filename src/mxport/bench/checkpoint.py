"""Checkpoint-export benchmark: export of a synthetic sharded BF16 safetensors checkpoint to a modelopt MXFP8
checkpoint, against a plain ``safetensors`` load-and-save (``load_file`` + ``save_file`` per shard) of the
same checkpoint.

Each side runs in its own child process (``python -m mxport.bench.checkpoint``) so that its peak RSS
(``VmHWM``) is its own: one warm-up run, then ``runs`` timed runs; the child reports the median. Rows:

* ``export throughput`` — GB/s of input (source tensor bytes / median seconds); baseline: the plain copy's
  GB/s; ratio = export / copy (goal >= 0.5).
* ``export vs quantize alone`` — the same GB/s against :func:`mxport.quantize` alone on the same tensors
  (chunked as export does, reads not timed): the compute bound on this machine; ratio = export / quantize.
* ``export peak RSS`` — MB (``VmHWM`` of the child); baseline: the goal's limit, 2 x the largest tensor + 500
  MB; ratio = RSS / limit (goal <= 1). The note gives the plain copy's peak RSS (it holds a whole shard).

Full: 4 tensors of 16384 x 16384 BF16 (2 GiB, one shard each) on the default quantize kernel (native where the
CPU has AVX-512 or AVX2, else compiled when ``torch.compile`` works — its compile time is in the warm-up),
5 runs after 1 warm-up. Quick: 4 tensors of 1024 x 2048 (16 MiB) with ``torch.compile`` off (native kernel
where available, else eager; no warm-up run: the copy child has already warmed the page cache), 2 runs, no
``quantize alone`` row.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARK = "checkpoint"
FULL = (4, 16384, 16384)
QUICK = (4, 1024, 2048)


def _row(metric, value, unit, baseline, ratio, goal, note=""):
    return {"benchmark": BENCHMARK, "metric": metric, "value": float(value), "baseline": baseline,
            "ratio": float(ratio), "unit": unit, "goal": goal, "note": note}


def make_synthetic(path: Path, n: int, rows: int, cols: int) -> tuple[int, int]:
    """Write ``n`` BF16 [rows, cols] linear weights (one shard each, with an index) + config; return
    (total tensor bytes, largest tensor bytes). Memory: one tensor at a time."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i in range(n):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        x = torch.empty(rows, cols, dtype=torch.bfloat16)
        for r0 in range(0, rows, 1024):  # fill in blocks: the parent stays small (children measure their RSS)
            x[r0:r0 + 1024] = torch.randn(min(1024, rows - r0), cols, generator=gen)
        f = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({name: x}, str(path / f), metadata={"format": "pt"})
        weight_map[name] = f
        total += x.numel() * 2
        del x
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": n}))
    return total, rows * cols * 2


def _plain_copy(src: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in sorted(src.glob("*.safetensors")):
        save_file(load_file(str(f)), str(out / f.name), metadata={"format": "pt"})
    for f in ("model.safetensors.index.json", "config.json"):
        shutil.copy2(src / f, out / f)


def _peak_rss() -> int:
    """This process's peak RSS in bytes.

    ``VmHWM`` from /proc/self/status (per address space, so it starts afresh at exec), else ``ru_maxrss``
    (which on Linux keeps the parent's peak at fork across exec)."""
    from .timing import peak_rss_bytes, proc_kib_bytes

    hwm = proc_kib_bytes("/proc/self/status", "VmHWM")
    return hwm if hwm is not None else peak_rss_bytes()


def _child(mode: str, src: str, scratch: str, runs: int, warmup: int) -> dict:
    """Run ``mode`` ("export" | "copy" | "quantize") warmup + runs times; return the median seconds and this
    process's peak RSS."""

    if mode == "export":
        import torch

        from ..checkpoint.export import export_checkpoint
        from ..quantize import kernel_label

        def once(out):
            export_checkpoint(src, out, max_shard_size="1GB")
        path = kernel_label(torch.empty(64, 4096))
    elif mode == "quantize":
        from ..checkpoint.export import CHUNK_NUMEL
        from ..checkpoint.readers import SafetensorsDir
        from ..quantize import quantize

        reader = SafetensorsDir(src)
        total = [0.0]

        def once(out):  # only the quantize calls are timed (reads excluded), chunked as export does
            out.mkdir()
            for name in reader.names():
                for rows in reader.iter_rows(name, CHUNK_NUMEL):
                    t0 = time.perf_counter()
                    quantize(rows)
                    total[0] += time.perf_counter() - t0
        path = "quantize only"
    else:
        def once(out):
            _plain_copy(Path(src), out)
        path = "safetensors"
    times = []
    for i in range(warmup + runs):
        out = Path(scratch) / f"{mode}-{i}"
        t0 = time.perf_counter()
        once(out)
        dt = time.perf_counter() - t0
        if mode == "quantize":
            dt, total[0] = total[0], 0.0
        shutil.rmtree(out)
        if i >= warmup:
            times.append(dt)
    return {"median": statistics.median(times), "times": times, "peak_rss": _peak_rss(), "path": path}


def _run_child(mode: str, src: Path, scratch: Path, runs: int, warmup: int, eager: bool) -> dict:
    env = dict(os.environ)
    if eager:
        env["MXPORT_DISABLE_COMPILE"] = "1"
    cmd = [sys.executable, "-m", "mxport.bench.checkpoint", mode, str(src), str(scratch), str(runs),
           str(warmup)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} child failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    """Run the checkpoint-export benchmark; rows as in the module docstring. ``quick=True``: 16 MiB, eager,
    2 runs (~15 s here)."""
    n, rows, cols = QUICK if quick else FULL
    runs, warmup = (2, 0) if quick else (5, 1)
    base = Path(tempfile.mkdtemp(prefix="mxport-bench-ckpt-"))
    try:
        src = base / "src"
        total, largest = make_synthetic(src, n, rows, cols)
        copy = _run_child("copy", src, base, runs, warmup, eager=quick)
        exp = _run_child("export", src, base, runs, warmup, eager=quick)
        qonly = None if quick else _run_child("quantize", src, base, runs, warmup, eager=quick)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gb = total / 1e9
    exp_gbs, copy_gbs = gb / exp["median"], gb / copy["median"]
    limit = 2 * largest + 500 * 10**6
    size = f"{n} x [{rows}, {cols}] bf16 = {total / 2**20:.0f} MiB"
    rows = [
        _row("export throughput", exp_gbs, "GB/s", f"plain safetensors load+save {copy_gbs:.2f} GB/s",
             exp_gbs / copy_gbs, ">= 0.5",
             f"{size}; modelopt; quantize path {exp['path']}; median of {runs} after {warmup} warm-up; "
             f"export {exp['median']:.2f} s vs copy {copy['median']:.2f} s"),
        _row("export peak RSS", exp["peak_rss"] / 1e6, "MB",
             f"2 x largest tensor + 500 MB = {limit / 1e6:.0f} MB", exp["peak_rss"] / limit, "<= 1.0",
             f"child process VmHWM (includes torch); plain copy peak RSS {copy['peak_rss'] / 1e6:.0f} MB"),
    ]
    if qonly is not None:
        rows.insert(1, _row("export vs quantize alone", exp_gbs, "GB/s",
                            f"quantize() alone on the same tensors {gb / qonly['median']:.2f} GB/s",
                            qonly["median"] / exp["median"], "-",
                            "how close the export gets to its compute bound "
                            "(reads, writes, scales are the rest)"))
    return rows


if __name__ == "__main__":
    mode, src_arg, scratch_arg, runs_arg, warm_arg = sys.argv[1:6]
    print(json.dumps(_child(mode, src_arg, scratch_arg, int(runs_arg), int(warm_arg))))
