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
VARYING = [(32, 96), (160, 96), (64, 96), (128, 96)]


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
        data, scale = to_te_layout(c, swizzled=swizzled, grouped=True)
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


# -- 3-D [E, N, K] expert weights ----------------------------------------------------------------------------
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


# -- TE GroupedTensor: a torch.Tensor wrapper subclass, and the nn.Parameter GroupedLinear registers ---------
#: the storage fields TE's GroupedTensor.__torch_dispatch__ copies onto detach()/alias() wrappers
#: (transformer_engine/pytorch/tensor/grouped_tensor.py, copy_grouped_storage_metadata)
GROUPED_FIELDS = (
    "num_tensors", "quantizer", "tensor_shapes", "fake_dtype", "rowwise_data", "columnwise_data", "scale_inv",
    "columnwise_scale_inv", "amax", "columnwise_amax", "scale", "first_dims", "last_dims", "tensor_offsets",
    "offsets", "scale_inv_offsets", "columnwise_scale_inv_offsets", "logical_shape", "quantized_tensors",
    "_with_gemm_swizzled_scales",
)


def _contiguous_strides(shape):
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


class GroupedTensor(torch.Tensor):
    """Stand-in for TE's ``GroupedTensor(GroupedTensorStorage, torch.Tensor)``: built with
    ``torch.Tensor._make_wrapper_subclass`` (nominal dtype bf16, shape ``(num_tensors, rows, cols)`` for
    equal members, else ``logical_shape``), storage fields as plain attributes, ``__torch_function__``
    disabled, ``detach`` / ``alias`` answered with a wrapper carrying the same fields (what ``nn.Parameter``
    calls), every other op refused. ``copied_fields`` lets a test play a TE version whose detach did not
    copy the swizzle flag."""

    copied_fields = GROUPED_FIELDS

    @staticmethod
    def __new__(cls, fields: dict, requires_grad: bool = False):
        shapes, n = fields.get("tensor_shapes"), fields["num_tensors"]
        if shapes and all(tuple(s) == tuple(shapes[0]) for s in shapes):
            wrapper_shape = (n, *shapes[0])
        else:
            wrapper_shape = tuple(fields["logical_shape"])
        buf = fields["rowwise_data"] if fields["rowwise_data"] is not None else fields["columnwise_data"]
        inst = torch.Tensor._make_wrapper_subclass(
            cls, wrapper_shape, strides=_contiguous_strides(wrapper_shape), storage_offset=0,
            dtype=torch.bfloat16, layout=torch.strided, requires_grad=requires_grad, device=buf.device,
        )
        for name in GROUPED_FIELDS:
            setattr(inst, name, fields.get(name))
        inst.fake_dtype = torch.bfloat16
        return inst

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            src = args[0]
            out = torch.Tensor._make_wrapper_subclass(
                type(src), tuple(src.shape), strides=tuple(src.stride()), storage_offset=0, dtype=src.dtype,
                layout=src.layout, requires_grad=False, device=src.device,
            )
            for name in type(src).copied_fields:
                setattr(out, name, getattr(src, name))
            return out
        raise RuntimeError(f"GroupedTensor forbids {func}")


class OldTEGroupedTensor(GroupedTensor):
    """TE before the swizzle flag was copied by detach (e.g. commit 024ef158 of grouped_tensor.py)."""

    copied_fields = tuple(f for f in GROUPED_FIELDS if f != "_with_gemm_swizzled_scales")


def grouped_tensor(xs, direction, cls=GroupedTensor, **kw):
    return cls(vars(grouped_storage(xs, direction, **kw)))


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("as_param", [False, True], ids=["tensor", "parameter"])
def test_te_grouped_tensor_subclass(direction, swizzled, as_param):
    xs = experts(UNIFORM, seed=8)
    gt = grouped_tensor(xs, direction, swizzled=swizzled)
    obj = torch.nn.Parameter(gt) if as_param else gt
    assert type(obj) is GroupedTensor and isinstance(obj, torch.Tensor) and obj.dtype == torch.bfloat16
    assert isinstance(obj, torch.nn.Parameter) == as_param
    buf = gt.rowwise_data if direction == "rowwise" else gt.columnwise_data
    per_expert = mxport.export_grouped_components(obj, direction=direction)
    assert len(per_expert) == 4
    for i, (e, x) in enumerate(zip(per_expert, xs, strict=True)):
        assert_same(e, mxport.quantize(x, direction=direction))
        assert e.data.data_ptr() == buf.data_ptr() + i * x.numel()
    whole = mxport.export_components(obj, direction=direction)  # the parameter's own [E, N, K]
    assert whole.shape == tuple(obj.shape) == (4, 64, 96)
    assert_same(whole, mxport.quantize(torch.stack(xs), direction=direction))
    assert whole.data.data_ptr() == buf.data_ptr() and whole.scale_inv.is_contiguous()
    with pytest.raises(TypeError, match="quantize options"):
        mxport.export_components(obj, direction=direction, rounding="floor")


def test_te_grouped_parameter_without_swizzle_flag_uses_quantizer():
    xs = experts(UNIFORM, seed=9)
    param = torch.nn.Parameter(grouped_tensor(xs, "rowwise", cls=OldTEGroupedTensor, swizzled=True))
    assert not hasattr(param, "_with_gemm_swizzled_scales") and param.quantizer.optimize_for_gemm
    for e, x in zip(mxport.export_grouped_components(param), xs, strict=True):
        assert_same(e, mxport.quantize(x))
    assert_same(mxport.export_components(param), mxport.quantize(torch.stack(xs)))


def test_te_grouped_tensor_unpadded_scales_are_views():
    xs = experts([(128, 128)] * 3, seed=10)  # N % 128 == 0, K/32 = 4: TE's grids hold no padding
    gt = grouped_tensor(xs, "rowwise")
    whole = mxport.export_components(torch.nn.Parameter(gt))
    assert_same(whole, mxport.quantize(torch.stack(xs)))
    assert whole.scale_inv.data_ptr() == gt.scale_inv.data_ptr()
    assert whole.data.data_ptr() == gt.rowwise_data.data_ptr()
    gt.rowwise_data[128 * 128] = 0  # first element of expert 1, written in place
    assert whole.data.view(torch.uint8)[1, 0, 0].item() == 0


def test_te_grouped_tensor_varying_shapes():
    xs = experts(VARYING, seed=11)
    gt = grouped_tensor(xs, "rowwise")
    assert tuple(gt.shape) == (sum(x.shape[0] for x in xs), 96)  # wrapper shape = logical_shape
    for e, x in zip(mxport.export_grouped_components(gt), xs, strict=True):
        assert_same(e, mxport.quantize(x))
    with pytest.raises(ValueError, match="different shapes"):
        mxport.export_components(gt)


def test_te_grouped_members_follow_tes_grid_arithmetic():
    """TE sizes a grouped member's grids with MXFP8Quantizer.get_scale_shape's floor divisions (rows
    roundup(M, 128) x roundup(K // 32, 4) rowwise, roundup(M // 32, 4) x roundup(K, 128) columnwise): rows
    need not be a multiple of 32 rowwise, but the dimension the blocks run along must be whole blocks."""
    xs = experts([(40, 64), (100, 64)], seed=12)
    for e, x in zip(mxport.export_grouped_components(grouped_tensor(xs, "rowwise")), xs, strict=True):
        assert_same(e, mxport.quantize(x))
    # columnwise, 40 rows: TE's grid has roundup(40 // 32, 4) = 4 x 128 bytes per member, with no scale for
    # rows 32..39; the storage as TE allocates it (values of both members, grids zero-filled)
    data = torch.cat([mxport.quantize(x, direction="columnwise").data.view(torch.uint8).reshape(-1)
                      for x in xs])
    gt = GroupedTensor(dict(
        num_tensors=2, tensor_shapes=[(40, 64), (100, 64)], first_dims=torch.tensor([40, 100]),
        last_dims=None, logical_shape=(140, 64), rowwise_data=None, columnwise_data=data, scale_inv=None,
        columnwise_scale_inv=torch.zeros(2 * 4 * 128, dtype=torch.uint8), offsets=[0, 40 * 64, 140 * 64],
        tensor_offsets=None, scale_inv_offsets=None, columnwise_scale_inv_offsets=[0, 512, 1024],
        quantizer=SimpleNamespace(dtype=7, optimize_for_gemm=False), _with_gemm_swizzled_scales=False))
    words = (r"columnwise_data\[expert 0\] of shape \(40, 64\) \(M=40, K=64\) is not a TE MXFP8 shape: TE "
             r"sizes a grouped member's columnwise grid with M // 32")
    with pytest.raises(ValueError, match=words):
        mxport.export_grouped_components(gt, direction="columnwise")
    with pytest.raises(ValueError, match=words):
        mxport.export_components(gt, direction="columnwise")


def high_precision_grouped(xs, dtype=torch.bfloat16):
    """TE's GroupedLinear(single_grouped_weight=True) without an FP8 recipe: quantizer None, bf16 data."""
    n = len(xs)
    return GroupedTensor({
        "num_tensors": n, "quantizer": None, "tensor_shapes": [tuple(x.shape) for x in xs],
        "rowwise_data": torch.cat([x.to(dtype).reshape(-1) for x in xs]),
        "offsets": [i * xs[0].numel() for i in range(n + 1)],
        "logical_shape": (sum(x.shape[0] for x in xs), xs[0].shape[1]), "_with_gemm_swizzled_scales": False,
    })


def test_high_precision_grouped_tensor_is_quantized():
    xs = [x.bfloat16() for x in experts(UNIFORM, seed=13)]
    param = torch.nn.Parameter(high_precision_grouped(xs))
    out = mxport.export_grouped_components(param, fp8_dtype=torch.float8_e5m2)
    for e, x in zip(out, xs, strict=True):
        assert_same(e, mxport.quantize(x, torch.float8_e5m2))
    whole = mxport.export_components(param, direction="columnwise")
    assert_same(whole, mxport.quantize(torch.stack(xs), direction="columnwise"))


def test_te_grouped_tensor_with_gaps_between_members():
    xs = experts([(32, 64)] * 3, seed=14)
    fields = vars(grouped_storage(xs, "rowwise"))
    numel = xs[0].numel()
    gap = torch.full((16,), 0x7F, dtype=torch.uint8)  # bytes that belong to no member
    members = fields["rowwise_data"].split(numel)
    fields["rowwise_data"] = torch.cat([members[0], gap, members[1], gap, members[2]])
    fields["offsets"] = [0, numel + 16, 2 * (numel + 16)]
    gt = GroupedTensor(fields)
    for e, x in zip(mxport.export_grouped_components(gt), xs, strict=True):
        assert_same(e, mxport.quantize(x))
    with pytest.raises(ValueError, match="packed back to back"):
        mxport.export_components(gt)
