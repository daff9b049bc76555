"""The refit benchmark's rows (from given timings; the timed run itself is `mxport bench --only refit`)."""

import pytest

from mxport.bench import check_row
from mxport.bench.refit import rows_from


def test_rows_from_timings():
    res = {"bytes": 1_000_000_000, "buckets": 30, "tensors": 482,
           "refit_s": [0.5, 0.4, 0.6], "commit_s": [0.1, 0.1, 0.2], "raw_s": [0.2, 0.25, 0.3],
           "nosum_s": [0.3, 0.35, 0.4],
           "e2e": [{"seconds": 2.0, "quantize_s": 1.0, "pack_s": 0.2, "unpack_s": 0.3},
                   {"seconds": 2.2, "quantize_s": 1.2, "pack_s": 0.2, "unpack_s": 0.3},
                   {"seconds": 1.8, "quantize_s": 0.8, "pack_s": 0.2, "unpack_s": 0.3}]}
    rows = {r["metric"]: check_row(r, "refit") for r in rows_from(res, "test")}
    thr = rows["refit throughput"]
    assert thr["value"] == pytest.approx(1e9 / 0.5 / 1e9) and thr["ratio"] == pytest.approx(0.25 / 0.5)
    assert rows["refit throughput before commit"]["ratio"] == pytest.approx(0.25 / 0.4)
    assert rows["raw broadcast throughput"]["value"] == pytest.approx(4.0)
    assert rows["refit throughput, checksums off"]["ratio"] == pytest.approx(0.25 / 0.35)
    assert rows["end-to-end refit step"]["value"] == pytest.approx(2.0)
    split = [rows[f"e2e split: {k}"]["value"] for k in ("quantize", "pack", "transfer", "unpack")]
    assert split == pytest.approx([1.0, 0.2, 0.5, 0.3])  # transfer = the remainder of the median step
    assert sum(rows[f"e2e split: {k}"]["ratio"] for k in ("quantize", "pack", "transfer", "unpack")) == \
        pytest.approx(1.0)


def test_baseline_rows():
    res = {"bytes": 1_000, "buckets": 1, "tensors": 3, "refit_s": [0.5], "commit_s": [0.1], "raw_s": [0.2],
           "nosum_s": [0.3], "bf16_s": [1.5], "bf16_bytes": 1_900, "engine_s": [6.0], "raw_buckets_s": [0.4],
           "e2e": [{"seconds": 2.0, "quantize_s": 1.0, "pack_s": 0.2, "unpack_s": 0.3}]}
    rows = {r["metric"]: check_row(r, "refit") for r in rows_from(res, "test")}
    assert rows["end-to-end vs BF16 + receiver quantize"]["ratio"] == pytest.approx(0.75)
    assert rows["end-to-end vs BF16 + engine's own quantize"]["ratio"] == pytest.approx(3.0)
    assert rows["refit throughput vs bucketed raw broadcast"]["ratio"] == pytest.approx(0.8)
    del res["engine_s"]
    assert "end-to-end vs BF16 + engine's own quantize" not in {r["metric"] for r in rows_from(res, "t")}


def test_bf16_baseline_casts_inside_its_step():
    """The BF16 baseline's payload holds every tensor as it travels in BF16; its refresh re-casts the float32
    master weights (the trainer's cost of sending BF16), and BF16 ones are sent as they are."""
    import torch

    from mxport.bench.refit import _bf16_stream
    from mxport.refit import TrainerSource

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.LayerNorm(32))
    model[0].to(torch.bfloat16)
    src = TrainerSource(model, kept_dtype=torch.bfloat16)
    buf, refresh = _bf16_stream(src)
    parts = [t.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8) for _, t in src.tensors_by_name]
    assert torch.equal(buf, torch.cat(parts))
    with torch.no_grad():
        model[1].weight.add_(1.0)  # float32: re-cast by refresh
    refresh()
    parts = [t.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8) for _, t in src.tensors_by_name]
    assert torch.equal(buf, torch.cat(parts))


def test_a_worker_that_dies_fails_the_benchmark_at_once(tmp_path):
    """A worker that exits without reporting (here: a caller's unguarded ``__main__`` under spawn, so the
    children fail while bootstrapping) fails ``measure_refit`` naming its exit code, instead of waiting out
    the whole timeout (it used to hang for ``timeout_s``)."""
    import subprocess
    import sys
    import time

    script = tmp_path / "unguarded.py"
    script.write_text("from mxport.bench.refit import measure_refit\n"
                      "measure_refit(model=False, layers=1, runs=1, warmup=0, engine=False, timeout_s=600)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert "exited with code 1 without reporting" in proc.stderr
    assert time.monotonic() - t0 < 200  # far below the 600 s timeout it would wait without the check


def test_end_to_end_goals_follow_the_model(monkeypatch):
    """Issue 26's goals: the BF16 baseline row asks >= 1.5 on the embedded model and >= 1.7 at ~1 GB; the full
    run adds the ~1 GB rows with a suffix, or one skipped row naming the memory it lacks."""
    import mxport.bench.refit as br

    res = {"bytes": 1_000, "buckets": 1, "tensors": 3, "refit_s": [0.5], "commit_s": [0.1], "raw_s": [0.2],
           "nosum_s": [0.3], "bf16_s": [1.5], "bf16_bytes": 1_900,
           "e2e": [{"seconds": 1.0, "quantize_s": 0.5, "pack_s": 0.1, "unpack_s": 0.1}]}
    goal = {r["metric"]: r["goal"] for r in rows_from(res, "t")}
    assert goal["end-to-end vs BF16 + receiver quantize"] == "ratio >= 1.5"
    monkeypatch.setattr(br, "measure_refit", lambda **kw: res)
    monkeypatch.setattr(br, "_available_memory", lambda: br.LARGE_MEMORY)
    large = {r["metric"]: r for r in br.large_rows()}
    assert set(large) == {f"{m}, ~1 GB model" for m in br.LARGE_ROWS}
    assert large["end-to-end vs BF16 + receiver quantize, ~1 GB model"]["goal"] == "ratio >= 1.7"
    assert large["end-to-end vs BF16 + receiver quantize, ~1 GB model"]["ratio"] == pytest.approx(1.5)
    monkeypatch.setattr(br, "_available_memory", lambda: br.LARGE_MEMORY - 1)
    (skipped,) = br.large_rows()
    assert skipped["metric"] == "skipped" and "GiB of available memory" in skipped["note"]


def test_refit_vllm_rows_report_the_workers_buffers_against_their_bounds():
    """Issue 27's memory goals as rows: host bytes per worker over its slice (<= 1), device buffers over the
    bucket size (<= 2: the eager receive's ring)."""
    from mxport.bench.refit_vllm import rows_from as vllm_rows

    worker = {"slice_bytes": 1000, "host_bytes": 1000, "buffer_bytes": 64, "apply_s": 0.01,
              "apply_paths": {"in_place": 3}, "seconds": 0.125, "attest_s": 0.02}
    res = {"seconds": [0.5, 0.2, 0.3], "raw_s": 0.1, "bytes": 1000, "workers": [worker, worker], "tp": 2,
           "bucket_bytes": 32, "trainer": {"produce_s": 0.07, "pack_s": 0.03, "checksum_s": 0.005}}
    rows = {r["metric"]: check_row(r, "refit_vllm") for r in vllm_rows(res, "t")}
    assert rows["refit into vLLM (t)"]["ratio"] == pytest.approx(0.1 / 0.25)  # the first refit warms up
    assert ("trainer quantize 0.070 s, pack 0.030 s, checksum 0.005 s; worker receive 0.125 s, "
            "apply 0.010 s, attest 0.020 s") in rows["refit into vLLM (t)"]["note"]
    assert rows["host bytes per worker (t)"]["ratio"] == pytest.approx(1.0)
    dev = rows["device buffer bytes per worker (t)"]
    assert dev["value"] == 64 and dev["ratio"] == pytest.approx(2.0) and dev["goal"] == "ratio <= 2.0"


def test_refit_vllm_delta_rows_compare_with_the_full_refits_of_the_same_run():
    from mxport.bench.refit_vllm import delta_rows

    worker = {"buffer_bytes": 70}
    delta = {"seconds": [0.5, 0.1, 0.3, 0.2], "bytes": 1000, "wire_bytes": 20, "workers": [worker],
             "bucket_bytes": 32}
    full = {"seconds": [0.9, 0.4, 0.4]}
    rows = {r["metric"]: check_row(r, "refit_vllm") for r in delta_rows(delta, full, "t")}
    timed = rows["delta refit into vLLM (t)"]
    assert timed["value"] == pytest.approx(0.2) and timed["ratio"] == pytest.approx(0.5)  # medians, first out
    dev = rows["device buffer bytes per worker, delta refits (t)"]
    assert dev["ratio"] == pytest.approx(70 / 32) and dev["goal"] == "ratio <= 2.0"
