"""Megatron-LM inference MXFP8Tensor (data + cuBLAS-swizzled E8M0 scale + backend) -> export_components.

The stand-in dataclass mirrors megatron/core/inference/quantization/mxfp8_tensor.py; the swizzled bytes are
built with the cuBLAS/TE swizzle byte formula (as in docs/format.md, "Scale layouts"), independently of
mxport.layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

import mxport


@dataclass
class MXFP8Tensor:
    data: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # swizzled E8M0: 1-D, or 2-D (padded_M, padded_cols)
    backend: Optional[str] = None


def _up(a, m):
    return -(-a // m) * m


def swizzled_bytes(compact: torch.Tensor) -> torch.Tensor:
    r_n, c_n = compact.shape
    out = np.zeros(_up(r_n, 128) * _up(c_n, 4), dtype=np.uint8)
    r, c = np.meshgrid(np.arange(r_n), np.arange(c_n), indexing="ij")
    off = ((r // 128) * (_up(c_n, 4) // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    out[off.ravel()] = compact.numpy().ravel()
    return torch.from_numpy(out)


def source(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return x * torch.exp2(torch.randint(-20, 20, (shape[-1],), generator=g).float())


def megatron_tensor(x, backend="flashinfer", two_d=False):
    c = mxport.quantize(x)
    sw = swizzled_bytes(c.scale_inv)
    if two_d:
        sw = sw.reshape(_up(x.shape[0], 128), -1)
    if backend == "triton":
        sw = sw.view(torch.float8_e8m0fnu)  # Megatron's PyTorch scaled-GEMM contract
    return MXFP8Tensor(c.data.clone(), sw, backend), c


@pytest.mark.parametrize("shape", [(3, 64), (100, 96), (128, 32), (300, 160), (256, 4096)])
@pytest.mark.parametrize("backend,two_d",
                         [("flashinfer", False), ("triton", True), (None, False), ("triton", False)])
def test_megatron_exports_compact_rowwise(shape, backend, two_d):
    x = source(shape)
    t, ref = megatron_tensor(x, backend, two_d)
    e = mxport.export_components(t)
    assert e.direction == "rowwise" and e.shape == ref.shape
    assert e.data.data_ptr() == t.data.data_ptr()
    assert torch.equal(e.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(e.scale_inv, ref.scale_inv)
    assert torch.equal(e.dequantize(), ref.dequantize())


def test_uint8_data_is_viewed_as_e4m3_and_writes_show_through():
    t, ref = megatron_tensor(source((128, 64)))
    t.data = t.data.view(torch.uint8)
    e = mxport.export_components(t)
    assert e.fp8_dtype == torch.float8_e4m3fn and e.data.data_ptr() == t.data.data_ptr()
    t.data[0, 0] = 0x38
    assert e.data.view(torch.uint8)[0, 0].item() == 0x38


def test_bad_megatron_inputs():
    t, _ = megatron_tensor(source((128, 64)))
    with pytest.raises(ValueError, match="rowwise data only"):
        mxport.export_components(t, direction="columnwise")
    with pytest.raises(ValueError, match="backend"):
        mxport.export_components(MXFP8Tensor(t.data, t.scale, "cutlass"))
    with pytest.raises(ValueError, match="MXFP8Tensor.scale"):
        mxport.export_components(MXFP8Tensor(t.data, t.scale[:-4]))  # too few bytes for the data
    with pytest.raises(ValueError, match="MXFP8Tensor.scale is 2-D"):
        mxport.export_components(MXFP8Tensor(t.data, t.scale.reshape(64, -1)))
    with pytest.raises(TypeError, match="MXFP8Tensor.scale"):
        mxport.export_components(MXFP8Tensor(t.data, t.scale.float()))
    with pytest.raises(TypeError, match="MXFP8Tensor.data"):
        mxport.export_components(MXFP8Tensor(t.data.float(), t.scale))
    with pytest.raises(ValueError, match="2-D"):
        mxport.export_components(MXFP8Tensor(t.data.reshape(2, 64, 64), t.scale))
