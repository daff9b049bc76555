"""Regression tests for bugs found by adversarial review: each asserts the documented error
or the right value."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mxport
from mxport import MXFP8Components, quantize
from mxport.checkpoint.inspect import inspect_checkpoint


def _te_storage(c: MXFP8Components, scale: torch.Tensor, fp8_dtype=7):
    return SimpleNamespace(_rowwise_data=c.data.view(torch.uint8), _columnwise_data=None,
                           _rowwise_scale_inv=scale, _columnwise_scale_inv=None, _fp8_dtype=fp8_dtype,
                           _with_gemm_swizzled_scales=False)


def test_te_scale_grid_larger_than_padded_is_rejected():
    c = quantize(torch.randn(96, 576))  # TE pads (96, 18) scales to (128, 20)
    good = mxport.layouts.pad(c.scale_inv)
    assert torch.equal(mxport.export_components(_te_storage(c, good)).scale_inv, c.scale_inv)
    with pytest.raises(ValueError, match=r"expected TE's padded \(128, 20\)"):
        mxport.export_components(_te_storage(c, torch.zeros(512, 64, dtype=torch.uint8)))


@pytest.mark.parametrize("code", [7.9, 8.5, "7"])
def test_te_fp8_dtype_codes_are_not_truncated(code):
    c = quantize(torch.randn(32, 64))
    with pytest.raises(TypeError, match="_fp8_dtype"):
        mxport.export_components(_te_storage(c, mxport.layouts.pad(c.scale_inv), fp8_dtype=code))
    assert mxport.export_components(_te_storage(c, mxport.layouts.pad(c.scale_inv),
                                                fp8_dtype=np.int64(7))).fp8_dtype == torch.float8_e4m3fn


def _one_pair_checkpoint(path, scale_fill=None):
    c = quantize(torch.randn(8, 64))
    scale = c.scale_inv.clone() if scale_fill is None else torch.full_like(c.scale_inv, scale_fill)
    path.mkdir()
    save_file({"a.weight": c.data, "a.weight_scale": scale}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "modelopt",
                                                                           "quant_algo": "MXFP8"}}))
    return path


@pytest.mark.parametrize("stats", [True, False])
def test_inspect_flags_nan_and_all_zero_scales_with_or_without_stats(tmp_path, stats):
    clean = inspect_checkpoint(_one_pair_checkpoint(tmp_path / "clean"), stats=stats)
    assert clean["problems"] == []
    nan = inspect_checkpoint(_one_pair_checkpoint(tmp_path / "nan", 255), stats=stats)
    assert any("16 NaN scale byte(s)" in p for p in nan["problems"]), nan["problems"]
    zero = inspect_checkpoint(_one_pair_checkpoint(tmp_path / "zero", 0), stats=stats)
    assert any("every scale byte is 0" in p for p in zero["problems"]), zero["problems"]


def test_cli_error_is_one_line_even_when_long(tmp_path):
    missing = tmp_path / ("a-very-long-directory-name-" * 5) / "model"
    r = subprocess.run([sys.executable, "-m", "mxport.cli", "inspect", str(missing)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and str(missing) in lines[0], r.stderr


class _Wrapped(torch.Tensor):
    pass


def test_quantize_rejects_tensor_subclasses_sparse_and_bad_fast():
    with pytest.raises(TypeError, match="subclass"):
        quantize(torch.randn(4, 32).as_subclass(_Wrapped))
    with pytest.raises(TypeError, match="dense"):
        quantize(torch.randn(4, 32).to_sparse())
    with pytest.raises(TypeError, match="fast"):
        quantize(torch.randn(4, 32), fast="no")
    p = torch.nn.Parameter(torch.full((2, 32), 3.0))  # a Parameter is a plain tensor: accepted
    assert quantize(p).scale_inv.tolist() == [[120], [120]]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int32])
def test_dequantize_rejects_non_float_outputs(dtype):
    c = quantize(torch.tensor([[1000.0, 3.0] + [0.0] * 30]))
    with pytest.raises(TypeError, match="dtype"):
        c.dequantize(dtype)
    assert c.dequantize(torch.float64)[0, :2].tolist() == [1024.0, 3.0]


def test_block_size_must_be_an_integer_32():
    d, s = torch.ones(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8)
    c = MXFP8Components(d, s, block_size=np.int64(32))
    assert type(c.block_size) is int and json.loads(json.dumps(c.metadata()))["block_size"] == 32
    for bad in (32.0, True, "32"):
        with pytest.raises(TypeError, match="block_size"):
            MXFP8Components(d, s, block_size=bad)
        with pytest.raises(TypeError, match="block_size"):
            quantize(torch.ones(2, 32), block_size=bad)


def test_decoded_weight_cache_holds_one_entry_per_dtype():
    from mxport.nn import MXFP8Linear

    lin = MXFP8Linear.from_components(quantize(torch.randn(8, 64)))
    w32 = lin.decoded_weight(torch.float32)
    wbf = lin.decoded_weight(torch.bfloat16)
    # not evicted by the bf16 decode
    assert wbf.dtype == torch.bfloat16 and lin.decoded_weight(torch.float32) is w32
    lin.weight_scale.add_(1)  # an in-place write still invalidates every entry
    assert torch.equal(lin.decoded_weight(torch.float32), w32 * 2)


def test_inspect_expands_user_home_for_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _one_pair_checkpoint(tmp_path / "ckpt")
    rep = inspect_checkpoint("~/ckpt")
    assert rep["format"] == "modelopt" and rep["format_source"] == "config"
