"""``mxport bench --only refit_vllm``: a refit into a real vLLM engine through the ``"mxport"`` backend
against a raw gloo broadcast of the same bytes between the same two processes, in the same run; and what
the backend holds per worker beside the engine's own weights; delta refits; at tp=2, what each worker
receives.

Runs where vLLM is installed (``scripts/setup_vllm.sh`` makes ``.venv-vllm``: ``.venv-vllm/bin/mxport bench
--only refit_vllm``); elsewhere one ``skipped`` row says so. The refit time is the demo's step time (vLLM's
``start_weight_update`` to the prefix-cache reset after ``finish_weight_update``: transfer, checks, in-place
writes, re-derivation, attestation), the median of several refits of changing weights.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
from pathlib import Path

BENCHMARK = "refit_vllm"


def _skipped(why: str) -> list[dict]:
    return [{"benchmark": BENCHMARK, "metric": "skipped", "value": 0.0, "baseline": "", "ratio": 0.0,
             "unit": "", "goal": "", "note": why}]


def _large_source(path: Path) -> str:
    """A ~1 GB MXFP8 refit: a random Llama of 1B-class widths (hidden 2048, intermediate 5632, 16 layers)."""
    from ..testing import make_tiny_llama

    return str(make_tiny_llama(path, hidden=2048, intermediate=5632, layers=16, heads=16, kv_heads=4,
                               vocab=32000))


def measure(source: str, *, steps: int, tp: int = 1, bucket_bytes: int = 32 << 20,
            delta: bool = False) -> dict:
    """Refit a vLLM engine (tp workers) on ``source``'s export ``steps`` times (``delta``: delta refits after
    the first, a few weights changed per step); returns the step seconds, the raw broadcast seconds of the
    same bytes, each worker's stats of the last refit and its wire bytes."""
    from ..checkpoint.export import export_checkpoint
    from ..demo.vllm import VllmRefitSession

    with tempfile.TemporaryDirectory(prefix="mxport-bench-vllm-") as tmp:
        mx = str(Path(tmp) / "mx")
        export_checkpoint(source, mx)
        session = VllmRefitSession(source, mx, timeout_s=300, bucket_bytes=bucket_bytes, tp=tp, delta=delta)
        try:
            seconds = []
            for k in range(1, steps + 1):
                ans = session.refit(k)
                if not ans.get("ok"):
                    raise RuntimeError(f"refit {k} failed: {ans.get('error')}")
                calls = ans["engine_calls_s"]
                seconds.append(calls["last_call_t"] - calls["first_call_t"])
            nbytes = int(ans["stats"]["bytes"])
            trainer = {k: float(ans["stats"].get(k, 0.0)) for k in ("produce_s", "pack_s", "checksum_s")}
            raw = session.raw_broadcast_s(nbytes, reps=steps)
            workers = session.engine_stats()
        finally:
            session.close_trainer()
    return {"seconds": seconds, "raw_s": raw, "bytes": nbytes, "workers": workers, "tp": tp,
            "bucket_bytes": bucket_bytes, "trainer": trainer, "wire_bytes": int(ans["stats"]["wire_bytes"]),
            "plan_bytes": int(session.plan_summary["bytes"])}


def rows_from(res: dict, label: str) -> list[dict]:
    refit = statistics.median(res["seconds"][1:] or res["seconds"])  # the first refit warms up
    w = res["workers"]
    slice_bytes = max(x["slice_bytes"] for x in w)
    host = max(x["host_bytes"] for x in w)
    device = max(x.get("buffer_bytes", 0) for x in w)
    paths = w[0].get("apply_paths", {})
    tr = res.get("trainer", {})
    note = (f"{label}: {res['bytes'] / 1e6:.1f} MB per refit, tp={res['tp']}, {len(res['seconds'])} refits "
            f"(median of all but the first); apply paths per worker {paths}; where the last refit's time "
            f"went: trainer quantize {tr.get('produce_s', 0):.3f} s, pack {tr.get('pack_s', 0):.3f} s, "
            f"checksum {tr.get('checksum_s', 0):.3f} s; worker receive {max(x['seconds'] for x in w):.3f} s, "
            f"apply {max(x['apply_s'] for x in w):.3f} s, attest {max(x['attest_s'] for x in w):.3f} s")
    return [
        {"benchmark": BENCHMARK, "metric": f"refit into vLLM ({label})", "value": refit,
         "baseline": "raw gloo broadcast of the same bytes between the same processes, same run",
         "ratio": res["raw_s"] / refit, "unit": "s", "goal": "ratio >= 0.5", "note": note},
        {"benchmark": BENCHMARK, "metric": f"host bytes per worker ({label})", "value": host,
         "baseline": "the worker's slice of the refit", "ratio": host / slice_bytes, "unit": "B",
         "goal": "ratio <= 1.0",
         "note": "the backend's host buffers beside the engine's weights: the rollback copy of the worker's "
                 "slice (eager receive) plus the checkpoint copies of layers re-derived by the dequant / "
                 "layerwise paths"},
        {"benchmark": BENCHMARK, "metric": f"device buffer bytes per worker ({label})", "value": device,
         "baseline": "the refit's bucket size", "ratio": device / res["bucket_bytes"], "unit": "B",
         "goal": "ratio <= 2.0",
         "note": "what the backend holds on the engine's device beside its weights: the ring of bucket "
                 "buffers the broadcasts land in (two with inflight=1); on CPU the device is the host"},
    ]


def delta_rows(res: dict, full: dict, label: str) -> list[dict]:
    """Delta refits into vLLM against the full refits of the same run (``full``: :func:`measure`'s), and the
    device buffers a delta refit holds per worker (patched in the ring, its payload in one of its buffers
    when it fits)."""
    delta = statistics.median(res["seconds"][1:])  # the first refit goes whole
    refit = statistics.median(full["seconds"][1:] or full["seconds"])
    device = max(x.get("buffer_bytes", 0) for x in res["workers"])
    note = (f"{label}: {res['wire_bytes'] / 1e6:.2f} of {res['bytes'] / 1e6:.1f} MB on the wire per delta "
            f"refit, {len(res['seconds']) - 1} delta refits (median); each worker patches its live weights "
            "bucket by bucket and re-derives the layers whose bytes changed")
    return [
        {"benchmark": BENCHMARK, "metric": f"delta refit into vLLM ({label})", "value": delta,
         "baseline": "full refit into vLLM, same run", "ratio": delta / refit, "unit": "s", "goal": "",
         "note": note},
        {"benchmark": BENCHMARK, "metric": f"device buffer bytes per worker, delta refits ({label})",
         "value": device, "baseline": "the refit's bucket size", "ratio": device / res["bucket_bytes"],
         "unit": "B", "goal": "ratio <= 2.0",
         "note": "the ring of bucket buffers (the payload lands in one of them when it fits)"},
    ]


def _tp_source(path: Path) -> str:
    """A ~180 MB refit (MXFP8 projections, BF16 vocabulary layers) whose heads split two ways (the embedded
    model's 9 do not)."""
    from ..testing import make_tiny_llama

    return str(make_tiny_llama(path, hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=4,
                               vocab=32000))


def tp_rows(res: dict, label: str) -> list[dict]:
    """What each tensor-parallel worker receives against its share of the model (the whole plan over tp:
    projections are cut, norms whole on every worker), plus :func:`rows_from`'s rows."""
    share = res["plan_bytes"] / res["tp"]
    got = [int(x["bytes"]) for x in res["workers"]]
    return [*rows_from(res, label),
            {"benchmark": BENCHMARK, "metric": f"bytes received per worker ({label})", "value": max(got),
             "baseline": f"the refit's bytes / tp ({share / 1e6:.1f} MB)", "ratio": max(got) / share,
             "unit": "B", "goal": "ratio <= 1.05",
             "note": f"per worker {[round(g / 1e6, 2) for g in got]} MB of {res['plan_bytes'] / 1e6:.1f} MB: "
                     "each receives its own slice, straight from the trainer"}]


def run(quick: bool = False) -> list[dict]:
    """The embedded model (and with ``quick`` False, a ~1 GB model) refitted into vLLM at tp=1."""
    if importlib.util.find_spec("vllm") is None:
        return _skipped("needs vLLM: bash scripts/setup_vllm.sh, then .venv-vllm/bin/mxport bench --only "
                        "refit_vllm")
    from ..models import default_model_dir

    label = "embedded SmolLM2-135M"
    full = measure(str(default_model_dir()), steps=4 if quick else 6)
    rows = rows_from(full, label)
    if not quick:
        rows += delta_rows(measure(str(default_model_dir()), steps=5, delta=True), full, label)
        with tempfile.TemporaryDirectory(prefix="mxport-bench-large-") as tmp:
            src = _large_source(Path(tmp) / "bf16")
            rows += rows_from(measure(src, steps=4), "~1 GB random Llama")
        with tempfile.TemporaryDirectory(prefix="mxport-bench-tp-") as tmp:
            res = measure(_tp_source(Path(tmp) / "bf16"), steps=4, tp=2)
            rows += tp_rows(res, "~180 MB random Llama, tp=2")
    return rows
