"""mxport.bench.refit_sharded (benchmarks/bench_refit_sharded.py, `mxport bench --only refit_sharded`): its
tiniest run (real processes, gloo on loopback, a few seconds) gives
every JSON key, bit-exact bytes on the engine for both paths, and the exact MXFP8 byte count per engine rank
(< 0.6 of the baseline's BF16); its layouts cut the synthetic model as FSDP2 and vLLM do. No timing asserts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_refit_sharded.py"


def _module():
    from mxport.bench import refit_sharded

    return refit_sharded


def test_layouts_cut_the_model_as_fsdp2_and_vllm_tensor_parallel():
    b = _module()
    size = b.Size(layers=1, hidden=256, ffn=512)
    (up, up_shape), (down, down_shape) = b.weights(size)
    assert (up_shape, down_shape) == ((512, 256), (256, 512))
    assert [b.trainer_rows(up_shape, t, 4) for t in range(4)] == [(0, 128), (128, 256), (256, 384),
                                                                    (384, 512)]
    # engine tp=2: up_proj (column parallel) splits rows, down_proj (row parallel) splits K
    assert [str(b.engine_box(up, up_shape, e, 2)) for e in range(2)] == ["[0:256,0:256]",
                                                                         "[256:512,0:256]"]
    assert [str(b.engine_box(down, down_shape, e, 2)) for e in range(2)] == ["[0:256,0:256]",
                                                                             "[0:256,256:512]"]
    scales = {h.tensor.name: str(h.box) for h in b.engine_holdings(size, 1, 2)}
    assert scales[down + "_scale"] == "[0:256,8:16]" and scales[up + "_scale"] == "[256:512,0:8]"
    held = {h.tensor.name: str(h.box) for h in b.trainer_holdings(size, 1, 2)}
    assert held[up] == "[256:512,0:256]" and held[down + "_scale"] == "[128:256,0:16]"
    # any rank makes the same rows of a weight
    assert b.weight_rows(0, up_shape, 64, 200).equal(b.weight_rows(0, up_shape, 0, 512)[64:200])


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "sharded.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--timeout", "20", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_tiny_run_reports_every_key(tiny_report):
    doc = tiny_report
    assert {"benchmark", "preset", "machine", "cases", "growth", "seconds"} <= set(doc)
    assert doc["benchmark"] == "refit_sharded" and doc["preset"] == "tiny"
    assert [(c["trainers"], c["engines"]) for c in doc["cases"]] == [(2, 1), (2, 1)]
    for c in doc["cases"]:
        assert {"model", "bf16_bytes", "routes", "bit_exact", "mxport", "baseline", "ratio", "bytes_ratio",
                "calibration", "predicted", "load_before", "load_after"} <= set(c)
        assert {"bytes_per_engine_rank", "bytes_total", "seconds", "runs_s", "quantize_s",
                "commit_s"} <= set(c["mxport"])
        assert {"bytes_per_engine_rank", "bytes_total", "gather_bytes", "seconds", "gather_s",
                "quantize_s"} <= set(c["baseline"])
        assert set(c["calibration"]) == {"link_gbps", "shared_gbps", "trainer_quantize_gelems_solo",
                                         "trainer_quantize_gelems_concurrent", "engine_quantize_gelems",
                                         "host_copy_gbps", "host_checksum_gbps", "host_commit_gbps"}
        assert set(c["predicted"]) == {"solo", "concurrent", "host"}
        for p in c["predicted"].values():
            assert {"mxport_s", "baseline_s", "mxport_over_measured", "baseline_over_measured"} <= set(p)
        assert c["bit_exact"] is True  # both paths' engine bytes == quantize of the full tensor
        assert c["routes"] == 2  # one pair stream per trainer rank to the one engine rank
    assert {g["what"] for g in doc["growth"]} == {"size x2"}


def test_mxport_bytes_per_engine_rank_are_exact_and_under_0_6_of_bf16(tiny_report):
    for c in tiny_report["cases"]:
        size = c["size"]
        elements = size["layers"] * 2 * size["hidden"] * size["ffn"]
        mxfp8 = elements + elements // 32  # one FP8 byte per element + one E8M0 byte per block of 32
        assert c["bf16_bytes"] == 2 * elements
        assert c["mxport"]["bytes_per_engine_rank"] == [mxfp8] == [c["mxport"]["bytes_total"]]
        assert c["baseline"]["bytes_per_engine_rank"] == [2 * elements]
        assert c["baseline"]["gather_bytes"] == 2 * elements  # (T - 1) x the model, T = 2
        assert c["mxport"]["bytes_per_engine_rank"][0] < 0.6 * c["baseline"]["bytes_per_engine_rank"][0]
        assert c["bytes_ratio"] == mxfp8 / (2 * elements) == 0.515625
        # the capacity model counts the same bytes
        assert c["predicted"]["solo"]["bytes_per_engine_rank"] == mxfp8
        # and the protocol's host passes over them: each trainer packs its half, the engine rank checksums
        # and commits all (row pieces: no cut, no scatter; pieces under a bucket: no zero-copy bucket)
        assert c["predicted"]["host"]["passes"] == {"pack": mxfp8 // 2, "cut": 0, "sender_checksum": 0,
                                                    "checksum": mxfp8, "commit": mxfp8, "scatter": 0}
        assert c["predicted"]["host"]["mxport_host_s"] > 0 == c["predicted"]["concurrent"]["mxport_host_s"]
