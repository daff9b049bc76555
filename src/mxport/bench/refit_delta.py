"""``mxport bench --only refit_delta``: delta refit against full refit of the same training run, in the same
run: ``mxport refit``'s processes on the embedded model (a trainer taking real AdamW steps, one engine
process), once sending every step whole and once with ``--delta``, at lr 1e-6 and 1e-5.

Rows: the bytes a delta step sends over the full MXFP8 refit's (the worst step after the first), the delta
refit's time over the full refit's (medians of the steps after the first; both include the trainer's
quantize), the trainer's delta cost (diff + encode) over its quantize, bit-exact steps, and the sender's host
memory for the base (the version the engines hold) over the stream's bytes."""

from __future__ import annotations

import statistics

from ..parallel import Layout

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


def host_rates(nbytes: int, runs: int = 5) -> tuple[float, float]:
    """``(copy, checksum)`` GB/s of this machine's host memory over a buffer of ``nbytes`` (medians of
    ``runs``, after one warm-up): the capacity model's ``host_copy_gbps`` and ``host_checksum_gbps``."""
    import time

    import torch

    from ..refit.buckets import checksum

    src = torch.randint(0, 256, (nbytes // 8 * 8,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s, sum_s = [], []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        checksum(src)
        copy_s.append(t1 - t0)
        sum_s.append(time.perf_counter() - t1)
    return src.numel() / statistics.median(copy_s[1:]) / 1e9, src.numel() / statistics.median(sum_s[1:]) / 1e9


def codec_rates(fraction: float, bucket_bytes: int = 32 << 20, runs: int = 5) -> tuple[float, float]:
    """``(diff, patch)`` GB/s of the delta codec on this machine: the trainer's diff of a bucket against its
    base (stream bytes per second) and the engine's parse + apply of the payload (payload bytes per second),
    for a bucket whose encoded delta is about ``fraction`` of its bytes (one changed byte per changed word,
    as an FP8 element moved by an optimizer step); medians of ``runs`` after one warm-up."""
    import time

    import torch

    from ..refit.stream import delta as dl

    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (bucket_bytes,), dtype=torch.uint8, generator=g)
    words = bucket_bytes // 8
    k = max(1, min(words, int(fraction * bucket_bytes / 6)))  # 4 index + 1 mask + 1 value bytes a word
    where = torch.randperm(words, generator=g)[:k] * 8
    new = base.clone()
    new[where] ^= 1
    diff_s, patch_s, size = [], [], 0
    scratch = dl.Scratch()
    for _ in range(runs + 1):
        b = base.clone()
        t0 = time.perf_counter()
        d = dl.diff_bucket(b, new, scratch)
        t1 = time.perf_counter()
        payload = dl.encode([d], bucket_bytes)
        target = base.clone()
        t2 = time.perf_counter()
        (parsed,) = dl.parse(payload, [bucket_bytes], bucket_bytes)
        dl.apply(parsed, target)
        diff_s.append(t1 - t0)
        patch_s.append(time.perf_counter() - t2)
        size = payload.numel()
    return bucket_bytes / statistics.median(diff_s[1:]) / 1e9, size / statistics.median(patch_s[1:]) / 1e9


def predicted_rows(full: list[dict], delta: list[dict], quantized: int, copy_gbps: float,
                   sum_gbps: float, diff_gbps: float | None = None,
                   patch_gbps: float | None = None) -> list[dict]:
    """:func:`mxport.capacity.predict` of these refits beside the measured ones: the embedded model, one
    trainer rank, one engine (direct receive), calibrated by this run: the trainer's quantize rate
    (``quantized`` elements over the full refits' median ``quantize_s``), the host copy / checksum rates
    (:func:`host_rates`), the loopback link as two host copies (gloo copies into and out of the socket), and
    the delta steps' median ``bytes / full_bytes``, and the codec's rates (:func:`codec_rates`)."""
    from ..capacity import Hardware, config_entries, predict, read_config

    q_s = statistics.median(s["quantize_s"] for s in full[1:])
    f = statistics.median(s["bytes"] / s["full_bytes"] for s in delta[1:])
    hw = Hardware(link_gbps=copy_gbps / 2, trainer_quantize_gelems=quantized / q_s / 1e9,
                  host_copy_gbps=copy_gbps, host_checksum_gbps=sum_gbps, host_diff_gbps=diff_gbps,
                  host_patch_gbps=patch_gbps)
    r = predict(config_entries(read_config(_source_dir())), Layout(), Layout(), hw, delta_fraction=f,
                direct=True)
    t_full = statistics.median(s["seconds"] for s in full[1:])
    t_delta = statistics.median(s["seconds"] for s in delta[1:])
    note = (f"mxport plan's model calibrated here: quantize {hw.trainer_quantize_gelems:.2f} G elements/s, "
            f"host copy {copy_gbps:.1f} GB/s, checksum {sum_gbps:.1f} GB/s, link {hw.link_gbps:.1f} GB/s, "
            f"diff {diff_gbps or 0:.2f} GB/s of stream, patch {patch_gbps or 0:.3f} GB/s of payload, "
            f"delta fraction {f:.4f}")
    return [
        _row("full refit: predicted / measured", r.mxfp8.seconds, f"measured {t_full:.3f} s (median)",
             r.mxfp8.seconds / t_full, "s", "0.75 <= ratio <= 1.25", note),
        _row("delta refit: predicted / measured", r.delta.seconds, f"measured {t_delta:.3f} s (median)",
             r.delta.seconds / t_delta, "s", "0.75 <= ratio <= 1.25", note),
    ]


def _source_dir() -> str:
    from ..models import resolve_source

    return str(resolve_source(None).path)


def run(quick: bool = False) -> list[dict]:
    steps = 4 if quick else 10
    full = run_steps(1e-6, steps, False)
    delta = run_steps(1e-6, steps, True)
    delta_hi = run_steps(1e-5, steps, True)
    copy_gbps, sum_gbps = host_rates(full[0].get("full_bytes", full[0]["bytes"]))
    f = statistics.median(s["bytes"] / s["full_bytes"] for s in delta[1:])
    return (rows_from(full, delta, delta_hi, 32 << 20)
            + predicted_rows(full, delta, _quantized_elements(), copy_gbps, sum_gbps, *codec_rates(f)))


def _quantized_elements() -> int:
    """The embedded model's quantized weight elements (the default precision policy), as the capacity model
    counts them."""
    from ..capacity import config_entries, predict, read_config

    return predict(config_entries(read_config(_source_dir())), Layout(), Layout()).quantized_parameters
