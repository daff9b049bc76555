"""``mxport export``: flags, --dry-run, --json, and bad inputs (exit 2, one-line
error, nothing left behind)."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mxport import quantize
from mxport.cli import app
from mxport.testing import make_tiny_llama

runner = CliRunner()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "llama")


def listing(path):
    return sorted(p.name for p in path.iterdir())


def test_export_flags_and_json(tmp_path, llama):
    out = tmp_path / "out"
    r = runner.invoke(app, ["export", str(llama), "-o", str(out), "--format", "sglang", "--exclude",
                            "*.layers.0.*", "--keep-last", "0", "--dtype", "fp32", "--max-shard-size", "1GB",
                            "--json", "-"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["format"] == "sglang" and data["out"] == str(out)
    dec = {d["name"]: d for d in data["decisions"]}
    assert not dec["model.layers.0.self_attn.q_proj.weight"]["quantize"]
    assert "--exclude" in dec["model.layers.0.self_attn.q_proj.weight"]["reason"]
    assert dec["model.layers.1.self_attn.q_proj.weight"]["quantize"]
    written = load_file(str(out / "model.safetensors"))
    src = load_file(str(llama / "model.safetensors"))
    ref = quantize(src["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(written["model.layers.1.mlp.down_proj.weight"].view(torch.uint8),
                       ref.data.view(torch.uint8))
    assert torch.equal(written["model.layers.1.mlp.down_proj.weight_scale_inv"], ref.scale_inv)
    assert written["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32  # kept, cast by --dtype
    assert "model.layers.0.self_attn.q_proj" in data["exclude_modules"]


def test_dry_run_prints_decisions_writes_nothing(tmp_path, llama):
    r = runner.invoke(app, ["export", str(llama), "--dry-run", "--keep-first", "1", "--include", "*proj",
                            "--json", str(tmp_path / "plan.json")])
    assert r.exit_code == 0, r.output
    assert "keep-first" in r.output and "embedding" in r.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["policy"]["keep_first"] == 1 and plan["policy"]["include"] == ["*proj"]
    q = [d["name"] for d in plan["decisions"] if d["quantize"]]
    assert q and all(n.startswith("model.layers.1.") for n in q)
    assert listing(tmp_path) == ["plan.json"]


def corrupt_dir(path):
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    return path


def bad_dtype_dir(path):
    path.mkdir()
    (path / "config.json").write_text("{}")
    hdr = json.dumps({"w": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16)
    return path


@pytest.mark.parametrize(("case", "message"), [
    ("missing", "does not exist"),
    ("empty_dir", "no model found"),
    ("corrupt", "corrupt safetensors header"),
    ("bad_source_dtype", "unsupported dtype 'C64'"),
    ("bad_flag_dtype", "Invalid value for '--dtype': Value error, 'int8' is not one of 'bf16', 'fp16', "
                       "'fp32'"),
    ("bad_fp8", "Invalid value for '--fp8-dtype': Value error, 'e3m4' is not one of 'e4m3', 'e5m2'"),
    ("e5m2_modelopt", "E4M3 only"),
    ("bad_format", "Invalid value for '--format': Value error, 'gguf' is not one of 'modelopt'"),
    ("bad_keep_first", "Invalid value for '--keep-first'"),
    ("bad_shard", "max_shard_size"),
    ("exists", "already exists"),
    ("no_out", "-o/--out"),
])
def test_bad_inputs_exit_2_nothing_left(tmp_path, llama, case, message):
    work = tmp_path / "work"
    work.mkdir()
    src, extra = str(llama), []
    if case == "missing":
        src = str(work / "nope")
    elif case == "empty_dir":
        (work / "empty").mkdir()
        src = str(work / "empty")
    elif case == "corrupt":
        src = str(corrupt_dir(work / "corrupt"))
    elif case == "bad_source_dtype":
        src = str(bad_dtype_dir(work / "c64"))
    elif case == "bad_flag_dtype":
        extra = ["--dtype", "int8"]
    elif case == "bad_fp8":
        extra = ["--fp8-dtype", "e3m4"]
    elif case == "e5m2_modelopt":
        extra = ["--fp8-dtype", "e5m2"]
    elif case == "bad_format":
        extra = ["--format", "gguf"]
    elif case == "bad_keep_first":
        extra = ["--keep-first", "-1"]
    elif case == "bad_shard":
        extra = ["--max-shard-size", "huge"]
    elif case == "exists":
        (work / "out").mkdir()
        (work / "out" / "keep.txt").write_text("mine")
    before = listing(work)
    args = ["export", src, *extra] + ([] if case == "no_out" else ["-o", str(work / "out")])
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    err = " ".join(r.stderr.split())  # rich wraps long lines at the terminal width
    assert message in err and "Traceback" not in r.output
    assert err.startswith("error:") and err.count("error:") == 1
    assert listing(work) == before
    if case == "exists":
        assert listing(work / "out") == ["keep.txt"]


def test_overwrite_replaces(tmp_path, llama):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    r = runner.invoke(app, ["export", str(llama), "-o", str(out), "--overwrite", "--format",
                            "compressed-tensors"])
    assert r.exit_code == 0, r.output
    assert "stale.txt" not in listing(out) and "model.safetensors" in listing(out)
    assert listing(tmp_path) == ["out"]


@pytest.mark.parametrize("fmt", ["modelopt", "sglang"])
def test_export_of_an_mxfp8_checkpoint_is_refused(tmp_path, llama, fmt):
    """An MXFP8 checkpoint given as SOURCE used to be "exported" with its FP8 values and scales copied as kept
    tensors under the new format's config (0 tensors MXFP8, exit 0): a checkpoint no engine reads right. It is
    refused, one line, exit 2, nothing written (also for --dry-run)."""
    run = CliRunner().invoke
    assert run(app, ["export", str(llama), "-o", str(tmp_path / "mx")]).exit_code == 0
    for extra in ([], ["--dry-run"]):
        res = run(app, ["export", str(tmp_path / "mx"), "--format", fmt, "-o", str(tmp_path / "again"),
                        *extra])
        assert res.exit_code == 2, res.output
        assert "already holds FP8 tensors" in res.output and "Traceback" not in res.output
        assert not (tmp_path / "again").exists()


def test_fp8_dtype_offers_e4m3_only_and_refuses_e5m2_while_parsing(tmp_path):
    """Every format refuses E5M2 values: --help offers e4m3 alone, and e5m2 is refused while the command line
    is parsed (before the source or -o are looked at), in one line that says why."""
    import re

    r = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    (row,) = [x for x in r.stdout.splitlines() if re.match(r"^\W*--fp8-dtype\s", x)]
    assert "<e4m3>" in row and "e4m3|e5m2" not in row
    r = runner.invoke(app, ["export", str(tmp_path / "nope"), "--fp8-dtype", "e5m2"])  # no -o either
    assert r.exit_code == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: Invalid value for '--fp8-dtype': e5m2: every format stores MXFP8 values "
                           "as E4M3 only (")
