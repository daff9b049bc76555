"""quantize(): bytes equal the independent numpy/ml_dtypes reference (tests/mx_reference.py), edge rows of
design.md §2, and every documented bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mx_reference import ref_decode, ref_quantize, ref_scale_byte, ref_values

import mxport
from mxport import MXFP8Components, quantize

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _bytes(c: MXFP8Components):
    return c.data.view(torch.uint8).cpu().numpy(), c.scale_inv.cpu().numpy()


def _check_against_reference(x: torch.Tensor, elem: str, rounding: str, direction: str,
                             block_2d: bool = False):
    c = quantize(x, FP8[elem], direction=direction, rounding=rounding, block_2d=block_2d)
    q_ref, s_ref = ref_quantize(x.float().cpu().numpy(), elem, rounding, direction, block_2d)
    q, s = _bytes(c)
    assert c.data.shape == x.shape
    assert s.shape == s_ref.shape
    np.testing.assert_array_equal(s, s_ref)
    # NaN payloads are not part of the format (torch and ml_dtypes pick different E5M2 NaN bytes): NaN
    # positions must agree, every other byte must be identical
    nan, nan_ref = np.isnan(c.data.float().cpu().numpy()), np.isnan(ref_values(q_ref, elem))
    np.testing.assert_array_equal(nan, nan_ref)
    np.testing.assert_array_equal(np.where(nan, 0, q), np.where(nan_ref, 0, q_ref))
    return c


SHAPES = [(1, 1), (3, 16), (2, 31), (5, 33), (4, 48), (3, 576), (1, 4096), (127, 64), (129, 40), (2, 3, 64),
          (7,)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_rowwise_matches_reference(shape, elem, rounding):
    g = torch.Generator().manual_seed(hash((shape, elem, rounding)) % 2**31)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 4)
    _check_against_reference(x, elem, rounding, "rowwise")


@pytest.mark.parametrize("shape", [(1, 16), (33, 5), (127, 48), (129, 64), (2, 40, 3), (64, 96)])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_columnwise_matches_reference(shape, elem, rounding):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g) * 3
    c = _check_against_reference(x, elem, rounding, "columnwise")
    m = math.prod(shape[:-1])
    assert tuple(c.scale_inv.shape) == (-(-m // 32), shape[-1])


@pytest.mark.parametrize("shape", [(64, 64), (40, 33), (129, 576), (2, 35, 70)])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_block_2d_matches_reference(shape, direction, rounding):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))
    c = _check_against_reference(x, "e4m3", rounding, direction, block_2d=True)
    if direction == "rowwise":  # one scale per 32x32 block: rows of a block share their bytes
        s = c.scale_inv.reshape(-1, c.scale_inv.shape[-1])
        assert torch.equal(s[0], s[min(31, s.shape[0] - 1)])


def test_bfloat16_and_float16_inputs_quantize_their_exact_values():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(9, 100, generator=g) * 20).to(dtype)
        _check_against_reference(x, "e4m3", "rceil", "rowwise")
        _check_against_reference(x, "e5m2", "floor", "columnwise")


def test_non_contiguous_input_equals_contiguous():
    x = torch.randn(64, 96)
    xt = x.t()  # (96, 64), non-contiguous
    a, b = quantize(xt), quantize(xt.contiguous())
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale_inv, b.scale_inv)
    sliced = x[:, 5:70]  # strided rows
    _check_against_reference(sliced, "e4m3", "rceil", "rowwise")


@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (0,), (2, 0, 33)])
def test_empty_tensors(shape):
    c = quantize(torch.empty(shape))
    assert c.data.shape == torch.Size(shape)
    assert tuple(c.scale_inv.shape) == (*shape[:-1], -(-shape[-1] // 32))
    assert c.dequantize().shape == torch.Size(shape)


# -- design.md §2 edge rows ----------------------------------------------------------------------------------

def _block(first: float, rest: float = 1.0, n: int = 32) -> torch.Tensor:
    x = torch.full((1, n), rest)
    x[0, 0] = first
    return x


def test_amax_480_rceil_and_floor():
    c = quantize(_block(480.0), rounding="rceil")
    assert c.scale_inv.tolist() == [[128]]
    assert c.data[0, 0].float().item() == 240.0
    f = quantize(_block(480.0), rounding="floor")
    assert f.scale_inv.tolist() == [[127]]
    assert f.data[0, 0].float().item() == 448.0


def test_amax_just_above_power_of_two_rounds_scale_up():
    # amax/448 = 2 * (1 + 2**-23): rceil needs 2**2, i.e. E = 129; the 2**1 a float log2 might
    # give is too small
    amax = float(np.nextafter(np.float32(896.0), np.float32(1e9)))
    v = np.float32(amax) * (np.float32(1) / np.float32(448))
    assert v > 2.0  # the premise: v lies just above a power of two
    c = quantize(_block(amax))
    assert c.scale_inv.item() == 129
    assert c.data[0, 0].float().item() == 224.0  # 896.0001 / 4 rounds to 224 in E4M3
    exact = quantize(_block(896.0))
    assert exact.scale_inv.item() == 128  # exactly 2**1 * 448 stays at E = 128


def test_all_zero_block_has_scale_zero_and_zero_values():
    c = quantize(torch.zeros(2, 40))
    assert c.scale_inv.tolist() == [[0, 0], [0, 0]]
    assert torch.equal(c.data.view(torch.uint8), torch.zeros(2, 40, dtype=torch.uint8))
    assert torch.equal(c.dequantize(), torch.zeros(2, 40))


def test_nan_is_skipped_for_the_scale_and_stays_nan():
    x = _block(3.0, rest=1.0)
    x[0, 5] = float("nan")
    c = quantize(x)
    assert c.scale_inv.item() == ref_scale_byte(3.0, "e4m3", "rceil") == 120  # 3/448 -> 2**-7
    assert torch.isnan(c.data[0, 5].float())
    assert c.data[0, 0].float().item() == 3.0 * 2**7
    d = c.dequantize()
    assert torch.isnan(d[0, 5]) and d[0, 0].item() == 3.0


def test_inf_gives_scale_254_and_saturates():
    x = _block(float("inf"), rest=2.0**100)
    c = quantize(x)
    assert c.scale_inv.item() == 254
    assert c.data[0, 0].float().item() == 448.0
    neg = quantize(_block(float("-inf")))
    assert neg.scale_inv.item() == 254 and neg.data[0, 0].float().item() == -448.0
    assert quantize(_block(float("inf")), rounding="floor").scale_inv.item() == 254


def test_subnormal_blocks():
    # amax/448 < 2**-127 -> E = 0, multiplier 2**127 (design.md §2 step 4)
    c = quantize(_block(2.0**-125, rest=2.0**-130))
    assert c.scale_inv.item() == 0
    assert c.data[0, 0].float().item() == 4.0 and c.data[0, 1].float().item() == 0.125
    # float32 subnormal inputs: 2**-140 * 2**127 = 2**-13, an E5M2 subnormal; below E4M3's 2**-9, so 0 there
    x = _block(2.0**-140, rest=2.0**-142)
    assert quantize(x, torch.float8_e5m2).data[0, 0].float().item() == 2.0**-13
    assert quantize(x).data[0, 0].float().item() == 0.0
    for elem in ("e4m3", "e5m2"):
        for rounding in ("rceil", "floor"):
            _check_against_reference(x, elem, rounding, "rowwise")
    # amax/448 just above 2**-126 (normal), a block mixing normal and subnormal values
    y = torch.tensor([[448 * 2.0**-126 * 1.5] + [2.0**-149] * 31])
    _check_against_reference(y, "e4m3", "rceil", "rowwise")


def test_values_near_float32_max():
    big = torch.tensor([[3.4e38, -3.3e38, 1e38, 1.0] * 8])
    c = quantize(big)
    assert c.scale_inv.item() == ref_scale_byte(3.4e38, "e4m3", "rceil")
    assert c.scale_inv.item() == 247  # 3.4e38 / 448 = 2**119.6 -> 2**120
    assert torch.isfinite(c.data.float()).all()
    _check_against_reference(big, "e4m3", "rceil", "rowwise")
    _check_against_reference(big, "e5m2", "floor", "rowwise")


def test_short_last_block_uses_its_own_elements():
    x = torch.ones(1, 33)
    x[0, :32] = 1000.0  # first block large; the 1-element last block holds 1.0
    c = quantize(x)
    assert c.scale_inv.tolist() == [[ref_scale_byte(1000.0, "e4m3", "rceil"), 119]]  # 1/448 -> 2**-8: E = 119
    assert c.data[0, 32].float().item() == 256.0


def test_blocks_never_cross_rows():
    x = torch.zeros(2, 48)
    x[0] = 1000.0  # row 0 large; if blocks crossed rows, row 1's scale would see it
    x[1] = 1.0
    c = quantize(x)
    assert c.scale_inv[1].tolist() == [119, 119]


def test_decoding_known_bytes():
    data = torch.ones(1, 64).to(torch.float8_e4m3fn)
    c = MXFP8Components(data, torch.tensor([[127, 128]], dtype=torch.uint8))
    out = mxport.dequantize(c)
    assert out[0, :32].eq(1.0).all() and out[0, 32:].eq(2.0).all()
    nan_scale = MXFP8Components(data, torch.tensor([[255, 0]], dtype=torch.uint8)).dequantize()
    assert torch.isnan(nan_scale[0, :32]).all()
    assert nan_scale[0, 32].item() == 2.0**-127


def test_dequantize_dtype_and_round_trip_error_bound():
    x = torch.randn(16, 96)
    c = quantize(x)
    d = c.dequantize(torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d.shape == x.shape
    # E4M3 has 3 mantissa bits: relative error <= 2**-4 for values in the normal range of their block
    err = (c.dequantize() - x).abs()
    scale = c.scale_as_float().repeat_interleave(32, dim=1)[:, :96]
    assert (err <= torch.maximum(x.abs() * 2**-4, scale * 2**-9)).all()


# -- property tests ------------------------------------------------------------------------------------------

SPECIAL = st.sampled_from([0.0, -0.0, 1.0, 480.0, 448.0, 2.0**-140, 2.0**-149, 1e-30, 3.4e38, -3.4e38,
                           float("nan"), float("inf"), float("-inf"), 57344.0, 65504.0])


@st.composite
def float_tensors(draw):
    m = draw(st.integers(1, 6))
    k = draw(st.integers(1, 100))
    base = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(base)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-30, 30, (m, k), generator=g).float())
    n_special = draw(st.integers(0, 4))
    for _ in range(n_special):
        i, j = draw(st.integers(0, m - 1)), draw(st.integers(0, k - 1))
        x[i, j] = draw(SPECIAL)
    return x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=float_tensors(), elem=st.sampled_from(["e4m3", "e5m2"]),
       rounding=st.sampled_from(["rceil", "floor"]), direction=st.sampled_from(["rowwise", "columnwise"]))
def test_property_matches_reference(x, elem, rounding, direction):
    _check_against_reference(x, elem, rounding, direction)


@settings(max_examples=40, deadline=None)
@given(x=float_tensors())
def test_property_decode_is_within_half_ulp_of_fp8(x):
    """Decoding never moves a finite, in-range value by more than the FP8 rounding step of its block."""
    c = quantize(x)
    d = c.dequantize()
    finite = torch.isfinite(x) & (x.abs() < 2.0**127)  # decoding 3.4e38 may round up to 2**128 = Inf
    assert torch.isnan(d[torch.isnan(x)]).all()
    scale = c.scale_as_float().repeat_interleave(32, dim=1)[:, : x.shape[1]]
    err = (d - x).abs()[finite]
    bound = torch.maximum(x.abs()[finite] * 2**-4, scale[finite] * 2**-9) * 1.0001
    in_range = x.abs()[finite] <= 448 * scale[finite]
    assert (err[in_range] <= bound[in_range]).all()


# -- bad input -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, exc, words", [
    (torch.ones(4, 32, dtype=torch.int32), TypeError, "x must be"),
    (torch.ones(4, 32, dtype=torch.bool), TypeError, "x must be"),
    (torch.ones(4, 32).to(torch.float8_e4m3fn), TypeError, "FP8"),
    (torch.tensor(1.0), ValueError, "0-d"),
    ([1.0, 2.0], TypeError, "torch.Tensor"),
])
def test_bad_inputs(bad, exc, words):
    with pytest.raises(exc, match=words):
        quantize(bad)


def test_bad_options():
    x = torch.ones(2, 32)
    with pytest.raises(ValueError, match="rounding"):
        quantize(x, rounding="nearest")
    with pytest.raises(ValueError, match="direction"):
        quantize(x, direction="diagonal")
    with pytest.raises(ValueError, match="block_size"):
        quantize(x, block_size=16)
    with pytest.raises(TypeError, match="fp8_dtype"):
        quantize(x, torch.float16)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_dequantize_matches_reference_decode(elem, direction):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 70, generator=g) * 100
    c = quantize(x, FP8[elem], direction=direction)
    q, s = _bytes(c)
    e_full = np.repeat(s, 32, axis=1)[:, :70] if direction == "rowwise" else np.repeat(s, 32, axis=0)[:37]
    np.testing.assert_array_equal(c.dequantize().numpy(), ref_decode(q, e_full, elem))


# -- argument checks (found by the API fuzz, tests/fuzz_api.py) ----------------------------------------------


@pytest.mark.parametrize("bad", [2, "no", None, 0, 1, 1.0, torch.tensor(True)])
def test_block_2d_must_be_a_bool(bad):
    """block_2d=2 reached the native kernel ("rejected", RuntimeError) and block_2d="no" meant True on the
    eager path: anything but a bool is a TypeError."""
    with pytest.raises(TypeError, match="^block_2d must be a bool \\(True or False\\), got "):
        quantize(torch.randn(4, 64), block_2d=bad)


def test_block_2d_accepts_numpy_bools():
    x = torch.randn(40, 64)
    want = quantize(x, block_2d=True)
    got = quantize(x, block_2d=np.bool_(True))
    assert torch.equal(got.scale_inv, want.scale_inv) and torch.equal(got.data.view(torch.uint8),
                                                                       want.data.view(torch.uint8))


@pytest.mark.parametrize("dtype", [getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz",
                                                               "float8_e8m0fnu", "float32", "uint8")
                                   if hasattr(torch, n)] + ["e3m4", None, 3, ["e4m3"]])
def test_fp8_dtype_other_than_the_two_mxfp8_elements_is_a_type_error(dtype):
    with pytest.raises(TypeError, match="^fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        quantize(torch.randn(4, 64), dtype)


@pytest.mark.parametrize(("kw", "msg"), [({"rounding": ("rceil",)}, "^rounding must be 'rceil' or 'floor'"),
                                         ({"rounding": None}, "^rounding must be"),
                                         ({"direction": ["rowwise"]},
                                          "^direction must be 'rowwise' or 'columnwise'"),
                                         ({"direction": 0}, "^direction must be")])
def test_rounding_and_direction_must_be_their_names(kw, msg):
    with pytest.raises(ValueError, match=msg):
        quantize(torch.randn(4, 64), **kw)


def test_huge_declared_input_is_a_clear_error_and_keeps_the_fast_path(monkeypatch):
    """quantize of an expand()ed (2**40, 64) view cannot allocate its outputs: TooLargeError naming x (not the
    allocator's RuntimeError); and an allocation failure inside the compiled kernel no longer disables the
    fast path for the rest of the process (it is the input's size, not the compiler)."""
    import importlib

    from mxport.formats import TooLargeError

    q = importlib.import_module("mxport.quantize")
    huge = torch.zeros(1, 64).expand(1 << 52, 64)
    with pytest.raises(TooLargeError, match="^x of shape \\(4503599627370496, 64\\)"):
        quantize(huge, fast=False)

    def compiled(fn, **kw):
        def run(x2):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: "
                               "can't allocate memory")
        return run

    path = q._FastPath()
    monkeypatch.setattr(torch, "compile", compiled)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        path(torch.zeros(2, 64), *q._kernel_args(q.element_format(torch.float8_e4m3fn), False, False))
    assert path.failed_reason is None


def test_components_repr_never_prints_the_values():
    """The dataclass repr printed both tensors: unreadable for a real weight, and a huge (expanded) or meta
    tensor cannot be printed at all (the fuzz died in repr)."""
    c = MXFP8Components(torch.zeros(1, 64, dtype=torch.float8_e4m3fn).expand(1 << 52, 64),
                        torch.full((1, 2), 127, dtype=torch.uint8).expand(1 << 52, 2))
    assert repr(c) == ("MXFP8Components(shape=(4503599627370496, 64), element='e4m3', direction='rowwise', "
                       "scale_shape=(4503599627370496, 2), device='cpu')")
    from mxport.formats import TooLargeError

    with pytest.raises(TooLargeError, match="^components of shape"):
        mxport.dequantize(c)
    with pytest.raises(TypeError,
                       match="^dtype must be torch.float32, bfloat16, float16 or float64, got 'float32'"):
        mxport.dequantize(quantize(torch.randn(2, 32)), "float32")


def test_export_components_0d_names_obj():
    with pytest.raises(ValueError, match="^obj must have at least one dimension"):
        mxport.export_components(torch.tensor(1.0))


# -- kernel=: the kernel as an argument, not a global switch -------------------------------------------------


def test_kernel_argument_picks_the_kernel_and_overrides_the_env_switch(monkeypatch):
    """``kernel="compiled"`` runs the compiled kernel even under MXPORT_DISABLE_COMPILE (set for this
    test run by conftest), which now steers only the automatic choice; the bytes equal the eager
    kernel's. (torch.compile is replaced by a pass-through that records its calls: the real compile costs
    tens of seconds here.)"""
    import importlib

    q = importlib.import_module("mxport.quantize")
    monkeypatch.setenv("MXPORT_DISABLE_COMPILE", "1")
    path = q._FastPath()
    assert path.disabled_reason == "MXPORT_DISABLE_COMPILE is set" and path.failed_reason is None
    assert not path.available
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    monkeypatch.setattr(q, "FAST_PATH", path)
    x = torch.randn(40, 100).to(torch.bfloat16)
    eager = quantize(x, torch.float8_e5m2, rounding="floor", kernel="eager")
    assert not compiled
    got = quantize(x, torch.float8_e5m2, rounding="floor", kernel="compiled")
    assert len(compiled) == 1 and compiled[0].__code__.co_name.startswith("mxfp8_kernel_")
    assert torch.equal(got.scale_inv, eager.scale_inv)
    assert torch.equal(got.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert q.kernel_for(x.reshape(40, 100)) in ("native", "eager")  # the automatic choice still skips it
    assert (q.kernel_for(x, kernel="compiled") == "compiled"
            and q.kernel_for(x[:0], kernel="compiled") == "eager")
    path.failed_reason = "torch.compile failed: test"
    with pytest.raises(RuntimeError,
                       match="^kernel='compiled' is not available here: torch.compile failed: test"):
        quantize(x, kernel="compiled")


def test_kernel_native_runs_or_says_why_and_env_steers_the_automatic_choice_only(monkeypatch):
    import importlib

    q = importlib.import_module("mxport.quantize")
    x = torch.randn(8, 64)
    if q.NATIVE_PATH.loaded():
        got = quantize(x, kernel="native")
        want = quantize(x, kernel="eager")
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        monkeypatch.setenv("MXPORT_DISABLE_NATIVE", "1")
        path = q._NativePath()
        assert path.disabled_reason == "MXPORT_DISABLE_NATIVE is set" and not path.available
        monkeypatch.setattr(q, "NATIVE_PATH", path)
        assert q.kernel_for(x) != "native" and q.kernel_for(x, kernel="native") == "native"
    else:
        with pytest.raises(RuntimeError, match="^kernel='native' is not available here: "):
            quantize(x, kernel="native")
    with pytest.raises(RuntimeError, match="^kernel='native' takes CPU float32/bfloat16/float16 input"):
        q.kernel_for(torch.randn(2, 32, dtype=torch.float64), kernel="native")


@pytest.mark.parametrize(("kw", "msg"), [({"kernel": "fast"},
                                          "^kernel must be None, 'native', 'compiled' or 'eager'"),
                                         ({"kernel": 1}, "^kernel must be None"),
                                         ({"kernel": "eager", "fast": False},
                                          "^give fast or kernel, not both")])
def test_kernel_argument_checks(kw, msg):
    with pytest.raises(ValueError, match=msg):
        quantize(torch.randn(2, 32), **kw)


# -- nonzero_scales: NeMo-RL's rule for FlashInfer's TRT-LLM kernels (byte 0 -> 1), decoding unchanged -------
def _with_zero_blocks(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 80, generator=g)
    x[1, 32:64] = 0  # a whole block
    x[2, 64:] = 0  # the partial last block
    x[3, :32] = -0.0  # negative zeros keep their sign bytes
    x[4, 32:64] = 0
    x[4, 40] = float("nan")  # NaN is skipped in the amax: an all-zero block with a NaN in it
    return x


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("kernel", ["eager", "native", "compiled"])
def test_nonzero_scales_turns_every_zero_byte_into_one_and_decodes_the_same(direction, kernel):
    from mxport.quantize import NATIVE_PATH

    if kernel == "native" and not NATIVE_PATH.loaded():
        pytest.skip(f"no native kernel here: {NATIVE_PATH.failed_reason}")
    x = _with_zero_blocks()
    x = x if direction == "rowwise" else x.t().contiguous().repeat(1, 1)
    ref = quantize(x, direction=direction, kernel=kernel)
    got = quantize(x, direction=direction, kernel=kernel, nonzero_scales=True)
    zero = ref.scale_inv == 0
    assert int(zero.sum()) == 4  # the premise: four blocks have byte 0
    assert torch.equal(got.scale_inv, torch.where(zero, torch.ones_like(ref.scale_inv), ref.scale_inv))
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))  # zeros keep their bytes
    a, b = got.dequantize(), ref.dequantize()
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    assert torch.equal(torch.signbit(a), torch.signbit(b))


def test_nonzero_scales_also_lifts_tiny_nonzero_blocks_and_re_encodes_them():
    # amax = 3 * 2**-130 <= 448 * 2**-127: rceil gives byte 0 to a block that is not all zero. NeMo-RL's rule
    # lifts it to 1 too; its values are re-encoded for 2**-126, so they decode to the same numbers (a bare
    # byte rewrite would double them).
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([3.0, -1.0, 0.5, 2.0 ** -6]) * 2.0 ** -130
    ref = quantize(x)
    got = quantize(x, nonzero_scales=True)
    assert ref.scale_inv.tolist() == [[0]] and got.scale_inv.tolist() == [[1]]
    assert ref.data[0, :4].float().tolist() == [0.375, -0.125, 0.0625, 2.0 ** -9]
    assert got.data[0, :4].float().tolist() == [0.1875, -0.0625, 0.03125, 0.0]
    assert torch.equal(got.dequantize()[0, :3], ref.dequantize()[0, :3])
    assert torch.equal(got.dequantize()[0, :3], x[0, :3])
    assert torch.equal(got.dequantize()[0, 4:], ref.dequantize()[0, 4:])
    # the one exception: E4M3's smallest subnormal (2**-9) halved is a tie, which rounds to even (0)
    assert got.dequantize()[0, 3].item() == 0.0 and ref.dequantize()[0, 3].item() == 2.0 ** -136


def test_nonzero_scales_without_zero_blocks_changes_nothing():
    x = torch.randn(5, 96)
    assert _bytes(quantize(x, nonzero_scales=True))[0].tobytes() == _bytes(quantize(x))[0].tobytes()
    assert torch.equal(quantize(x, nonzero_scales=True).scale_inv, quantize(x).scale_inv)


def test_nonzero_scales_with_out_writes_the_lifted_bytes():
    x = _with_zero_blocks()
    out = (torch.empty(x.shape, dtype=torch.uint8), torch.empty(6, 3, dtype=torch.uint8))
    c = quantize(x, out=out, nonzero_scales=True)
    assert torch.equal(out[1], quantize(x, nonzero_scales=True).scale_inv) and int((out[1] == 0).sum()) == 0
    assert c.scale_inv.data_ptr() == out[1].data_ptr()


def test_lift_zero_scales_of_components_equals_quantize_with_the_option():
    from mxport.quantize import lift_zero_scales

    x = _with_zero_blocks(1)
    for direction in ("rowwise", "columnwise"):
        a = lift_zero_scales(quantize(x, direction=direction))
        b = quantize(x, direction=direction, nonzero_scales=True)
        assert torch.equal(a.scale_inv, b.scale_inv) and torch.equal(a.data.view(torch.uint8),
                                                                      b.data.view(torch.uint8))
    c = quantize(torch.randn(3, 64))
    assert lift_zero_scales(c) is c  # nothing to lift: the same object
    with pytest.raises(TypeError, match="nonzero_scales must be a bool"):
        quantize(x, nonzero_scales=1)
