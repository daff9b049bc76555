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


def test_an_export_that_quantizes_nothing_says_so(tmp_path, llama):
    """Found by a newcomer: `--include 'zzz*'` (or --keep-first beyond the layer count) wrote "0 tensors
    MXFP8" under a config declaring MXFP8, silently, which inspect then reports as a problem. It is written
    (verify --target-kl may suggest keeping every layer), with a warning line saying so."""
    for n, args in enumerate((["--include", "zzz*"], ["--keep-first", "100"])):
        r = runner.invoke(app, ["export", str(llama), "-o", str(tmp_path / f"none{n}"), *args])
        assert r.exit_code == 0, (args, r.output)
        assert "0 tensors MXFP8" in r.output and "warning: no tensor is MXFP8" in r.output
    r = runner.invoke(app, ["export", str(llama), "-o", str(tmp_path / "some")])
    assert r.exit_code == 0 and "warning" not in r.output


def test_refit_and_verify_of_an_mxfp8_checkpoint_are_refused(tmp_path, llama):
    """Found by a newcomer: `mxport refit` / `mxport verify` given an MXFP8 checkpoint as SOURCE loaded it as
    a model (its FP8 values without their scales) and reported garbage text with exact: yes, or a perfect
    score, exit 0. Both refuse it as export does: one line, exit 2, before any process starts."""
    run = CliRunner().invoke
    assert run(app, ["export", str(llama), "-o", str(tmp_path / "mx")]).exit_code == 0
    for args in (["refit", str(tmp_path / "mx"), "--steps", "1"],
                 ["verify", str(tmp_path / "mx"), "--max-new-tokens", "1"]):
        res = run(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "already holds FP8 tensors" in res.output and "Traceback" not in res.output


def test_fp8_dtype_offers_e4m3_only_and_refuses_e5m2_while_parsing(tmp_path, monkeypatch):
    """Every format refuses E5M2 values: --help offers e4m3 alone, and e5m2 is refused while the command line
    is parsed (before the source or -o are looked at), in one line that says why."""
    import re

    import typer.rich_utils

    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 400)  # typer reads TERMINAL_WIDTH once, at import

    r = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    (row,) = [x for x in r.stdout.splitlines() if re.match(r"^\W*--fp8-dtype\s", x)]
    assert "<e4m3>" in row and "e4m3|e5m2" not in row
    r = runner.invoke(app, ["export", str(tmp_path / "nope"), "--fp8-dtype", "e5m2"])  # no -o either
    assert r.exit_code == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: Invalid value for '--fp8-dtype': e5m2: every format stores MXFP8 values "
                           "as E4M3 only (")


# -- K not a multiple of 32 (issue 25): refused, or kept with --keep-unaligned -------------------------------
@pytest.fixture(scope="module")
def llama_k200(tmp_path_factory):
    """down_proj [64, 200]: K = 200 is 6 blocks and 8 values; vLLM refuses it ("MXFP8 requires input size
    divisible by 32, got 200")."""
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "k200", intermediate=200)


def test_k_not_a_multiple_of_32_is_refused_with_one_line_naming_the_tensors(tmp_path, llama_k200):
    out = tmp_path / "out"
    for extra in ([], ["--dry-run"]):
        r = runner.invoke(app, ["export", str(llama_k200), "-o", str(out), *extra])
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert len(lines) == 1, r.output
        assert lines[0].startswith("error: 2 tensors with K not a multiple of 32"), r.output
        assert "model.layers.0.mlp.down_proj.weight (K=200), model.layers.1.mlp.down_proj.weight (K=200)" \
            in lines[0] and "--keep-unaligned" in lines[0]
    assert listing(tmp_path) == []


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors", "sglang"])
def test_keep_unaligned_keeps_them_in_their_dtype_and_says_so(tmp_path, llama_k200, fmt):
    out = tmp_path / "out"
    r = runner.invoke(app, ["export", str(llama_k200), "-o", str(out), "--format", fmt, "--keep-unaligned",
                            "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    down = [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)]
    for name in down:
        assert f"kept in high precision {name}: K=200 is not a multiple of 32 (--keep-unaligned)" in \
            " ".join(r.output.split())
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["kept_unaligned"] == down and data["nonzero_scales"] is False
    dec = {d["name"]: d for d in data["decisions"]}
    assert dec[down[0]]["quantize"] is False and dec[down[0]]["reason"] == \
        "kept: K=200 is not a multiple of 32 (--keep-unaligned)"
    assert dec["model.layers.0.mlp.up_proj.weight"]["quantize"] is True  # K = 64
    written, src = load_file(str(out / "model.safetensors")), load_file(str(llama_k200 / "model.safetensors"))
    assert written[down[1]].dtype == torch.bfloat16 and torch.equal(written[down[1]], src[down[1]])
    assert not any(k.startswith(down[1]) and k != down[1] for k in written)  # no scale for it
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    ignored = cfg.get("ignore", cfg.get("ignored_layers"))
    assert [m for m in ignored if "down_proj" in m] == ["model.layers.0.mlp.down_proj",
                                                       "model.layers.1.mlp.down_proj"]


def test_keep_unaligned_keeps_the_share_group_with_the_tensor():
    from mxport.checkpoint.export import align_decisions
    from mxport.policy import PrecisionPolicy

    entries = [("m.layers.0.self_attn.q_proj.weight", (64, 200), torch.bfloat16),
               ("m.layers.0.self_attn.k_proj.weight", (32, 200), torch.bfloat16),
               ("m.layers.0.self_attn.o_proj.weight", (200, 64), torch.bfloat16),
               ("m.layers.0.mlp.experts.gate_up_proj", (4, 64, 64), torch.bfloat16),
               ("m.layers.0.mlp.experts.down_proj", (4, 64, 40), torch.bfloat16)]
    got = {d.name: d for d in align_decisions(PrecisionPolicy().decide_all(entries), keep_unaligned=True)}
    assert [n for n, d in got.items() if d.quantize] == ["m.layers.0.self_attn.o_proj.weight"]
    assert got["m.layers.0.mlp.experts.gate_up_proj"].reason == (
        "kept: experts of one MoE layer share one precision (m.layers.0.mlp.experts.down_proj: K=40 is not a "
        "multiple of 32, --keep-unaligned)")
    assert got["m.layers.0.self_attn.k_proj.weight"].reason == "kept: K=200 is not a multiple of 32 " \
                                                              "(--keep-unaligned)"


def test_nonzero_scales_writes_byte_one_for_zero_blocks(tmp_path):
    from safetensors.torch import save_file

    src = make_tiny_llama(tmp_path / "src", with_tokenizer=False)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name][3, 32:64] = 0  # an all-zero block
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = runner.invoke(app, ["export", str(src), "-o", str(tmp_path / "a"), "--nonzero-scales", "--json", "-"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["nonzero_scales"] is True
    plain = runner.invoke(app, ["export", str(src), "-o", str(tmp_path / "b")])
    assert plain.exit_code == 0, plain.output
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "b"))
    assert b[name + "_scale"][3, 1] == 0 and a[name + "_scale"][3, 1] == 1
    want = quantize(tensors[name], nonzero_scales=True)
    assert torch.equal(a[name + "_scale"], want.scale_inv) and int((want.scale_inv == 0).sum()) == 0
    assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))
    for k in a:
        if k.endswith("_scale"):
            mask = b[k] != 0
            assert torch.equal(a[k][mask], b[k][mask]), k  # only the bytes 0 changed
