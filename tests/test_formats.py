"""formats.py codecs: the integer-arithmetic E4M3 cast equals PyTorch's cast (+ saturation, canonical NaN) and
ml_dtypes on random float32 bit patterns and on every rounding tie; E8M0 helpers at their edges."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from mxport.formats import (
    FP8_CANONICAL_NAN,
    e8m0_floor,
    e8m0_multiplier,
    e8m0_rceil,
    e8m0_to_float,
    saturating_cast,
)


def _torch_reference(x: torch.Tensor, max_norm: float, dtype: torch.dtype) -> torch.Tensor:
    q = torch.clamp(x, -max_norm, max_norm).to(dtype).view(torch.uint8).clone()
    q[torch.isnan(x)] = FP8_CANONICAL_NAN
    return q


def test_e4m3_cast_matches_torch_and_ml_dtypes_on_random_bit_patterns():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int64, generator=g).to(torch.int32)
    x = bits.view(torch.float32)
    got = saturating_cast(x, 448.0, torch.float8_e4m3fn)
    assert torch.equal(got, _torch_reference(x, 448.0, torch.float8_e4m3fn))
    xs = x[~torch.isnan(x)].numpy()
    ml = np.clip(xs, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(got[~torch.isnan(x)].numpy(), ml)


def test_e4m3_cast_on_every_tie_and_neighbour():
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # every non-negative finite E4M3 value
    vals = codes.view(torch.float8_e4m3fn).float()
    mids = (vals[:-1] + vals[1:]) / 2  # exact ties in float32
    probe = torch.cat([vals, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                       torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.tensor([464.0, 480.0, 1e30])])
    probe = torch.cat([probe, -probe])
    assert torch.equal(saturating_cast(probe, 448.0, torch.float8_e4m3fn),
                       _torch_reference(probe, 448.0, torch.float8_e4m3fn))
    assert saturating_cast(torch.tensor([464.0, 480.0, float("inf"), -float("inf")]), 448.0,
                           torch.float8_e4m3fn).tolist() == [0x7E, 0x7E, 0x7E, 0xFE]  # saturate to ±448


def test_e5m2_cast_and_canonical_nan():
    x = torch.tensor([float("nan"), -float("nan"), 60000.0, 57344.0, 1.5, -2.0**-16])
    got = saturating_cast(x, 57344.0, torch.float8_e5m2)
    assert got.tolist()[:2] == [0x7F, 0x7F]
    assert got.view(torch.float8_e5m2).float().tolist()[2:] == [57344.0, 57344.0, 1.5, -(2.0**-16)]


def test_e8m0_helpers_at_their_edges():
    e = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    assert e8m0_to_float(e)[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127]
    assert torch.isnan(e8m0_to_float(e)[4])
    assert e8m0_multiplier(e)[:4].tolist() == [2.0**127, 2.0**126, 1.0, 2.0**-127]
    v = torch.tensor([0.0, 1.0, float(np.nextafter(np.float32(1), np.float32(2))), 2.0**-127,
                      2.0**-126 * 0.75, float("inf"), float("nan")])
    assert e8m0_rceil(v).tolist() == [0, 127, 128, 0, 1, 254, 255]
    assert e8m0_floor(torch.tensor([480.0, 448.0, 0.0, float("inf")]), 8).tolist() == [127, 127, 0, 254]
