"""Transformer Engine MXFP8 storages (hand-built exactly as TE lays them out) -> export_components.

Layout facts: TE ``pytorch/tensor/storage/mxfp8_tensor_storage.py``, summarized in docs/format.md ("Scale
layouts: compact, padded, swizzled"). The reference layouts below are computed independently from that byte
formula, not with mxport.layouts.
"""

from __future__ import annotations

import enum
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mxport
from mxport.sources.te import to_te_layout

E8M0FNU = torch.float8_e8m0fnu


class DType(enum.IntEnum):
    """Stand-in for ``transformer_engine_torch.DType`` (values from transformer_engine.h)."""

    kFloat32 = 4
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


TE_CODE = {torch.float8_e4m3fn: DType.kFloat8E4M3, torch.float8_e5m2: DType.kFloat8E5M2}


def _ceil(a, b):
    return -(-a // b)


def _up(a, m):
    return _ceil(a, m) * m


def ref_padded(compact2d: torch.Tensor, direction: str) -> torch.Tensor:
    r, c = compact2d.shape
    pr, pc = (_up(r, 128), _up(c, 4)) if direction == "rowwise" else (_up(r, 4), _up(c, 128))
    out = np.zeros((pr, pc), dtype=np.uint8)
    out[:r, :c] = compact2d.numpy()
    return torch.from_numpy(out)


def ref_swizzle_bytes(compact2d: torch.Tensor) -> torch.Tensor:
    """docs/format.md, "Scale layouts": entry (r, c) -> ((r//128)*ceil(C/4) + c//4)*512 + (r%32)*16 +
    ((r%128)//32)*4 + c%4."""
    r_n, c_n = compact2d.shape
    out = np.zeros(_up(r_n, 128) * _up(c_n, 4), dtype=np.uint8)
    r, c = np.meshgrid(np.arange(r_n), np.arange(c_n), indexing="ij")
    off = ((r // 128) * _ceil(c_n, 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    out[off.ravel()] = compact2d.numpy().ravel()
    return torch.from_numpy(out)


def grid_dims(shape, direction):
    m = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    k = shape[-1]
    return (m, _ceil(k, 32)) if direction == "rowwise" else (_ceil(m, 32), k)


def make_source(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    # spread magnitudes across blocks so scales differ (and some blocks are tiny / huge)
    k = shape[-1]
    x = x * torch.exp2(torch.randint(-20, 20, (k,), generator=g).float())
    return x


def te_storage(x, fp8, direction, *, swizzled=False, garbage=True, both=True, seed=1, fp8_code=None):
    """Build a TE-like storage for ``x``: the asked direction (and the other too when ``both``)."""
    g = torch.Generator().manual_seed(seed)
    fields = {}
    for d in ("rowwise", "columnwise"):
        if d != direction and not both:
            fields[f"_{d}_data"] = None
            fields[f"_{d}_scale_inv"] = None
            continue
        c = mxport.quantize(x, fp8, direction=d)
        data, scale = to_te_layout(c, swizzled=swizzled)
        if garbage and not swizzled:
            rows, cols = grid_dims(tuple(x.shape), d)
            noise = torch.randint(0, 256, scale.shape, dtype=torch.uint8, generator=g)
            noise[:rows, :cols] = scale[:rows, :cols]
            scale = noise
        fields[f"_{d}_data"] = data
        fields[f"_{d}_scale_inv"] = scale
    code = TE_CODE[fp8] if fp8_code is None else fp8_code
    return SimpleNamespace(_fp8_dtype=code, _with_gemm_swizzled_scales=swizzled, **fields)


def assert_same(e: mxport.MXFP8Components, ref: mxport.MXFP8Components):
    assert e.direction == ref.direction
    assert e.shape == ref.shape and e.fp8_dtype == ref.fp8_dtype
    assert torch.equal(e.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(e.scale_inv, ref.scale_inv)
    assert torch.equal(e.dequantize(), ref.dequantize())


#: shapes TE makes (M and K multiples of 32): rows padded to 128 or not, 2, 5, 1, 3, 128 blocks per row
SHAPES = [(32, 64), (96, 160), (128, 32), (2, 48, 96), (256, 4096)]


# -- to_te_layout matches TE's layout, computed independently
# ---------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_to_te_layout_matches_reference(shape, direction):
    c = mxport.quantize(make_source(shape), direction=direction)
    rows, cols = grid_dims(shape, direction)
    compact2d = c.scale_inv.reshape(rows, cols)
    data, scale = to_te_layout(c)
    assert data.dtype == torch.uint8 and data.shape == c.shape and data.data_ptr() == c.data.data_ptr()
    assert torch.equal(scale, ref_padded(compact2d, direction))
    data, sw = to_te_layout(c, swizzled=True)
    assert sw.shape == scale.shape  # TE keeps the padded shape; only the byte order changes
    ref = ref_swizzle_bytes(compact2d if direction == "rowwise" else compact2d.t().contiguous())
    assert torch.equal(sw.reshape(-1), ref)


# -- export decodes to exactly what quantize gives
# ----------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("swizzled", [False, True])
def test_te_export_matches_quantize(shape, direction, fp8, swizzled):
    x = make_source(shape)
    ref = mxport.quantize(x, fp8, direction=direction)
    store = te_storage(x, fp8, direction, swizzled=swizzled)
    e = mxport.export_components(store, direction=direction)
    assert_same(e, ref)
    assert e.data.data_ptr() == getattr(store, f"_{direction}_data").data_ptr()
    assert e.scale_inv.is_contiguous()
    if direction == "rowwise":
        assert tuple(e.scale_inv.shape) == (*shape[:-1], _ceil(shape[-1], 32))


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 10).map(lambda a: 32 * a),
    k=st.integers(1, 10).map(lambda a: 32 * a),
    direction=st.sampled_from(["rowwise", "columnwise"]),
    swizzled=st.booleans(),
)
def test_te_export_any_shape(m, k, direction, swizzled):
    x = make_source((m, k), seed=m * 1000 + k)
    ref = mxport.quantize(x, direction=direction)
    e = mxport.export_components(te_storage(x, torch.float8_e4m3fn, direction, swizzled=swizzled),
                                 direction=direction)
    assert_same(e, ref)


def test_fp8_dtype_spellings():
    x = make_source((64, 64))
    for code, fp8 in [(7, torch.float8_e4m3fn), (8, torch.float8_e5m2),
                      (DType.kFloat8E5M2, torch.float8_e5m2), (torch.float8_e4m3fn, torch.float8_e4m3fn),
                      ("DType.kFloat8E5M2", torch.float8_e5m2)]:
        e = mxport.export_components(te_storage(x, fp8, "rowwise", fp8_code=code))
        assert e.fp8_dtype == fp8


# -- views, copies and writes showing through
# ---------------------------------------------------------------------
def test_rowwise_view_and_writes_show_through():
    x = make_source((160, 128))  # 128/32 = 4 columns: TE pads rows only -> scales are a view
    store = te_storage(x, torch.float8_e4m3fn, "rowwise")
    e = mxport.export_components(store)
    assert e.data.data_ptr() == store._rowwise_data.data_ptr()
    assert e.scale_inv.data_ptr() == store._rowwise_scale_inv.data_ptr()
    # an optimizer step writes the producer in place
    store._rowwise_data[5, 7] = 0x38  # E4M3 1.0
    store._rowwise_scale_inv[5, 0] = 130
    assert e.data.view(torch.uint8)[5, 7].item() == 0x38
    assert e.scale_inv[5, 0].item() == 130
    assert e.dequantize()[5, 7].item() == 8.0


def test_columnwise_view_when_k_multiple_of_128():
    store = te_storage(make_source((96, 256)), torch.float8_e4m3fn, "columnwise")
    e = mxport.export_components(store, direction="columnwise")
    assert e.scale_inv.data_ptr() == store._columnwise_scale_inv.data_ptr()
    store._columnwise_data.fill_(0)
    assert int(e.data.view(torch.uint8).sum()) == 0


@pytest.mark.parametrize(
    "shape,direction,swizzled",
    [((96, 96), "rowwise", False), ((64, 96), "columnwise", False), ((160, 128), "rowwise", True)],
)
def test_scales_copied_when_padding_in_last_dim_or_swizzled(shape, direction, swizzled):
    store = te_storage(make_source(shape), torch.float8_e4m3fn, direction, swizzled=swizzled)
    e = mxport.export_components(store, direction=direction)
    s = getattr(store, f"_{direction}_scale_inv")
    assert e.data.data_ptr() == getattr(store, f"_{direction}_data").data_ptr()
    assert e.scale_inv.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
    s.fill_(200)  # the copy does not follow the producer's scale writes
    assert int(e.scale_inv.max()) < 200


def test_one_dimensional_padded_scale_buffer():
    x = make_source((96, 96))
    store = te_storage(x, torch.float8_e4m3fn, "rowwise")
    store._rowwise_scale_inv = store._rowwise_scale_inv.reshape(-1)
    assert_same(mxport.export_components(store), mxport.quantize(x))


# -- bad inputs
# ---------------------------------------------------------------------------------------------------
def test_missing_direction_data():
    store = te_storage(make_source((64, 64)), torch.float8_e4m3fn, "columnwise", both=False)
    with pytest.raises(ValueError, match="no rowwise data"):
        mxport.export_components(store)
    store = te_storage(make_source((64, 64)), torch.float8_e4m3fn, "rowwise", both=False)
    with pytest.raises(ValueError, match="columnwise"):
        mxport.export_components(store, direction="columnwise")
    store._rowwise_scale_inv = None
    with pytest.raises(ValueError, match="_rowwise_scale_inv"):
        mxport.export_components(store)


def test_e8m0fnu_scales_are_bit_viewed_not_value_cast():
    x = make_source((96, 96))
    store = te_storage(x, torch.float8_e4m3fn, "rowwise")
    store._rowwise_scale_inv = store._rowwise_scale_inv.view(E8M0FNU)
    e = mxport.export_components(store)
    assert e.scale_inv.dtype == torch.uint8
    assert_same(e, mxport.quantize(x))
    store = te_storage(x, torch.float8_e4m3fn, "rowwise", swizzled=True)
    store._rowwise_scale_inv = store._rowwise_scale_inv.view(E8M0FNU)
    assert_same(mxport.export_components(store), mxport.quantize(x))


def test_wrong_dtypes():
    x = make_source((64, 64))
    store = te_storage(x, torch.float8_e4m3fn, "rowwise")
    bad = SimpleNamespace(**{**vars(store), "_rowwise_scale_inv": store._rowwise_scale_inv.float()})
    with pytest.raises(TypeError, match="_rowwise_scale_inv"):
        mxport.export_components(bad)
    bad = SimpleNamespace(**{**vars(store), "_rowwise_data": store._rowwise_data.float()})
    with pytest.raises(TypeError, match="_rowwise_data"):
        mxport.export_components(bad)
    bad = SimpleNamespace(**{**vars(store), "_rowwise_data": store._rowwise_data.view(torch.float8_e5m2)})
    with pytest.raises(TypeError, match="_rowwise_data"):
        mxport.export_components(bad)  # declared E4M3, holds E5M2
    for code in (DType.kFloat4E2M1, DType.kFloat32, torch.bfloat16, "fp8"):
        bad = SimpleNamespace(**{**vars(store), "_fp8_dtype": code})
        with pytest.raises(TypeError, match="_fp8_dtype"):
            mxport.export_components(bad)


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_scale_grid_too_small(direction):
    store = te_storage(make_source((320, 224)), torch.float8_e4m3fn, direction)
    name = f"_{direction}_scale_inv"
    s = getattr(store, name)
    setattr(store, name, s[: s.shape[0] // 4, :])
    with pytest.raises(ValueError, match=f"{name}.*too small"):
        mxport.export_components(store, direction=direction)
    setattr(store, name, s[:, :1])
    with pytest.raises(ValueError, match="too small"):
        mxport.export_components(store, direction=direction)
    store = te_storage(make_source((320, 224)), torch.float8_e4m3fn, direction, swizzled=True)
    setattr(store, name, getattr(store, name).reshape(-1)[:-512])
    with pytest.raises(ValueError, match=name):
        mxport.export_components(store, direction=direction)


# -- TE's own shape rule: M and K multiples of 32 (MXFP8Quantizer::get_scale_shape) --------------------------
@pytest.mark.parametrize("shape", [(32, 200), (3, 64), (100, 48), (64,), (2, 3, 64), (128, 16)])
def test_shapes_te_refuses_are_refused(shape):
    """TE makes no MXFP8 tensor of these shapes ("MXFP8 requires tensor dims that are divisible by 32"), so
    neither reading one (whatever grid came with it) nor laying one out as TE would is allowed: before, K =
    200 was read with a ceil(200/32) = 7-column grid where TE's arithmetic gives 200 // 32 = 6."""
    from mxport.sources.te import components_from_te_parts, scale_grid_dims

    c = mxport.quantize(make_source(shape) if len(shape) > 1 else torch.randn(shape))
    m, k = int(np.prod(shape[:-1])), shape[-1]
    words = rf"shape {re.escape(str(tuple(shape)))} \(M={m}, K={k}\) is not a TE MXFP8 shape"
    with pytest.raises(ValueError, match=words):
        to_te_layout(c)
    rows, cols = scale_grid_dims(shape, "rowwise")
    grid = torch.zeros(_up(rows, 128), _up(cols, 4), dtype=torch.uint8)
    store = SimpleNamespace(_rowwise_data=c.data.view(torch.uint8), _rowwise_scale_inv=grid,
                            _columnwise_data=None, _columnwise_scale_inv=None, _fp8_dtype=DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="_rowwise_data of " + words):
        mxport.export_components(store)
    with pytest.raises(ValueError, match="data of " + words):
        components_from_te_parts(c.data, grid, torch.float8_e4m3fn, "rowwise")


def test_te_grid_is_te_arithmetic_for_every_shape_it_accepts():
    """For the shapes TE makes, mxport's padded grid is exactly TE's get_scale_shape (floor division, padded
    to 128 x 4 rowwise, 4 x 128 columnwise)."""
    for m, k in [(32, 32), (96, 576), (160, 4096), (4096, 96)]:
        c = mxport.quantize(make_source((m, k)))
        assert tuple(to_te_layout(c)[1].shape) == (_up(m, 128), _up(k // 32, 4))
        c = mxport.quantize(make_source((m, k)), direction="columnwise")
        assert tuple(to_te_layout(c)[1].shape) == (_up(m // 32, 4), _up(k, 128))


def test_unknown_objects():
    for obj in (object(), "weight", 3.0, [1, 2], SimpleNamespace(_rowwise_data=None)):
        with pytest.raises(TypeError, match="Transformer Engine"):
            mxport.export_components(obj)
