"""Grouped MoE storage -> one MXFP8Components per expert, in order.

The TE grouped storage stand-in follows transformer_engine/pytorch/tensor/storage/grouped_tensor_storage.py:
one flat uint8 data buffer, per-expert element offsets, per-expert TE-padded scale grids back to back.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mxport
from mxport.sources.te import to_te_layout

UNIFORM = [(64, 96)] * 4
VARYING = [(32, 96), (100, 96), (1, 96), (128, 96)]


def experts(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s, generator=g) * torch.exp2(torch.randint(-12, 12, (s[-1],), generator=g).float())
        * (i + 1)
        for i, s in enumerate(shapes)
    ]


def grouped_storage(xs, direction, *, fp8=torch.float8_e4m3fn, swizzled=False, explicit_offsets=True,
                    explicit_shapes=True):
    g = torch.Generator().manual_seed(7)
    datas, scales, s_off, d_off = [], [], [0], [0]
    for x in xs:
        c = mxport.quantize(x, fp8, direction=direction)
        data, scale = to_te_layout(c, swizzled=swizzled)
        if not swizzled:  # TE leaves padding uninitialized: fill it with garbage
            rows = x.shape[0] if direction == "rowwise" else -(-x.shape[0] // 32)
            compact = c.scale_inv.reshape(rows, -1)
            noise = torch.randint(0, 256, scale.shape, dtype=torch.uint8, generator=g)
            noise[: compact.shape[0], : compact.shape[1]] = compact
            scale = noise
        datas.append(data.reshape(-1))
        scales.append(scale.reshape(-1))
        d_off.append(d_off[-1] + data.numel())
        s_off.append(s_off[-1] + scale.numel())
    code = {torch.float8_e4m3fn: 7, torch.float8_e5m2: 8}[fp8]
    row = direction == "rowwise"
    first = [x.shape[0] for x in xs]
    uniform = len(set(first)) == 1
    return SimpleNamespace(
        num_tensors=len(xs),
        tensor_shapes=[tuple(x.shape) for x in xs] if explicit_shapes else None,
        first_dims=None if uniform else torch.tensor(first, dtype=torch.int64),
        last_dims=None,
        logical_shape=(sum(first), xs[0].shape[1]),
        rowwise_data=torch.cat(datas) if row else None,
        columnwise_data=None if row else torch.cat(datas),
        scale_inv=torch.cat(scales) if row else None,
        columnwise_scale_inv=None if row else torch.cat(scales),
        offsets=d_off if explicit_offsets else None,
        tensor_offsets=None,
        scale_inv_offsets=s_off if (explicit_offsets and row) else None,
        columnwise_scale_inv_offsets=s_off if (explicit_offsets and not row) else None,
        quantizer=SimpleNamespace(dtype=code, optimize_for_gemm=swizzled),
        _with_gemm_swizzled_scales=swizzled,
    )


def assert_same(e, ref):
    assert e.direction == ref.direction and e.shape == ref.shape and e.fp8_dtype == ref.fp8_dtype
    assert torch.equal(e.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(e.scale_inv, ref.scale_inv)
    assert torch.equal(e.dequantize(), ref.dequantize())


@pytest.mark.parametrize("shapes", [UNIFORM, VARYING], ids=["uniform", "varying"])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("explicit", [True, False])
def test_te_grouped_four_experts_in_order(shapes, direction, swizzled, explicit):
    xs = experts(shapes)
    store = grouped_storage(xs, direction, swizzled=swizzled, explicit_offsets=explicit,
                            explicit_shapes=explicit)
    out = mxport.export_grouped_components(store, direction=direction)
    assert len(out) == 4
    buf = store.rowwise_data if direction == "rowwise" else store.columnwise_data
    start = 0
    for e, x in zip(out, xs, strict=True):
        assert_same(e, mxport.quantize(x, direction=direction))
        assert e.data.data_ptr() == buf.data_ptr() + start  # a view into the one flat buffer
        start += x.numel()


def test_te_grouped_e5m2_and_write_through():
    xs = experts(UNIFORM, seed=2)
    store = grouped_storage(xs, "rowwise", fp8=torch.float8_e5m2)
    out = mxport.export_grouped_components(store)
    for e, x in zip(out, xs, strict=True):
        assert_same(e, mxport.quantize(x, torch.float8_e5m2))
    store.rowwise_data[64 * 96 * 2] = 0  # first element of expert 2
    assert out[2].data.view(torch.uint8)[0, 0].item() == 0
    # K = 96 -> 3 scale columns padded to 4: scales are compact copies
    assert out[2].scale_inv.untyped_storage().data_ptr() != store.scale_inv.untyped_storage().data_ptr()


def test_te_grouped_bad_inputs():
    xs = experts(UNIFORM)
    store = grouped_storage(xs, "rowwise")
    with pytest.raises(ValueError, match="no columnwise data"):
        mxport.export_grouped_components(store, direction="columnwise")
    short = SimpleNamespace(**{**vars(store), "scale_inv": store.scale_inv[:-10]})
    with pytest.raises(ValueError, match="scale_inv.*too small"):
        mxport.export_grouped_components(short)
    short = SimpleNamespace(**{**vars(store), "rowwise_data": store.rowwise_data[:-1]})
    with pytest.raises(ValueError, match="rowwise_data"):
        mxport.export_grouped_components(short)
    no_dtype = SimpleNamespace(**{**vars(store), "quantizer": None})
    with pytest.raises(ValueError, match="FP8 dtype"):
        mxport.export_grouped_components(no_dtype)
    with pytest.raises(TypeError, match="quantize options"):
        mxport.export_grouped_components(store, rounding="floor")


# -- 3-D [E, N, K] expert weights
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_float_3d_quantized_per_expert(direction):
    w = torch.stack(experts([(40, 80)] * 4, seed=4))
    out = mxport.export_grouped_components(w, direction=direction, fp8_dtype=torch.float8_e5m2)
    assert len(out) == 4
    for i, e in enumerate(out):
        assert_same(e, mxport.quantize(w[i], torch.float8_e5m2, direction=direction))


def test_components_3d_split_are_views():
    w = torch.stack(experts([(64, 80)] * 4, seed=5))
    for direction in ("rowwise", "columnwise"):
        c = mxport.quantize(w, direction=direction)
        out = mxport.export_grouped_components(c, direction=direction)
        for i, e in enumerate(out):
            assert_same(e, mxport.quantize(w[i], direction=direction))
            assert e.data.untyped_storage().data_ptr() == c.data.untyped_storage().data_ptr()
            assert e.scale_inv.untyped_storage().data_ptr() == c.scale_inv.untyped_storage().data_ptr()


def test_te_3d_storage_split():
    w = torch.stack(experts([(64, 96)] * 4, seed=6))
    data, scale = to_te_layout(mxport.quantize(w))
    store = SimpleNamespace(_rowwise_data=data, _rowwise_scale_inv=scale, _columnwise_data=None,
                            _columnwise_scale_inv=None, _fp8_dtype=7)
    for i, e in enumerate(mxport.export_grouped_components(store)):
        assert_same(e, mxport.quantize(w[i]))


def test_3d_bad_inputs():
    with pytest.raises(ValueError, match="3-D"):
        mxport.export_grouped_components(torch.randn(4, 64))
    c = mxport.quantize(torch.randn(4, 40, 64), direction="columnwise")  # blocks straddle experts
    with pytest.raises(ValueError, match="straddle"):
        mxport.export_grouped_components(c, direction="columnwise")
    with pytest.raises(ValueError, match="3-D"):
        mxport.export_grouped_components(mxport.quantize(torch.randn(64, 64)))
    with pytest.raises(TypeError, match="accepts"):
        mxport.export_grouped_components(object())
