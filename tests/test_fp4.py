"""MXFP4 and NVFP4 (mxport.fp4): E2M1 codes against torchao's independent cast, MXFP4 against torchao's
``to_mx``, NVFP4 byte for byte against ModelOpt's own ``NVFP4QTensor``, and ModelOpt's MXFP4 differences
explained by its rule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxport.fp4 import (
    E2M1_MAGNITUDES,
    MXFP4,
    NVFP4,
    e2m1_codes,
    e2m1_values,
    pack_e2m1,
    quantize_fp4,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_e2m1,
)


def _sweep() -> torch.Tensor:
    """Every float32 from 2**-4 to 8 in steps of 2**-10, the midpoints and neighbours of every tie, the
    saturating range, and their negatives."""
    grid = torch.arange(0, 8 * 1024 + 1, dtype=torch.float32) / 1024
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(7)),
                      torch.nextafter(mids, torch.full((7,), 9.0))])
    big = torch.tensor([6.0, 6.5, 7.0, 1e6, 3.4e38])
    x = torch.cat([grid, near, big])
    return torch.cat([x, -x[x > 0]])


def _weights(seed: int, shape=(24, 96), dtype=torch.bfloat16) -> torch.Tensor:
    """Random weights over a wide range of block magnitudes, with an all-zero block and a zero row."""
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.exp2(torch.randint(-12, 12, (shape[0], 1), generator=g).float())
    x = torch.randn(shape, generator=g) * row_scale
    x[0, :32] = 0
    x[1] = 0
    return x.to(dtype)


def test_e2m1_codes_round_to_nearest_even_as_torchao_casts():
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked

    x = _sweep()
    want = f32_to_f4_unpacked(x.clamp(-6, 6))
    assert torch.equal(e2m1_codes(x), want)
    # -0.0: torchao keeps the sign bit (code 8); mxport, like ModelOpt's NVFP4 cast, encodes it as +0
    neg_zero = torch.tensor([-0.0])
    assert e2m1_codes(neg_zero).item() == 0 and f32_to_f4_unpacked(neg_zero).item() == 8


def test_e2m1_ties_and_saturation_by_hand():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 100.0, -0.75, -100.0])
    assert e2m1_values(e2m1_codes(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -6.0]


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
@settings(max_examples=50, deadline=None)
def test_packing_is_low_nibble_first_and_round_trips(codes):
    c = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_e2m1(c)
    assert packed.tolist() == [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]
    assert torch.equal(unpack_e2m1(packed), c)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_equals_torchao_to_mx(rounding, dtype):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = _weights(1, dtype=dtype)
    mode = ScaleCalculationMode.RCEIL if rounding == "rceil" else ScaleCalculationMode.FLOOR
    scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32, mode)
    got = quantize_mxfp4(x, rounding=rounding)
    assert torch.equal(got.scale, scale.view(torch.uint8))
    assert torch.equal(got.data, data.view(torch.uint8))


def test_mxfp4_decodes_within_half_a_step_of_every_value():
    x = _weights(2, dtype=torch.float32)
    c = quantize_mxfp4(x)
    assert c.data.shape == (24, 48) and c.scale.shape == (24, 3) and c.global_scale is None
    scale = torch.exp2(c.scale.float() - 127).repeat_interleave(32, dim=1)
    err = (c.dequantize() - x).abs() / scale  # in units of the block's scale
    step = torch.tensor(E2M1_MAGNITUDES[1:]) - torch.tensor(E2M1_MAGNITUDES[:-1])
    assert float(err.max()) <= float(step.max()) / 2  # rceil never saturates: every value is rounded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [3, 4])
def test_nvfp4_equals_modelopt_byte_for_byte(dtype, seed):
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    x = _weights(seed, shape=(32, 160), dtype=dtype)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    q, scale, g = qtensor.NVFP4QTensor.quantize(x.clone(), 16)
    got = quantize_nvfp4(x)
    assert torch.equal(got.global_scale, g.reshape(()))
    assert torch.equal(got.scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(got.data, q._quantized_data)
    want = q.dequantize(torch.float32, scale=scale, double_scale=g, block_sizes={-1: 16})
    assert torch.equal(got.dequantize(), want)


def test_nvfp4_shared_global_scale_and_an_all_zero_tensor():
    x = _weights(5, shape=(8, 64), dtype=torch.float32)
    shared = torch.tensor(2.0)
    assert torch.equal(quantize_nvfp4(x, shared).global_scale, shared)
    z = quantize_nvfp4(torch.zeros(4, 32))  # ModelOpt writes NaN scales here (0 / 0)
    assert z.global_scale.item() == 1.0 and torch.equal(z.dequantize(), torch.zeros(4, 32))
    assert torch.equal(z.scale.view(torch.uint8), torch.full((4, 2), 0x38, dtype=torch.uint8))  # E4M3 1.0


def test_modelopt_mxfp4_differs_only_by_its_rule():
    """ModelOpt 0.47's MXFP4QTensor: the same scales here (ceil(log2(amax / 6)) in float), but its element
    cast rounds ties toward zero (0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3) and encodes +0.0 as -0 (code 8, from
    torch.sign(0) = 0). Every byte that differs is one of those two cases, counted."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.mxfp4_tensor")
    x = _weights(6, shape=(64, 256), dtype=torch.float32)
    x[2, :32] = 0
    x[2, :8] = torch.tensor([0.75, 1.75, 3.5, -0.75, 1.25, 0.25, 2.5, 5.0]) * 2.0 ** -2  # ties
    x[2, 8] = 1.5  # the block's amax: scale 2**-2, so these scale to the ties themselves
    q, scale = qtensor.MXFP4QTensor.quantize(x.clone(), 32)
    got = quantize_mxfp4(x)
    assert torch.equal(got.scale, scale.reshape(got.scale.shape))
    ours, theirs = unpack_e2m1(got.data), unpack_e2m1(q._quantized_data)
    scaled = (x.reshape(64, -1, 32) / torch.exp2(got.scale.float() - 127).unsqueeze(-1)).reshape(x.shape)
    differ = ours != theirs
    tie = torch.isin(scaled.abs(), torch.tensor([0.75, 1.75, 3.5]))
    plus_zero = (x == 0) & ~torch.signbit(x)
    assert torch.equal(differ, tie | plus_zero)
    assert torch.equal(theirs[tie], (ours[tie] - 1))  # one code lower: toward zero
    assert bool((theirs[plus_zero] == 8).all())
    # the four ties planted that round away from zero (0.75, 1.75, 3.5, -0.75); the zeros of block 0 of
    # row 0, of row 1 and of the planted block
    assert int(tie.sum()) == 4 and int(plus_zero.sum()) == 32 + 256 + 23


def test_quantize_fp4_by_name_and_refusals():
    x = _weights(7, shape=(4, 64), dtype=torch.float32)
    assert torch.equal(quantize_fp4(x, "mxfp4").data, quantize_mxfp4(x).data)
    assert quantize_fp4(x, NVFP4).format is NVFP4 and quantize_fp4(x, MXFP4).format is MXFP4
    with pytest.raises(ValueError, match="unknown 4-bit format"):
        quantize_fp4(x, "nvfp8")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(torch.tensor([float("nan")] * 16))
    with pytest.raises(ValueError, match="rounding"):
        quantize_mxfp4(x, rounding="even")
    with pytest.raises(TypeError, match="floating-point"):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))


def test_a_given_global_scale_is_checked_and_an_empty_tensor_quantizes():
    x = _weights(8, shape=(4, 32), dtype=torch.float32)
    assert torch.equal(quantize_nvfp4(x, 0.01).data, quantize_nvfp4(x, torch.tensor([0.01])).data)
    for bad in (0.0, -0.01, float("nan"), float("inf"), torch.tensor([0.1, 0.2])):
        with pytest.raises(ValueError, match="global_scale must be one finite value above 0"):
            quantize_nvfp4(x, bad)
    for fmt, k in (("mxfp4", 32), ("nvfp4", 16)):
        c = quantize_fp4(torch.zeros(0, k), fmt)
        assert c.data.shape == (0, k // 2) and c.scale.shape == (0, 1) and c.dequantize().shape == (0, k)
        with pytest.raises(ValueError, match=r"the last dimension \(0\) must be a positive multiple"):
            quantize_fp4(torch.zeros(4, 0), fmt)
    with pytest.raises(ValueError, match=r"the last dimension \(48\) must be"):
        quantize_mxfp4(torch.zeros(4, 48))


def _same(a, b) -> bool:
    return (torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
            and (a.global_scale is None) == (b.global_scale is None)
            and (a.global_scale is None or torch.equal(a.global_scale, b.global_scale)))


def _both(fn, x, monkeypatch, **kw):
    import mxport.fp4 as fp4

    native = fn(x, **kw)
    monkeypatch.setattr(fp4, "NATIVE", False)
    torch_path = fn(x, **kw)
    monkeypatch.setattr(fp4, "NATIVE", True)
    return native, torch_path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_native_fp4_kernel_gives_the_torch_paths_bytes_at_every_magnitude(dtype, monkeypatch):
    """The C pass (mxport_fp4_rows) against the torch reference: every tie and its neighbours scaled across
    the float32 range (so every E8M0 / E4M3 scale, subnormal block scales and saturation), zero blocks, -0.0,
    and random weights of wide block magnitudes; MXFP4 rceil and floor, NVFP4 own and shared global scales."""
    from mxport.quantize import NATIVE_PATH

    if not NATIVE_PATH.available:
        pytest.skip(f"native kernel unavailable: {NATIVE_PATH.disabled_reason}")
    sweep = _sweep()
    sweep = sweep[sweep.abs() <= 8]
    sweep = sweep[: sweep.numel() // 32 * 32].reshape(-1, 32)
    top = 60000.0 if dtype == torch.float16 else 1e37
    cases = [_weights(s, shape=(16, 96), dtype=dtype) for s in (1, 2)]
    for e in range(-140, 128, 7):
        x = (sweep * 2.0 ** e).clamp(-top, top).to(dtype)
        cases.append(torch.where(torch.isfinite(x), x, torch.zeros_like(x)))
    for x in cases:
        for kw in ({"rounding": "rceil"}, {"rounding": "floor"}):
            assert _same(*_both(quantize_mxfp4, x, monkeypatch, **kw)), (x.abs().max(), kw)
        assert _same(*_both(quantize_nvfp4, x, monkeypatch)), x.abs().max()
        shared = torch.tensor(max(float(x.abs().max()), 1e-30) / 2000.0)
        assert _same(*_both(quantize_nvfp4, x, monkeypatch, global_scale=shared)), x.abs().max()


def test_native_fp4_kernel_refuses_nan_and_inf_like_the_torch_path(monkeypatch):
    import mxport.fp4 as fp4

    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(4, 64)
        x[3, 40] = bad
        for native in (True, False):
            monkeypatch.setattr(fp4, "NATIVE", native)
            calls = ((quantize_mxfp4, {}), (quantize_nvfp4, {}), (quantize_nvfp4, {"global_scale": 1.0}))
            for fn, kw in calls:
                with pytest.raises(ValueError, match="NaN or Inf, which E2M1 cannot encode"):
                    fn(x, **kw)
