"""The delta benchmark's prediction rows: the capacity model, calibrated by the run, beside the measured
refits (the timed runs themselves are `mxport bench --only refit_delta`)."""

import json

import pytest

from mxport.bench import check_row
from mxport.bench import refit_delta as bench
from mxport.bench.report import goal_met
from mxport.capacity import Hardware, config_entries, predict, read_config
from mxport.parallel import Layout


def test_predicted_rows_calibrate_the_model_by_the_run(tmp_path, monkeypatch):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(bench, "_source_dir", lambda: str(tmp_path))
    step = {"seconds": 0.01, "quantize_s": 0.004, "bytes": 1000, "full_bytes": 1000}
    full = [step, {**step, "seconds": 0.02}, step, {**step, "quantize_s": 0.002}]
    delta = [step, {**step, "bytes": 40}, {**step, "bytes": 20, "seconds": 0.005}, {**step, "bytes": 30}]
    rows = {r["metric"]: check_row(r, "t") for r in bench.predicted_rows(full, delta, 24_000, 8.0, 4.0)}
    hw = Hardware(link_gbps=4.0, trainer_quantize_gelems=24_000 / 0.004 / 1e9, host_copy_gbps=8.0,
                  host_checksum_gbps=4.0)
    want = predict(config_entries(read_config(tmp_path)), Layout(), Layout(), hw, delta_fraction=0.03,
                   direct=True)
    d = rows["delta refit: predicted / measured"]
    assert d["value"] == pytest.approx(want.delta.seconds) and d["ratio"] == pytest.approx(
        want.delta.seconds / 0.01)
    f = rows["full refit: predicted / measured"]
    assert f["value"] == pytest.approx(want.mxfp8.seconds) and f["ratio"] == pytest.approx(
        want.mxfp8.seconds / 0.01)
    assert goal_met({**d, "ratio": 1.1}) is True and goal_met({**d, "ratio": 0.7}) is False
