"""A refit into a real vLLM engine through the "mxport" backend against vLLM's own ``reload_weights`` of an
export of the same weights, in one run, on one engine.

Per step k (the harness trainer's seeded perturbation of the source, step 0 = the source): mxport's refit as
``mxport refit --engine vllm`` times it (vLLM's ``start_weight_update`` to the prefix-cache reset after
``finish_weight_update``: quantize + send + validate + layerwise reload), then vLLM's
``reload_weights(weights_path=<mxport export of the step-k weights>, is_checkpoint_format=True)`` plus
``reset_prefix_cache`` (the export is written before the timing, so it reads from the page cache). Both leave
the engine on the same bytes (checked every step). Medians over the steps after the first (warm-up).

Usage (in the vLLM environment, scripts/setup_vllm.sh): ``.venv-vllm/bin/python benchmarks/bench_vllm_refit.py
[SOURCE] [--steps N] [--json FILE]``; SOURCE defaults to the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def run(source: str | None = None, steps: int = 5) -> dict:
    import torch

    from mxport.checkpoint.export import export_checkpoint
    from mxport.demo import vllm as h
    from mxport.models import default_model_dir

    src = str(source or default_model_dir())
    rows = []
    with tempfile.TemporaryDirectory(prefix="mxport-bench-vllm-") as tmp:
        out = Path(tmp)
        export_checkpoint(src, out / "step0-mx")
        exports = {k: h.export_step(src, k, out) for k in range(1, steps + 1)}
        session = h.VllmRefitSession(src, str(out / "step0-mx"), timeout_s=120, bucket_bytes=32 << 20)
        try:
            for k in range(1, steps + 1):
                ans = session.refit(k)
                if not ans.get("ok"):
                    raise RuntimeError(f"refit {k} failed: {ans.get('error')}")
                calls = ans["engine_calls_s"]
                ours = h.engine_tensors(session.llm)
                t0 = time.perf_counter()
                session.llm.collective_rpc("reload_weights", kwargs={"weights_path": exports[k],
                                                                      "is_checkpoint_format": True})
                session.llm.reset_prefix_cache()
                reload_s = time.perf_counter() - t0
                theirs = h.engine_tensors(session.llm)
                same = ours.keys() == theirs.keys() and all(
                    torch.equal(ours[n].view(torch.uint8), theirs[n].view(torch.uint8)) for n in ours)
                rows.append({"step": k, "refit_s": calls["last_call_t"] - calls["first_call_t"],
                             "transfer_s": ans["stats"]["seconds"],
                             "apply_s": float(session.engine_stats().get("apply_s", 0.0)),
                             "reload_weights_s": reload_s, "same_bytes": same,
                             "bytes": ans["stats"]["bytes"]})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            session.close_trainer()
    timed = rows[1:] or rows
    med = {key: statistics.median(r[key] for r in timed)
           for key in ("refit_s", "transfer_s", "apply_s", "reload_weights_s")}
    return {"source": src, "steps": rows, "medians": med, "ratio_reload_over_refit":
            med["reload_weights_s"] / med["refit_s"], "all_same_bytes": all(r["same_bytes"] for r in rows)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    result = run(args.source, args.steps)
    m = result["medians"]
    print(f"medians over steps 2..{args.steps}: mxport refit {m['refit_s']:.3f} s (transfer "
          f"{m['transfer_s']:.3f} s, apply {m['apply_s']:.3f} s); vLLM reload_weights "
          f"{m['reload_weights_s']:.3f} s; reload / refit {result['ratio_reload_over_refit']:.2f}x; "
          f"same bytes every step: {result['all_same_bytes']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
