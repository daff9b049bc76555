"""``mxport bench``: the registry, row checks, the quantize benchmark's rows, JSON, plot and exit codes."""

import io
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mxport.bench import BENCHMARKS, ROW_KEYS, check_row, run_benchmark, select
from mxport.bench.quantize import interleaved_medians, quantize_bytes
from mxport.bench.report import throughput_series, write_plot
from mxport.cli import app

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _good_row(**kw):
    row = {"benchmark": "b", "metric": "m", "value": 1.5, "baseline": "x", "ratio": 2.0, "unit": "s",
           "goal": "g"}
    row.update(kw)
    return row


def _assert_rows_finite(rows):
    assert rows
    for r in rows:
        assert set(r) - {"met"} == set(ROW_KEYS), r  # the CLI adds "met" (goal reached: true / false / null)
        assert r.get("met") in (True, False, None), r
        assert math.isfinite(r["value"]) and math.isfinite(r["ratio"]), r
        assert isinstance(r["benchmark"], str) and r["benchmark"] in BENCHMARKS


def test_quantize_bytes_counts_input_output_and_scales():
    assert quantize_bytes(4096 * 4096) == 2 * 4096 * 4096 + 4096 * 4096 + 4096 * 4096 // 32
    assert quantize_bytes(33) == 66 + 33 + 2  # a short last block still has its scale byte


def test_interleaved_medians_calls_each_contender_in_rounds():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    med = interleaved_medians(fns, runs=3, warmup=2)
    assert set(med) == {"a", "b"} and all(v >= 0 for v in med.values())
    assert order == ["a", "b"] * 5  # 2 warm-up rounds then 3 timed rounds, alternating


def test_check_row_accepts_and_normalizes():
    out = check_row(_good_row(value=3), "src")
    assert out["value"] == 3.0 and isinstance(out["value"], float)
    assert out["note"] == ""


@pytest.mark.parametrize("bad", [
    {"value": float("nan")}, {"ratio": float("inf")}, {"value": "1.0"}, {"ratio": True},
])
def test_check_row_rejects_non_finite_or_non_numeric(bad):
    with pytest.raises(ValueError, match="src"):
        check_row(_good_row(**bad), "src")


def test_check_row_rejects_missing_keys():
    row = _good_row()
    del row["baseline"]
    with pytest.raises(ValueError, match="baseline"):
        check_row(row, "src")


def test_select_names_and_unknown():
    assert select(None) == list(BENCHMARKS)
    assert select(["quantize", "quantize"]) == ["quantize"]
    with pytest.raises(ValueError, match="nope"):
        select(["nope"])


def test_missing_module_gives_skipped_row_and_failing_module_gives_error_row(monkeypatch):
    monkeypatch.setitem(BENCHMARKS, "ghost", "mxport.bench._no_such_module_for_test")
    (row,) = run_benchmark("ghost")
    assert row["metric"] == "skipped" and "_no_such_module_for_test" in row["note"]

    broken = types.ModuleType("mxport_test_broken_bench")
    broken.run = lambda quick=False: [_good_row(benchmark="broken", value=float("nan"))]
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    monkeypatch.setitem(BENCHMARKS, "broken", broken.__name__)
    (row,) = run_benchmark("broken")
    assert row["metric"] == "error" and "non-finite" in row["note"]

    def boom(quick=False):
        raise RuntimeError("kaput")

    broken.run = boom
    (row,) = run_benchmark("broken")
    assert row["metric"] == "error" and "kaput" in row["note"]


def test_throughput_series_and_plot(tmp_path):
    rows = [
        check_row(_good_row(benchmark="quantize", metric="throughput 64x64", value=2.0, ratio=4.0), "t"),
        check_row(_good_row(benchmark="quantize", metric="throughput 32x32", value=1.0, ratio=0.0), "t"),
        check_row(_good_row(benchmark="quantize", metric="speed 64x64", value=9.0), "t"),
    ]
    assert throughput_series(rows) == [(1024, 1.0, None), (4096, 2.0, 0.5)]
    out = write_plot(rows, tmp_path / "p.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="throughput"):
        write_plot(rows[2:], tmp_path / "q.png")


def test_cli_bad_flags_exit_2(tmp_path):
    runner = CliRunner()
    assert runner.invoke(app, ["bench", "--only", "nope"]).exit_code == 2
    assert runner.invoke(app, ["bench", "--only", "quantize",
                               "--plot", str(tmp_path / "x.txt")]).exit_code == 2
    assert runner.invoke(app, ["bench", "--only", "refit", "--plot", str(tmp_path / "x.png")]).exit_code == 2
    assert runner.invoke(app, ["bench", "--no-such-flag"]).exit_code == 2
    assert not list(tmp_path.iterdir())
    (tmp_path / "file").write_text("")
    res = runner.invoke(app, ["bench", "--only", "quantize", "--json", str(tmp_path / "file" / "b.json")])
    assert res.exit_code == 2 and "not a directory" in res.output


def test_cli_quick_quantize_json_and_plot(tmp_path):
    """In-process run (conftest turns the compiled path off; the quantize rows name the kernel they used: the
    native one where this machine has it, else eager)."""
    import torch

    from mxport.quantize import NATIVE_PATH, kernel_label

    out, png = tmp_path / "b.json", tmp_path / "b.png"
    res = CliRunner().invoke(app, ["bench", "--quick", "--only", "quantize", "--json", str(out),
                                   "--plot", str(png)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert set(doc) >= {"rows", "machine"}
    assert doc["machine"]["fast_quantize"] is False
    assert doc["machine"]["native_quantize"] is NATIVE_PATH.available
    kernel = kernel_label(torch.empty(4096, 4096, dtype=torch.bfloat16)).split(" (")[0]
    assert kernel == ("native" if NATIVE_PATH.available else "eager")
    rows = doc["rows"]
    _assert_rows_finite(rows)
    metrics = {r["metric"] for r in rows}
    assert {"first call (compile)", "speed 4096x4096", "memory bound 4096x4096"} <= metrics
    assert {f"throughput {n}x{n}" for n in (128, 256, 512, 1024)} <= metrics
    for r in rows:
        assert r["value"] > 0 and r["ratio"] > 0, r
        if r["metric"].startswith(("speed", "memory bound")):
            assert kernel in r["note"]
    speed = next(r for r in rows if r["metric"] == "speed 4096x4096")
    bound = next(r for r in rows if r["metric"] == "memory bound 4096x4096")
    assert speed["value"] == bound["value"]  # one quantize figure, two baselines
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_cli_quick_all_benchmarks_subprocess(tmp_path):
    """`mxport bench --quick --json F` as a user runs it (compiled path on).

    Every row finite, no error rows."""
    out = tmp_path / "all.json"
    env = {k: v for k, v in os.environ.items() if k != "MXPORT_DISABLE_COMPILE"}
    exe = Path(sys.executable).with_name("mxport")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from mxport.cli import main; main()"]
    proc = subprocess.run([*cmd, "bench", "--quick", "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    _assert_rows_finite(rows)
    assert not [r for r in rows if r["metric"] == "error"]
    assert {r["benchmark"] for r in rows} == set(BENCHMARKS)


def test_goal_met_reads_a_band():
    """``0.75 <= ratio <= 1.25``: a prediction within 25% of the measurement, both sides checked."""
    from mxport.bench.report import goal_met

    row = {"metric": "delta refit: predicted / measured", "goal": "0.75 <= ratio <= 1.25"}
    assert [goal_met({**row, "ratio": r}) for r in (0.74, 0.75, 1.0, 1.25, 1.26)] == [False, True, True, True,
                                                                                      False]
    # no number, or a goal it cannot read: no verdict (it raised)
    assert goal_met({**row, "ratio": None}) is None
    assert goal_met({**row, "ratio": 1.0, "goal": "1.2.3 <= ratio <= 2"}) is None


def test_goal_met_reads_ratio_goals():
    from mxport.bench.report import goal_met

    row = {"metric": "speed", "ratio": 9.9, "goal": "ratio >= 10"}
    assert goal_met(row) is False and goal_met({**row, "ratio": 10.0}) is True
    assert goal_met({"metric": "x", "ratio": 0.04, "goal": "ratio <= 0.05"}) is True
    assert goal_met({"metric": "x", "ratio": 0.06, "goal": "ratio <= 0.05"}) is False
    assert goal_met({"metric": "x", "ratio": 1.0, "goal": "O(1): microseconds"}) is None


@pytest.mark.parametrize("script", ["bench_refit.py", "bench_quantize.py", "bench_export.py",
                                    "bench_checkpoint.py"])
def test_benchmark_scripts_take_help_and_refuse_unknown_options(script):
    """--help prints the help and runs nothing; an unknown option exits 2 (both used to run the whole
    benchmark)."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    ok = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--quick" in ok.stdout
    bad = subprocess.run([sys.executable, str(path), "--bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr


def test_rows_table_leaves_the_baseline_out_of_a_narrow_terminal():
    """In an 80-column terminal the 8-column table folded every cell into a few characters a line (the
    baseline and its note are long); below WIDE_TABLE_COLUMNS the baseline column is left out, a caption
    says where it is, and a skipped row keeps its reason."""
    from rich.console import Console

    from mxport.bench.report import WIDE_TABLE_COLUMNS, rows_table

    rows = [{"benchmark": "refit", "metric": "refit throughput", "value": 1.75, "unit": "GB/s",
             "baseline": "raw dist.broadcast of one flat buffer, same bytes, same run (gloo loopback)",
             "ratio": 1.05, "goal": "ratio >= 0.9", "note": "n"},
            {"benchmark": "vllm", "metric": "skipped", "value": 0.0, "unit": "", "baseline": "", "ratio": 0.0,
             "goal": "", "note": "vllm is not installed"}]

    def render(width):
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(rows_table(rows, width=width))
        return console.export_text()

    narrow, wide = render(80), render(WIDE_TABLE_COLUMNS)
    assert "┃ baseline" not in narrow and "raw dist.broadcast" not in narrow
    assert f"{WIDE_TABLE_COLUMNS}+ columns, or with --json" in narrow
    assert "refit throughput" in narrow and "1.75" in narrow and "yes" in narrow
    assert "skipped" in narrow and "installed" in narrow  # the reason, folded into the metric column
    assert "┃ baseline" in wide and "raw dist.broadcast" in wide and "columns, or with --json" not in wide
    assert max(len(line) for line in narrow.splitlines()) <= 80


def test_refit_vllm_row_says_how_to_run_it_where_vllm_is_absent():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the benchmark runs (scripts/setup_vllm.sh's environment)")
    (row,) = run_benchmark("refit_vllm")
    assert row["metric"] == "skipped" and "setup_vllm.sh" in row["note"]
