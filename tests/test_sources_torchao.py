"""Real torchao MXTensor objects (made by torchao on the CPU) -> export_components."""

from __future__ import annotations

import warnings

import pytest
import torch

import mxport

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
MXTensor = mx_tensor.MXTensor
Mode = mx_tensor.ScaleCalculationMode

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MODES = [(Mode.RCEIL, "rceil"), (Mode.FLOOR, "floor")]


def source(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return x * torch.exp2(torch.randint(-20, 20, (shape[-1],), generator=g).float())


def to_mx(x, fp8, mode=Mode.RCEIL, swizzled=False):
    return MXTensor.to_mx(x, fp8, 32, scaling_mode=mode, is_swizzled_scales=swizzled)


def assert_bytes(e, ref):
    assert e.direction == ref.direction and e.shape == ref.shape and e.fp8_dtype == ref.fp8_dtype
    assert torch.equal(e.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(e.scale_inv, ref.scale_inv)


@pytest.mark.parametrize("shape", [(3, 64), (100, 64), (2, 64, 96), (256, 4096)])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode,rounding", MODES)
def test_mxtensor_exports_torchaos_bytes(shape, fp8, mode, rounding):
    x = source(shape)
    m = to_mx(x, fp8, mode)
    e = mxport.export_components(m)
    # torchao's own bytes, bit for bit, and views of them
    assert torch.equal(e.data.view(torch.uint8), m.qdata.view(torch.uint8))
    assert torch.equal(e.scale_inv, m.scale.view(torch.uint8))
    assert e.data.data_ptr() == m.qdata.data_ptr() and e.scale_inv.data_ptr() == m.scale.data_ptr()
    # decodes to torchao's own dequantization, and matches mxport.quantize with the same rounding rule
    assert torch.equal(e.dequantize(), m.dequantize(torch.float32))
    assert_bytes(e, mxport.quantize(x, fp8, rounding=rounding))


@pytest.mark.parametrize("shape", [(100, 64), (300, 160), (2, 128, 64)])
@pytest.mark.parametrize("fp8", FP8)
def test_swizzled_mxtensor(shape, fp8):
    x = source(shape, seed=3)
    m = to_mx(x, fp8, swizzled=True)
    assert m.is_swizzled_scales
    e = mxport.export_components(m)
    assert e.data.data_ptr() == m.qdata.data_ptr()
    assert_bytes(e, mxport.quantize(x, fp8))
    assert torch.equal(e.dequantize(), m.dequantize(torch.float32))


@pytest.mark.parametrize("swizzled", [False, True])
def test_transposed_mxtensor_is_columnwise(swizzled):
    x = source((100, 64), seed=5)
    t = to_mx(x, torch.float8_e4m3fn, swizzled=swizzled).t()  # logical (64, 100), blocks along dim 0
    e = mxport.export_components(t, direction="columnwise")
    assert e.data.data_ptr() == t.qdata.data_ptr()
    assert_bytes(e, mxport.quantize(x.t().contiguous(), direction="columnwise"))
    assert torch.equal(e.dequantize(), t.dequantize(torch.float32))
    with pytest.raises(ValueError, match="columnwise data only"):
        mxport.export_components(t)


def test_writes_into_qdata_show_through():
    m = to_mx(source((64, 64)), torch.float8_e4m3fn)
    e = mxport.export_components(m)
    m.qdata.view(torch.uint8)[0, 0] = 0x38  # E4M3 1.0
    m.scale.view(torch.uint8)[0, 0] = 127
    assert e.dequantize()[0, 0].item() == 1.0


def test_parameter_wrapping_mxtensor():
    x = source((64, 64))
    m = to_mx(x, torch.float8_e5m2)
    p = torch.nn.Parameter(m, requires_grad=False)
    assert_bytes(mxport.export_components(p), mxport.quantize(x, torch.float8_e5m2))


def test_rowwise_mxtensor_has_no_columnwise():
    with pytest.raises(ValueError, match="rowwise data only"):
        mxport.export_components(to_mx(source((64, 64)), torch.float8_e4m3fn), direction="columnwise")


def test_mxfp4_is_not_mxfp8():
    m = MXTensor.to_mx(source((64, 64)), torch.float4_e2m1fn_x2, 32)
    with pytest.raises(TypeError, match="elem_dtype"):
        mxport.export_components(m)


def test_quantize_options_rejected_for_mxtensor():
    m = to_mx(source((64, 64)), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="quantize options"):
        mxport.export_components(m, fp8_dtype=torch.float8_e5m2)
