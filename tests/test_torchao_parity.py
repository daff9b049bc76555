"""Equality with torchao's ``to_mx`` (RCEIL and FLOOR) where torchao is exact, and the pinned right value
where its eager RCEIL path, which takes a float log2, is not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mx_reference import ref_scale_byte

from mxport import quantize

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
ScaleCalculationMode = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode


def _torchao(x, elem, mode):
    scale, data = mx.to_mx(x, elem, 32, scaling_mode=mode)
    return scale.view(torch.uint8).reshape(*x.shape[:-1], -1), data.view(torch.uint8)


@pytest.mark.parametrize("mode, rounding",
                         [(ScaleCalculationMode.RCEIL, "rceil"), (ScaleCalculationMode.FLOOR, "floor")])
@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 32), (129, 576), (2, 8, 64)])
def test_equals_torchao(mode, rounding, elem, dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)).to(dtype)
    s_ao, q_ao = _torchao(x, elem, mode)
    c = quantize(x, elem, rounding=rounding)
    assert torch.equal(c.scale_inv, s_ao)
    assert torch.equal(c.data.view(torch.uint8), q_ao)


def test_torchao_rceil_float_log2_is_wrong_just_above_a_power_of_two():
    """amax = 7168 * (1 + 2**-23), amax/448 just above 2**4: the right E is 132 (2**5 >= v); torchao's
    ceil(log2 v) in float32 rounds log2 v = 4.0000001 to 4.0 -> E = 131."""
    amax = float(np.float32(7168.0) * np.float32(1 + 2**-23))
    x = torch.ones(1, 32)
    x[0, 0] = amax
    right = ref_scale_byte(amax, "e4m3", "rceil")
    assert right == 132
    c = quantize(x)
    assert c.scale_inv.item() == right
    assert c.data[0, 0].float().item() == 224.0  # 7168.0009 / 32
    s_ao, q_ao = _torchao(x, torch.float8_e4m3fn, ScaleCalculationMode.RCEIL)
    assert s_ao.item() == 131  # torchao's eager path: one step too small, so 7168.0009/16 saturates to 448
    assert q_ao[0, 0].item() == 0x7E  # 448 in E4M3
