"""The torch.compile'd quantize kernel gives the same bytes as the eager kernel (design: one kernel function,
two execution modes)."""

from __future__ import annotations

import pytest
import torch

from mxport import quantize


def _special_tensor(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-40, 40, (m, k), generator=g).float())
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (64,), generator=g)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, 480.0, 2.0**-140, 3.4e38, -0.0])
    flat[idx] = specials.repeat(8)
    x[3] = 0.0  # an all-zero row
    return x


def _same(a, b):
    assert torch.equal(a.scale_inv, b.scale_inv)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(fp8_dtype=torch.float8_e5m2, rounding="floor", direction="columnwise"),
    dict(block_2d=True),
])
def test_compiled_kernel_is_bit_identical_to_eager(fast_path, kwargs):
    for m, k, dtype in ((256, 576, torch.bfloat16), (200, 100, torch.float32)):
        x = _special_tensor(m, k, m + k).to(dtype)
        _same(quantize(x, fast=True, **kwargs), quantize(x, fast=False, **kwargs))
    assert fast_path.available, fast_path.disabled_reason


def test_fast_true_without_compile_raises(no_native):
    from mxport.quantize import FAST_PATH

    if FAST_PATH.available:
        pytest.skip("compile is enabled in this run")
    with pytest.raises(RuntimeError, match="fast=True"):
        quantize(torch.ones(2, 32), fast=True)
