"""MXFP8Components: validation of the contract (README.md, "The library"), metadata, nbytes."""

from __future__ import annotations

import json

import pytest
import torch

from mxport import MXFP8Components, quantize


def test_metadata_fields_and_json():
    c = quantize(torch.randn(2, 3, 40), torch.float8_e5m2)
    meta = c.metadata()
    assert json.loads(json.dumps(meta)) == meta
    assert meta["format"] == "mxfp8" and meta["element"] == "e5m2" and meta["block_size"] == 32
    assert meta["direction"] == "rowwise" and meta["shape"] == [2, 3, 40] and meta["scale_shape"] == [2, 3, 2]
    assert meta["scale_encoding"] == "e8m0" and meta["scale_layout"] == "compact"
    assert c.nbytes == 2 * 3 * 40 + 2 * 3 * 2
    assert c.shape == torch.Size([2, 3, 40]) and c.fp8_dtype == torch.float8_e5m2


def test_columnwise_metadata():
    c = quantize(torch.randn(70, 8), direction="columnwise")
    assert c.metadata()["scale_shape"] == [3, 8]


def test_frozen():
    c = quantize(torch.randn(2, 32))
    with pytest.raises(AttributeError):
        c.direction = "columnwise"


def test_e8m0fnu_scales_are_bit_viewed():
    data = torch.ones(1, 32).to(torch.float8_e4m3fn)
    s = torch.tensor([[130]], dtype=torch.uint8)
    c = MXFP8Components(data, s.view(torch.float8_e8m0fnu))
    assert c.scale_inv.dtype == torch.uint8 and c.scale_inv.item() == 130
    assert c.dequantize()[0, 0].item() == 8.0


@pytest.mark.parametrize("data, scale, direction, exc, words", [
    (torch.ones(2, 32), torch.zeros(2, 1, dtype=torch.uint8), "rowwise", TypeError, "data must be"),
    (torch.ones(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 1), "rowwise", TypeError, "scale_inv"),
    (torch.ones(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 2, dtype=torch.uint8), "rowwise", ValueError,
     r"expected compact \(2, 1\)"),
    (torch.ones(2, 33).to(torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8), "rowwise", ValueError,
     "does not match"),
    (torch.ones(40, 8).to(torch.float8_e4m3fn), torch.zeros(1, 8, dtype=torch.uint8), "columnwise",
     ValueError, r"expected compact \(2, 8\)"),
    (torch.ones(128, 4, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8), "rowwise", TypeError,
     "data must be"),
    (torch.tensor(1.0).to(torch.float8_e4m3fn), torch.zeros(1, dtype=torch.uint8), "rowwise", ValueError,
     "0-d"),
    (torch.ones(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8), "both", ValueError,
     "direction"),
])
def test_validation(data, scale, direction, exc, words):
    with pytest.raises(exc, match=words):
        MXFP8Components(data, scale, direction)


def test_block_size_must_be_32():
    with pytest.raises(ValueError, match="block_size"):
        MXFP8Components(torch.ones(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8),
                        "rowwise", 16)


def test_padded_te_scale_is_rejected():
    # a [3, 64] weight with TE's padded [128, 4] scale grid is not the compact contract
    with pytest.raises(ValueError, match=r"expected compact \(3, 2\)"):
        MXFP8Components(torch.ones(3, 64).to(torch.float8_e4m3fn), torch.zeros(128, 4, dtype=torch.uint8))
