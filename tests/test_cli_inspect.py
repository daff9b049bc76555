"""``mxport inspect``: recognizes all three formats (ours and hand-made), reports exact statistics, and flags
a missing scale, a padded scale, a float-stored scale, orphan scales (exit 1); bad paths exit 2."""

import json
import re
import struct

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from mxport import MXFP8Components, quantize
from mxport.checkpoint import FORMATS, scale_name
from mxport.checkpoint.export import export_checkpoint
from mxport.checkpoint.inspect import inspect_checkpoint, pair_stats
from mxport.cli import app
from mxport.layouts import pad
from mxport.testing import make_tiny_mixtral

runner = CliRunner()


def inspect_json(path):
    r = runner.invoke(app, ["inspect", str(path), "--json", "-"])
    return r.exit_code, (json.loads(r.stdout) if r.stdout.strip() else None), r


@pytest.mark.parametrize("fmt", FORMATS)
def test_our_exports_are_clean(tmp_path, fmt):
    src = make_tiny_mixtral(tmp_path / "src", experts=2, layers=1, fused_experts=fmt == "sglang")
    export_checkpoint(src, tmp_path / "out", fmt=fmt)
    code, rep, r = inspect_json(tmp_path / "out")
    assert code == 0, r.output
    assert rep["format"] == fmt and rep["format_source"] == "config" and rep["problems"] == []
    roles = {t["name"]: t["role"] for t in rep["tensors"]}
    assert roles["model.embed_tokens.weight"] == "kept" and roles["lm_head.weight"] == "kept"
    values = [n for n, r_ in roles.items() if r_ == "values"]
    assert values and all(roles[scale_name(n, fmt)] == "scales" for n in values)
    assert len(rep["pairs"]) == len(values)
    tot = rep["totals"]
    assert tot["bytes"] == tot["values_bytes"] + tot["scales_bytes"] + tot["kept_bytes"]
    assert 0.5 < tot["ratio_to_bf16"] < 1.0


def hand_made(path, fmt, *, config=True):
    """Another producer's checkpoint: written by hand with safetensors, not by mxport."""
    x = torch.linspace(-3, 5, 3 * 64).reshape(3, 64)
    x[:, 32:] = 0  # second block of every row all zero
    c = quantize(x)
    path.mkdir()
    save_file({"layer.weight": c.data, scale_name("layer.weight", fmt): c.scale_inv,
               "norm.weight": torch.ones(64)}, str(path / "model.safetensors"))
    if config:
        cfg = {"modelopt": {"quant_method": "modelopt", "quant_algo": "MXFP8"},
               "compressed-tensors": {"quant_method": "compressed-tensors", "format": "mxfp8-quantized"},
               "sglang": {"quant_method": "mxfp8"}}[fmt]
        (path / "config.json").write_text(json.dumps({"quantization_config": cfg}))
    return c


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_producers_and_exact_stats(tmp_path, fmt):
    c = hand_made(tmp_path / "ck", fmt)
    rep = inspect_checkpoint(tmp_path / "ck")
    assert rep["format"] == fmt and rep["problems"] == []
    (p,) = rep["pairs"]
    e = c.scale_inv.to(torch.int32)
    assert (p["scale_exp_min"], p["scale_exp_max"]) == (int(e.min()) - 127, int(e.max()) - 127)
    ref = c.dequantize()
    assert p["absmax"] == float(ref.abs().max()) and p["mean_abs"] == pytest.approx(float(ref.abs().mean()))
    assert p["zero_block_fraction"] == 0.5
    # no config: the format comes from the scale names
    hand_made(tmp_path / "noconf", fmt, config=False)
    rep = inspect_checkpoint(tmp_path / "noconf")
    assert rep["format"] == ("sglang" if fmt == "sglang" else "modelopt") and rep["format_source"] == "names"


def test_pair_stats_partial_block():
    data = torch.zeros(2, 40, dtype=torch.float8_e4m3fn)
    data[0, 35] = 1.0  # only the partial last block of row 0 is non-zero
    scale = torch.tensor([[127, 130], [127, 255]], dtype=torch.uint8)
    s = pair_stats(MXFP8Components(data, scale, "rowwise"))
    assert (s["scale_exp_min"], s["scale_exp_max"], s["nan_scales"]) == (0, 3, 1)
    assert s["absmax"] == 8.0 and s["zero_block_fraction"] == 0.75


def write(path, tensors, config=None):
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_flags_missing_padded_float_and_orphan_scales(tmp_path):
    c = quantize(torch.randn(3, 64))
    cfg = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8"}}
    cases = {
        "missing": ({"a.weight": c.data}, "without a scale"),
        "padded": ({"a.weight": c.data, "a.weight_scale": pad(c.scale_inv)}, "looks padded"),
        "float": ({"a.weight": c.data, "a.weight_scale": c.scale_as_float()}, "scale stored as float32"),
        "orphan": ({"b.weight": torch.ones(3, 64), "a.weight_scale": c.scale_inv}, "scale without values"),
        "wrong_name": ({"a.weight": c.data, "a.weight_scale_inv": c.scale_inv}, "does not follow format"),
    }
    assert tuple(pad(c.scale_inv).shape) == (128, 4)
    for case, (tensors, message) in cases.items():
        path = write(tmp_path / case, tensors, cfg)
        code, rep, r = inspect_json(path)
        assert code == 1, (case, r.output)
        assert any(message in p for p in rep["problems"]), (case, rep["problems"])
        r = runner.invoke(app, ["inspect", str(path)])
        assert r.exit_code == 1 and "problem:" in r.output


def test_config_without_pairs_and_e8m0_dtype(tmp_path):
    path = write(tmp_path / "empty", {"w": torch.ones(2, 2)},
                 {"quantization_config": {"quant_method": "mxfp8"}})
    rep = inspect_checkpoint(path)
    assert any("no FP8 values/scale pair" in p for p in rep["problems"])
    plain = write(tmp_path / "plain", {"w": torch.ones(2, 2)})
    code, rep, _ = inspect_json(plain)
    assert rep["format"] is None and rep["tensors"][0]["role"] == "kept"
    # nothing MXFP8 in it is a problem (issue 12 item 10): "no problems found", exit 0, hid it
    assert code == 1 and rep["problems"] == ["nothing MXFP8 in this checkpoint: no FP8 values/scale pair "
                                             "(not quantized?)"]
    if hasattr(torch, "float8_e8m0fnu"):
        c = quantize(torch.randn(4, 32))
        p = write(tmp_path / "e8m0", {"a.weight": c.data,
                                      "a.weight_scale": c.scale_inv.view(torch.float8_e8m0fnu)})
        rep = inspect_checkpoint(p)
        assert rep["problems"] == [] and rep["warnings"]


def test_bad_paths_exit_2(tmp_path):
    r = runner.invoke(app, ["inspect", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "does not exist" in " ".join(r.stderr.split())
    (tmp_path / "empty").mkdir()
    assert runner.invoke(app, ["inspect", str(tmp_path / "empty")]).exit_code == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{oops")
    r = runner.invoke(app, ["inspect", str(bad)])
    assert r.exit_code == 2 and "corrupt safetensors header" in " ".join(r.stderr.split())


def test_every_column_survives_80_columns(tmp_path, monkeypatch):
    """At 80 columns the MXFP8 pairs table dropped its last columns (``zero blocks`` first): every column of
    both tables stays, names fold, no line is wider than the terminal."""
    import io

    from rich.console import Console

    from mxport.cli import inspect_cmd
    from mxport.testing import make_tiny_llama

    export_checkpoint(make_tiny_llama(tmp_path / "src"), tmp_path / "out")
    report = inspect_checkpoint(tmp_path / "out")
    out = io.StringIO()
    monkeypatch.setattr(inspect_cmd, "console", Console(file=out, width=80, color_system=None))
    inspect_cmd._print(report)
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    for header in ("name", "shape", "dtype", "role", "values", "scale", "min..max", "absmax", "mean |x|",
                   "zero", "blocks"):
        assert header in text, header
    rows = [line for line in text.splitlines() if "%" in line and line.startswith("│")]
    assert len(rows) == len(report["pairs"]) > 0  # the zero blocks column: one percentage per pair
    assert all(re.search(r"\d%\s*│$", line) for line in rows)


def test_k_not_a_multiple_of_32_is_flagged_per_consumer(tmp_path):
    """Another producer's checkpoint with K = 200 (6 blocks and 8 values) and K = 64: the scale is compact and
    right, but vLLM, SGLang and TE refuse the K = 200 weight: one problem per consumer, exit 1."""
    path = tmp_path / "k200"
    path.mkdir()
    a, b = quantize(torch.randn(8, 200)), quantize(torch.randn(8, 64))
    save_file({"a.weight": a.data, "a.weight_scale": a.scale_inv, "b.weight": b.data,
               "b.weight_scale": b.scale_inv}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "modelopt",
                                                                           "quant_algo": "MXFP8"}}))
    code, rep, r = inspect_json(path)
    assert code == 1, r.output
    what = "1 MXFP8 tensor with K not a multiple of 32 (a.weight (K=200))"
    assert rep["consumers"] == {
        "vllm": [f"vLLM: {what}: cannot serve them (modelopt refuses to load: 'MXFP8 requires input size "
                 "divisible by 32'; compressed-tensors loads them into K // 32 scale columns, then fails on "
                 "the first forward)"],
        "sglang": [f"SGLang: {what}: its MXFP8 kernels read K // 32 scale columns, and a row-parallel "
                   "layer refuses a K per rank that is not a multiple of 32"],
        "te": [f"TE: {what}: MXFP8 tensors need K % 32 == 0 (MXFP8Quantizer.is_quantizable / "
               "get_scale_shape)"]}
    assert rep["problems"] == [line for lines in rep["consumers"].values() for line in lines]
    text = " ".join(runner.invoke(app, ["inspect", str(path)]).output.split())
    assert f"problem: vLLM: {what}" in text and "no problems found" not in text
    (path / "model.safetensors").unlink()  # the same checkpoint without the K = 200 weight: clean
    save_file({"b.weight": b.data, "b.weight_scale": b.scale_inv}, str(path / "model.safetensors"))
    code, rep, r = inspect_json(path)
    assert code == 0 and rep["consumers"] == {"vllm": [], "sglang": [], "te": []}, r.output
