"""``mxport bench --only refit_delta``: delta refit against full refit of the same training run, in the same
run: ``mxport refit``'s processes on the embedded model (a trainer taking real AdamW steps, one engine
process), once sending every step whole and once with ``--delta``, at lr 1e-6 and 1e-5.

Rows: the bytes a delta step sends over the full MXFP8 refit's (the worst step after the first), the delta
refit's time over the full refit's (medians of the steps after the first; both include the trainer's
quantize), the trainer's delta cost (diff + encode) over its quantize, bit-exact steps, and the sender's host
memory for the base (the version the engines hold) over the stream's bytes."""

from __future__ import annotations

import statistics

BENCHMARK = "refit_delta"


def _source() -> str:
    from ..models import resolve_source

    src = resolve_source(None)
    return str(src.path / src.gguf_file) if src.kind == "gguf" else str(src.path)


def run_steps(lr: float, steps: int, delta: bool, bucket_bytes: int = 32 << 20) -> list[dict]:
    """The JSON steps of one ``mxport refit`` run on the embedded model."""
    from ..demo.single import DemoConfig, run_demo

    cfg = DemoConfig(source=_source(), steps=steps, bucket_bytes=bucket_bytes, lr=lr, delta=delta,
                     max_new_tokens=2)
    return run_demo(cfg)["steps"]


def _row(metric, value, baseline, ratio, unit, goal, note="") -> dict:
    return {"benchmark": BENCHMARK, "metric": metric, "value": value, "baseline": baseline, "ratio": ratio,
            "unit": unit, "goal": goal, "note": note}


def rows_from(full: list[dict], delta: list[dict], delta_hi: list[dict], bucket_bytes: int) -> list[dict]:
    """The rows from a full run and a delta run at lr 1e-6 and a delta run at lr 1e-5 (see the module doc)."""
    after = delta[1:]
    worst = max(s["bytes"] / s["full_bytes"] for s in after)
    worst_hi = max(s["bytes"] / s["full_bytes"] for s in delta_hi[1:])
    t_full = statistics.median(s["seconds"] for s in full[1:])
    t_delta = statistics.median(s["seconds"] for s in after)
    cost = statistics.median(s["delta_s"] / s["quantize_s"] for s in after)
    exact = [s["bit_exact"] for s in (*full, *delta, *delta_hi)]
    stream = after[0]["full_bytes"]
    scratch = 6 * bucket_bytes // 5 + bucket_bytes  # the native diff's index, masks and bytes
    blocks = [s["blocks_changed"] for s in after]
    return [
        _row("delta bytes / full MXFP8 bytes, lr 1e-6 (worst step after the first)", worst,
             "full refit bytes", worst, "x", "<= 0.05",
             f"{len(after)} delta steps; MXFP8 blocks changed {min(blocks):.2%}-{max(blocks):.2%}"),
        _row("delta bytes / full MXFP8 bytes, lr 1e-5 (worst step after the first)", worst_hi,
             "full refit bytes", worst_hi, "x", "<= 0.15"),
        _row("delta refit time / full refit time (median, quantize included)", t_delta, "full refit s",
             t_delta / t_full, "s", "<= 0.3", f"full {t_full:.3f} s, delta {t_delta:.3f} s on loopback gloo"),
        _row("trainer delta cost (diff + encode) / quantize (median)", cost, "quantize s", cost, "x",
             "<= 1.2"),
        _row("bit-exact steps", sum(exact) / len(exact), "every step", sum(exact) / len(exact), "fraction",
             "1.0", f"{len(exact)} steps in three runs"),
        _row("sender host memory for the base / stream bytes", (stream + scratch) / stream, "stream bytes",
             (stream + scratch) / stream, "x", "", f"base {stream / 1e6:.1f} MB + diff scratch "
             f"{scratch / 1e6:.1f} MB"),
    ]


def run(quick: bool = False) -> list[dict]:
    steps = 4 if quick else 10
    full = run_steps(1e-6, steps, False)
    delta = run_steps(1e-6, steps, True)
    delta_hi = run_steps(1e-5, steps, True)
    return rows_from(full, delta, delta_hi, 32 << 20)
