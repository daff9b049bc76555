"""export_components dispatch: MXFP8Components as is, float tensors / parameters through quantize, bad
inputs."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch

import mxport
from mxport.sources import resolve_fp8_dtype


def source(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 100


def same_bytes(a, b):
    return (
        a.direction == b.direction
        and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        and torch.equal(a.scale_inv, b.scale_inv)
    )


def test_public_names():
    assert "export_components" in mxport.__all__ and "export_grouped_components" in mxport.__all__


def test_components_returned_as_is():
    c = mxport.quantize(source((64, 64)), direction="columnwise")
    assert mxport.export_components(c, direction="columnwise") is c
    with pytest.raises(ValueError, match="columnwise"):
        mxport.export_components(c)  # asked rowwise


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"fp8_dtype": torch.float8_e5m2}, {"rounding": "floor"}, {"block_2d": True}],
)
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_float_tensor_goes_through_quantize(kwargs, direction):
    x = source((70, 100))
    e = mxport.export_components(x, direction=direction, **kwargs)
    assert same_bytes(e, mxport.quantize(x, direction=direction, **kwargs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parameter_and_half_inputs(dtype):
    p = torch.nn.Parameter(source((32, 96)).to(dtype))
    e = mxport.export_components(p)
    assert not e.data.requires_grad
    assert same_bytes(e, mxport.quantize(p.detach()))


class _QuantizedLike(torch.Tensor):
    """An unknown tensor subclass (as TE's NVFP4Tensor looks to mxport): must not be requantized silently."""


def test_other_tensors_and_objects_rejected():
    for obj in (torch.arange(64).reshape(8, 8), torch.zeros(4, 32, dtype=torch.float8_e4m3fn),
                torch.zeros(4, 32, dtype=torch.uint8)):
        with pytest.raises(TypeError, match="without scales.*Transformer Engine"):
            mxport.export_components(obj)
    for obj in (None, object(), {"data": 1}, SimpleNamespace(data=1, scale=2)):
        with pytest.raises(TypeError, match="accepts a Transformer Engine"):
            mxport.export_components(obj)
    sub = source((4, 32)).as_subclass(_QuantizedLike)
    with pytest.raises(TypeError, match="tensor subclass _QuantizedLike"):
        mxport.export_components(sub)
    with pytest.raises(ValueError, match="direction"):
        mxport.export_components(source((4, 32)), direction="both")
    with pytest.raises(ValueError, match="0-d"):
        mxport.export_components(torch.tensor(1.0))


def test_resolve_fp8_dtype_spellings():
    class DType(enum.Enum):
        kFloat8E4M3 = 7
        kFloat8E5M2 = 8

    assert resolve_fp8_dtype(DType.kFloat8E4M3) is torch.float8_e4m3fn
    assert resolve_fp8_dtype(DType.kFloat8E5M2) is torch.float8_e5m2
    assert resolve_fp8_dtype(8) is torch.float8_e5m2
    assert resolve_fp8_dtype("kFloat8E4M3") is torch.float8_e4m3fn
    assert resolve_fp8_dtype(torch.float8_e5m2) is torch.float8_e5m2
    for bad in (True, 6, 9, torch.float32, None, "e4m3x"):
        with pytest.raises(TypeError, match="_fp8_dtype"):
            resolve_fp8_dtype(bad)
