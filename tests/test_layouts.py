"""mxport.layouts: the swizzle equals design.md §3's byte formula for every shape, on the native path (CPU
tensors, where the native library is built) and the torch path alike; pad/unpad/unswizzle invert."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxport import layouts


def formula_swizzle(scale: torch.Tensor) -> torch.Tensor:
    """design.md §3, entry by entry: compact (r, c) lands at
    ((r//128)*ceil(C/4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + (c%4); padding bytes are 0."""
    r_, c_ = scale.shape
    pr, pc = -(-r_ // 128) * 128, -(-c_ // 4) * 4
    out = [0] * (pr * pc)
    n_col_tiles = pc // 4
    for r in range(r_):
        for c in range(c_):
            off = ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
            out[off] = int(scale[r, c])
    return torch.tensor(out, dtype=torch.uint8).reshape(pr, pc)


@pytest.fixture(params=["native", "torch"])
def swizzle_path(request, monkeypatch):
    """Each test twice: CPU tensors through the native library's swizzle, and through the torch ops (what
    other devices, and CPUs without the native library, run)."""
    from mxport.quantize import NATIVE_PATH

    if request.param == "torch":
        monkeypatch.setattr(layouts, "_native_lib", lambda t: None)
    elif not NATIVE_PATH.available:
        pytest.skip(f"native library unavailable: {NATIVE_PATH.disabled_reason}")
    return request.param


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (128, 4), (129, 5), (192, 18), (576, 18), (300, 9),
                                   (256, 8), (256, 64), (128, 84), (384, 70)])
def test_swizzle_equals_byte_formula(shape, swizzle_path):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    s = torch.randint(1, 255, shape, dtype=torch.uint8, generator=g)
    sw = layouts.swizzle(s)
    assert sw.shape == layouts.swizzled_shape(*shape)
    assert torch.equal(sw, formula_swizzle(s))
    assert torch.equal(layouts.unswizzle(sw, *shape), s)
    assert torch.equal(layouts.unswizzle(sw.reshape(-1), *shape), s)  # 1-D swizzled buffers too


@settings(max_examples=30, deadline=None)
@given(r=st.integers(1, 300), c=st.integers(1, 40))
def test_property_swizzle_roundtrip_and_formula(r, c):
    s = torch.randint(0, 256, (r, c), dtype=torch.uint8)
    sw = layouts.swizzle(s)
    assert torch.equal(sw, layouts._swizzle_torch(s, *sw.shape))  # native (where built) = torch ops
    assert torch.equal(layouts.unswizzle(sw, r, c), s)
    # spot-check the formula on the corners
    flat = sw.reshape(-1)
    nct = -(-c // 4)
    for rr, cc in ((0, 0), (r - 1, c - 1), (r - 1, 0), (0, c - 1), (r // 2, c // 2)):
        off = ((rr // 128) * nct + cc // 4) * 512 + (rr % 32) * 16 + ((rr % 128) // 32) * 4 + (cc % 4)
        assert flat[off] == s[rr, cc]
    # padding is zero: total nonzero count equals the compact nonzero count
    assert int((sw != 0).sum()) == int((s != 0).sum())


def test_pad_and_unpad_rowwise_and_columnwise():
    s = torch.randint(1, 255, (3, 2), dtype=torch.uint8)
    p = layouts.pad(s)
    assert p.shape == (128, 4)
    assert torch.equal(p[:3, :2], s) and int(p.sum()) == int(s.sum())
    u = layouts.unpad(p, 3, 2)
    assert torch.equal(u, s) and u.data_ptr() == p.data_ptr()  # a view
    pc = layouts.pad(s, "columnwise")
    assert pc.shape == (4, 128)
    assert layouts.padded_shape(192, 18) == (256, 20)
    assert layouts.padded_shape(6, 576, "columnwise") == (8, 640)
    full = torch.ones(128, 4, dtype=torch.uint8)
    assert layouts.pad(full) is full


def test_e8m0_dtype_is_bit_viewed():
    s = torch.tensor([[127, 128, 0, 255]], dtype=torch.uint8)
    e8 = s.view(torch.float8_e8m0fnu)
    assert torch.equal(layouts.swizzle(e8), layouts.swizzle(s))
    assert torch.equal(layouts.unswizzle(layouts.swizzle(s).view(torch.float8_e8m0fnu), 1, 4), s)


def test_bad_inputs():
    with pytest.raises(TypeError, match="uint8"):
        layouts.swizzle(torch.ones(4, 4))
    with pytest.raises(ValueError, match="2-D"):
        layouts.swizzle(torch.ones(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bytes"):
        layouts.unswizzle(torch.zeros(100, dtype=torch.uint8), 3, 2)
    with pytest.raises(ValueError, match="too small"):
        layouts.unpad(torch.zeros(128, 4, dtype=torch.uint8), 129, 2)
    with pytest.raises(ValueError, match="direction"):
        layouts.pad(torch.zeros(3, 2, dtype=torch.uint8), "sideways")


@pytest.mark.parametrize("shape", [(1, 1), (129, 5), (257, 130), (128, 4)])
def test_word_and_byte_paths_agree(shape, swizzle_path):
    """The swizzle moves 4-byte words when the grid's memory allows it, else bytes: misaligned and
    non-contiguous inputs (the byte path) give the same bytes as aligned ones (the word path)."""
    r, c = shape
    g = torch.Generator().manual_seed(r * 1000 + c)
    x = torch.randint(0, 256, (r, c), generator=g, dtype=torch.uint8)
    want = layouts.swizzle(x)
    wide = torch.randint(0, 256, (c, r), generator=g, dtype=torch.uint8)
    wide.t()[:] = x
    assert not wide.t().is_contiguous() or (r, c) == (1, 1)
    assert torch.equal(layouts.swizzle(wide.t()), want)
    buf = torch.zeros(want.numel() + 1, dtype=torch.uint8)
    buf[1:] = want.reshape(-1)
    assert buf[1:].data_ptr() % 4 != 0
    assert torch.equal(layouts.unswizzle(buf[1:], r, c), x)
    assert torch.equal(layouts.unswizzle(want, r, c), x)


@pytest.mark.parametrize("shape", [(128, 64), (256, 256), (384, 1024), (129, 65), (640, 16), (127, 100),
                                   (1, 70), (1000, 37), (256, 1028)])
def test_native_swizzle_equals_torch_ops(shape):
    """The native swizzle (four tiles at a time in strips of sixteen for the full 128-row blocks of a grid
    with contiguous rows, a word / a byte at a time at the edges) gives the torch ops' bytes: full and partial
    strips, rows 1 KiB apart (cache sets shared), partial tile rows, one row; and on strided grids (a
    transpose, rows at an odd stride: unaligned loads, the word-at-a-time path); the unswizzle inverts
    each."""
    from mxport import native
    from mxport.quantize import NATIVE_PATH

    if not NATIVE_PATH.available:
        pytest.skip(f"native library unavailable: {NATIVE_PATH.disabled_reason}")
    r, c = shape
    g = torch.Generator().manual_seed(r * 7 + c)
    x = torch.randint(0, 256, (r, c), generator=g, dtype=torch.uint8)
    odd = torch.randint(0, 256, (r, c + 13), generator=g, dtype=torch.uint8)
    odd[:, 1:c + 1] = x
    wide = torch.randint(0, 256, (c, r), generator=g, dtype=torch.uint8)
    wide.t()[:] = x
    pr, pc = layouts.swizzled_shape(r, c)
    want = layouts._swizzle_torch(x, pr, pc)
    for src in (x, odd[:, 1:c + 1], wide.t()):
        out = torch.full((pr, pc), 0xAB, dtype=torch.uint8)  # every byte written, padding included
        assert torch.equal(native.swizzle(NATIVE_PATH._lib, src, out), want)
    back = torch.full((r, c), 0xAB, dtype=torch.uint8)
    assert torch.equal(native.unswizzle(NATIVE_PATH._lib, want, r, c, back), x)
    assert torch.equal(layouts.unswizzle(want, r, c), layouts._unswizzle_torch(want, r, c, pr, pc))


def test_cpu_swizzle_runs_in_the_native_library(monkeypatch):
    """CPU grids are swizzled and unswizzled by the native library (one thread, one pass), never by the torch
    permute: its copy runs on torch's thread pool, and with one of the two cores busy elsewhere an 8192x8192
    weight's unswizzle took a median 10.9 ms against 0.2 ms (each call waits for the descheduled thread)."""
    from mxport.quantize import NATIVE_PATH

    if not NATIVE_PATH.available:
        pytest.skip(f"native library unavailable: {NATIVE_PATH.disabled_reason}")

    def refuse(*args):
        raise AssertionError("the torch permute ran on a CPU tensor")

    monkeypatch.setattr(layouts, "_swizzle_torch", refuse)
    monkeypatch.setattr(layouts, "_unswizzle_torch", refuse)
    x = torch.randint(0, 256, (300, 45), dtype=torch.uint8)
    assert torch.equal(layouts.unswizzle(layouts.swizzle(x), 300, 45), x)


# -- argument checks and empty grids (found by the API fuzz, tests/fuzz_api.py) ------------------------------


@pytest.mark.parametrize(("shape", "want"), [((0, 3), (0, 4)), ((5, 0), (128, 0)), ((0, 0), (0, 0)),
                                             ((0, 4), (0, 4)), ((130, 0), (256, 0))])
def test_swizzle_of_an_empty_grid_is_the_empty_swizzled_shape(shape, want):
    """swizzle of a 0-row grid raised a view RuntimeError (stride(0) of an empty tensor is
    not divisible by 4)."""
    out = layouts.swizzle(torch.empty(shape, dtype=torch.uint8))
    assert out.dtype == torch.uint8 and tuple(out.shape) == want
    back = layouts.unswizzle(out, *shape)
    assert back.dtype == torch.uint8 and tuple(back.shape) == shape
    assert tuple(layouts.unswizzle(out.reshape(-1), *shape).shape) == shape


@pytest.mark.parametrize("bad", ["2", 2.0, None, True, [2]])
@pytest.mark.parametrize("which", ["rows", "cols"])
def test_rows_and_cols_must_be_integers(bad, which):
    """unswizzle / unpad with non-int rows or cols gave "'<' not supported" TypeErrors naming nothing."""
    g = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    sw = layouts.swizzle(g)
    args = {"rows": 3, "cols": 4, which: bad}
    for fn, grid in ((layouts.unswizzle, sw), (layouts.unpad, layouts.pad(g))):
        with pytest.raises(TypeError, match=f"^{which} must be an integer, got "):
            fn(grid, args["rows"], args["cols"])
    args[which] = -1
    with pytest.raises(ValueError, match=f"^{which} must be >= 0, got -1$"):
        layouts.unswizzle(sw, args["rows"], args["cols"])
    with pytest.raises(ValueError, match=f"^{which} must be >= 0, got -1$"):
        layouts.unpad(layouts.pad(g), args["rows"], args["cols"])


def test_rows_and_cols_accept_numpy_and_tensor_integers():
    import numpy as np

    g = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    assert torch.equal(layouts.unswizzle(layouts.swizzle(g), np.int64(3), torch.tensor(4)), g)
    assert torch.equal(layouts.unpad(layouts.pad(g), np.int32(2), 4), g[:2])


def test_huge_declared_grids_raise_a_clear_error_not_the_allocator():
    """An expand()ed grid of 2**40 rows holds no memory; swizzling / padding it cannot be allocated: a
    TooLargeError (MemoryError and ValueError) naming the argument, not the allocator's RuntimeError."""
    from mxport.formats import TooLargeError

    huge = torch.zeros(1, 64, dtype=torch.uint8).expand(1 << 52, 64)
    for fn, name in ((layouts.swizzle, "scale_inv_2d"),
                     (lambda g: layouts.pad(g, "columnwise"), "scale_inv_2d")):
        with pytest.raises(TooLargeError, match=f"^{name} of shape \\(4503599627370496, 64\\)") as info:
            fn(huge)
        assert isinstance(info.value, ValueError) and isinstance(info.value, MemoryError)
    with pytest.raises(TooLargeError, match="^swizzled of shape"):
        layouts.unswizzle(huge, 1 << 52, 64)


@settings(max_examples=20, deadline=None)
@given(r=st.integers(1, 300), k16=st.integers(1, 24))
def test_nvfp4_block_scales_take_the_same_128x4_swizzle(r, k16):
    """NVFP4's E4M3 block scales (one per 16 along K): the same tiles as E8M0 bytes, the result viewed as
    E4M3, and back through unswizzle of its bytes."""
    from mxport.fp4 import quantize_nvfp4

    c = quantize_nvfp4(torch.randn(r, 16 * k16))
    sw = layouts.swizzle(c.scale)
    assert sw.dtype == torch.float8_e4m3fn and sw.shape == layouts.swizzled_shape(r, k16)
    assert torch.equal(sw.view(torch.uint8), formula_swizzle(c.scale.view(torch.uint8)))
    assert torch.equal(layouts.unswizzle(sw.view(torch.uint8), r, k16), c.scale.view(torch.uint8))
