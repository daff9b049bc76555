"""The native CPU kernel (mxport/_native/mxfp8_cpu.c via mxport.native) gives the same bytes as the eager
kernel on every bfloat16 / float16 bit pattern, on random float32 bit patterns and shapes, with NaN / Inf /
subnormals, split over threads or not, in each instruction-set branch this CPU runs (an AVX-512 CPU also runs
the AVX2 build), its fast paths with and without their float32 fallback; and quantize falls back cleanly
where it cannot be built or fails its self-check."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxport import native, quantize
from mxport.components import MXFP8Components
from mxport.formats import element_format
from mxport.quantize import NATIVE_PATH, _kernel_args, _native_args, _rowwise_kernel, kernel_for

ELEMENTS = (torch.float8_e4m3fn, torch.float8_e5m2)

pytestmark = pytest.mark.skipif(not NATIVE_PATH.available,
                                reason=f"native kernel unavailable: {NATIVE_PATH.disabled_reason}")


def _eager(x2, fp8_dtype, floor, block_2d=False):
    return _rowwise_kernel(x2, *_kernel_args(element_format(fp8_dtype), floor, block_2d))


def _native(x2, fp8_dtype, floor, block_2d=False, lib=None):
    fmt = element_format(fp8_dtype)
    if lib is None:
        return NATIVE_PATH(x2, fmt, floor, block_2d)
    return native.quantize_rows(lib, x2, *_native_args(fmt, floor), block_2d=block_2d)


def _assert_same(x2, fp8_dtype, floor, block_2d=False, lib=None):
    q, e = _native(x2, fp8_dtype, floor, block_2d, lib)
    rq, re = _eager(x2, fp8_dtype, floor, block_2d)
    assert torch.equal(e, re), f"scales differ at {(e != re).nonzero()[:5].tolist()}"
    assert torch.equal(q, rq), f"values differ at {(q != rq).nonzero()[:5].tolist()}"


def _cpu_flags() -> set[str]:
    from pathlib import Path

    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build_with(flags: str):
    """The native library built with extra compiler flags (they win over -march=native's), cached like the
    default build under a key of its own: $CC plus the flags."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CC", " ".join([*native.find_compiler(), flags]))
        return native.load(native.build())


@functools.cache
def _isa_flags() -> dict[str, str]:
    """Extra compiler flags of each instruction-set branch this CPU runs: the default build's, and on an
    AVX-512 CPU the AVX2 + F16C one too (AVX-512 off), so that both are checked whichever quantize uses."""
    isas = {native.isa(NATIVE_PATH._lib): ""}
    if "avx512" in isas and {"avx2", "f16c"} <= _cpu_flags():
        isas["avx2"] = "-mno-avx512f"
    return isas


@functools.cache
def _lib(isa: str, fast_only: bool = False):
    """The library of a branch (:func:`_isa_flags`); fast_only: built with MXPORT_TEST_FAST_ONLY (the fast
    paths' float32 fallback for small scales and FP8 subnormals compiled out)."""
    flags = _isa_flags()[isa] + (" -DMXPORT_TEST_FAST_ONLY=1" if fast_only else "")
    if not flags:
        return NATIVE_PATH._lib
    lib = _build_with(flags.strip())
    assert native.isa(lib) == isa
    return lib


def _isas() -> list[str]:
    return list(_isa_flags()) if NATIVE_PATH.available else ["avx512"]  # the module is skipped then


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", ELEMENTS)
@pytest.mark.parametrize("floor", [False, True])
@pytest.mark.parametrize("block_2d", [False, True])
def test_every_16bit_pattern(dtype, fp8_dtype, floor, block_2d):
    """All 65536 patterns (NaNs, Infs, subnormals, both zeros): shuffled into blocks, each block alone, and
    scaled down so that many land in the FP8 subnormal range; 1-D and 32x32 blocks."""
    g = torch.Generator().manual_seed(7)
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    shuffled = pats[torch.randperm(65536, generator=g)]
    for x in (shuffled.reshape(64, 1024), pats.reshape(-1, 32),
              (shuffled.float() * 1e-3).to(dtype).reshape(128, 512)):
        _assert_same(x, fp8_dtype, floor, block_2d)


def _bf16_blocks_below_their_amax(seed: int, mantissas=(0, 0x40, 0x7F)) -> torch.Tensor:
    """bfloat16 blocks of 32 whose first element (the amax) has each exponent field 1..254 and each of
    ``mantissas`` (eight blocks each), the other 31 random patterns 0..40 binades below it (never above
    it; the field clamped at 0: zeros and subnormals), 1 in 32 of them a zero, signs random. Every region of
    the AVX2 kernel's 16-bit-lane bfloat16 path, against every scale: FP8 normal results (saturating ones
    with floor rounding), nonzero FP8 subnormals (its float32 fallback), results that round to zero (its
    unsigned-pack saturation), the smallest scales (E <= bias + mbits: zero and subnormal inputs take the
    fallback)."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.tensor([(ex << 7) | m for ex in range(1, 255) for m in mantissas]).repeat_interleave(8)
    n = amax.numel()
    ex = ((amax >> 7)[:, None] - torch.randint(0, 41, (n, 31), generator=g)).clamp(min=0)
    rest = torch.minimum((ex << 7) | torch.randint(0, 128, (n, 31), generator=g), amax[:, None])
    rest = torch.where(torch.randint(0, 32, (n, 31), generator=g) == 0, 0, rest)
    bits = torch.cat([amax[:, None], rest], dim=1) | (torch.randint(0, 2, (n, 32), generator=g) << 15)
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("fp8_dtype", ELEMENTS)
@pytest.mark.parametrize("floor", [False, True])
def test_bf16_every_magnitude_below_every_scale(fp8_dtype, floor, isa):
    """The bfloat16 fast path (eight blocks at a time in 16-bit lanes) gives the eager bytes on
    :func:`_bf16_blocks_below_their_amax`: rows of eight blocks of one amax, the same blocks shuffled (eight
    scales per group), and rows of 18 blocks + 17 elements (a group of two and a short last block)."""
    blocks = _bf16_blocks_below_their_amax(13)
    lib = _lib(isa)
    _assert_same(blocks.reshape(-1, 256), fp8_dtype, floor, lib=lib)
    perm = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(17))
    _assert_same(blocks[perm].reshape(-1, 256), fp8_dtype, floor, lib=lib)
    flat = blocks[perm].reshape(-1)
    rows = flat.numel() // 593
    _assert_same(flat[:rows * 593].reshape(rows, 593), fp8_dtype, floor, lib=lib)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("fp8_dtype", ELEMENTS)
def test_bf16_rceil_with_another_inv_max_norm_saturates(fp8_dtype, isa):
    """The C entry point takes inv_max_norm from its caller. With f32(1 / max_norm) a rceil product never
    exceeds max_norm and the bf16 path skips its clamp; with a smaller one, 1 / (max_norm * 8/7) =
    2^-(emax + 1), products reach 2^(emax + 1) and must saturate, as the eager kernel does with the same
    argument: amaxes of mantissa 0x6C / 0x7C (1.84 / 1.97 * 2^k) scale to 1.84 / 1.97 * 2^emax, which round
    above max_norm (E4M3: both, E5M2: the second)."""
    fmt = element_format(fp8_dtype)
    inv = float(np.float32(1.0) / np.float32(fmt.max_norm * 8 / 7))
    x = _bf16_blocks_below_their_amax(19, (0x6C, 0x7C)).reshape(-1, 256)
    elem = int(fp8_dtype == torch.float8_e5m2)
    q, e = native.quantize_rows(_lib(isa), x, elem, False, inv, fmt.emax)
    rq, re = _rowwise_kernel(x, fmt.max_norm, inv, fmt.emax, fp8_dtype, False, False)
    assert torch.equal(e, re)
    assert torch.equal(q, rq)
    assert ((q & 0x7F) == (0x7E if fp8_dtype == torch.float8_e4m3fn else 0x7B)).sum() > 100  # saturated


def _f32_round_mantissas() -> list[int]:
    """23-bit mantissas at each rounding position s = 20..23 (E4M3 / E5M2 normals keep the 3 / 2 bits
    above s = 20 / 21, FP8 subnormals fewer): a tie (bit s - 1 alone below s), just below and just above it,
    each with the kept bits 0, the kept lsb alone, every kept bit 1 (a round-up carries into the exponent)
    and every kept bit but the lsb 1 (1.75 = 448 / 2^8 = 57344 / 2^15 among them: the saturation boundary);
    plus 0, 1 and all ones (position 24: ties at the FP8 subnormal half, just above and just below it)."""
    ms = {0, 1, 0x7FFFFF}
    for s in range(20, 24):
        half, kept = 1 << (s - 1), 0x7FFFFF >> s << s
        for top in (0, 1 << s, kept, kept & ~(1 << s)):
            ms.update(((top | low) & 0x7FFFFF) for low in (half - 1, half, half + 1))
    return sorted(ms)


# block amax mantissas: 0, all ones, and 1.75 (= max_norm / 2^emax) and its neighbours (the rceil boundary)
_F32_AMAX_MANTISSAS = (0, 0x7FFFFF, 0x600000, 0x5FFFFF, 0x600001, 0x400000)


def _f32_blocks_below_their_amax(seed: int) -> torch.Tensor:
    """float32 blocks of 32 whose first element (the amax) has each exponent field fa = 1..254 (mantissa
    from ``_F32_AMAX_MANTISSAS``, cycling over the blocks of one fa), the other 31 together taking every pair
    (fa - d, m) for d = 0..40 and m in :func:`_f32_round_mantissas` (the field clamped at 0: zeros and float32
    subnormals), clamped to the amax, in random order; 1 in 32 of them a zero, 1 in 64 a random float32
    subnormal, signs random; 1 block in 40 holds a NaN, +Inf or -Inf. So, against every scale the amaxes give:
    FP8 normal results at every rounding position (ties, just off them, carries into the next binade, the
    saturation boundary), nonzero FP8 subnormals, results flushed to zero, float32-subnormal and zero inputs,
    the smallest scales (E <= bias + mbits), and groups the AVX2 fast path leaves to its float path."""
    g = torch.Generator().manual_seed(seed)
    ms = torch.tensor(_f32_round_mantissas())
    fa = torch.arange(1, 255)
    ex = (fa[:, None] - torch.arange(41)[None, :]).clamp(min=0)
    pairs = ((ex[:, :, None] << 23) | ms[None, None, :]).reshape(fa.numel(), -1)
    nb = -(-pairs.shape[1] // 31)
    extra = torch.randint(0, pairs.shape[1], (fa.numel(), nb * 31 - pairs.shape[1]), generator=g)
    pairs = torch.cat([pairs, pairs.gather(1, extra)], dim=1)
    pairs = pairs.gather(1, torch.rand(pairs.shape, generator=g).argsort(dim=1)).reshape(-1, 31)
    am = torch.tensor(_F32_AMAX_MANTISSAS)[torch.arange(nb) % len(_F32_AMAX_MANTISSAS)]
    amax = ((fa[:, None] << 23) | am[None, :]).reshape(-1, 1)
    n = amax.shape[0]
    rest = torch.minimum(pairs, amax)
    rest = torch.where(torch.randint(0, 32, (n, 31), generator=g) == 0, 0, rest)
    sub = torch.randint(1, 1 << 23, (n, 31), generator=g)
    rest = torch.where(torch.randint(0, 64, (n, 31), generator=g) == 0, sub, rest)
    bits = torch.cat([amax, rest], dim=1) | (torch.randint(0, 2, (n, 32), generator=g) << 31)
    x = bits.to(torch.int32).view(torch.float32)  # bits >= 2^31 wrap to the same 32-bit pattern
    special = torch.nonzero(torch.randint(0, 40, (n,), generator=g) == 0).flatten()
    vals = torch.tensor([float("nan"), float("inf"), float("-inf")])
    x[special, torch.randint(0, 32, (special.numel(),), generator=g)] = vals[
        torch.randint(0, 3, (special.numel(),), generator=g)]
    return x


def _f32_layouts(blocks: torch.Tensor) -> list[torch.Tensor]:
    """The blocks as rows of eight blocks of one amax exponent (whole groups of the long-row path),
    shuffled as rows of 3 blocks (eight scales per group; groups across rows; a last group of 5 blocks), and
    as rows of 593 elements (the per-row path: groups of 8, 8, 2 and a short last block of 17)."""
    perm = blocks[torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(23))]
    n3 = perm.shape[0] // 24 * 24 - 3
    flat = perm.reshape(-1)
    rows = flat.numel() // 593
    return [blocks.reshape(-1, 256), perm[:n3].reshape(-1, 96), flat[:rows * 593].reshape(rows, 593)]


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("fp8_dtype", ELEMENTS)
@pytest.mark.parametrize("floor", [False, True])
def test_f32_every_rounding_below_every_scale(fp8_dtype, floor, isa):
    """The float32 fast paths (AVX-512: sixteen blocks at a time, AVX2: eight, in 32-bit lanes, exponent-add
    scaling, integer RNE) give the eager bytes on :func:`_f32_blocks_below_their_amax` in each of
    :func:`_f32_layouts`."""
    blocks = _f32_blocks_below_their_amax(29)
    for x in _f32_layouts(blocks):
        _assert_same(x, fp8_dtype, floor, lib=_lib(isa))


def _kept_blocks(dtype, fp8_dtype, floor) -> torch.Tensor:
    """The blocks of :func:`_f32_blocks_below_their_amax` (as ``dtype``) that a fast path casts itself, every
    rounding position below every scale included: amax exponents from 40 up (scales E > bias + mbits), no NaN
    or Inf, and each element whose 16-bit code (the AVX-512 path's) lies in [-(mbits << mbits), 2^mbits) — a
    product that may be a nonzero FP8 subnormal — set to zero. So it keeps the products that round up to
    min_normal from below it, and those just under min_subnormal / 2 (code 0, signed)."""
    x = _f32_blocks_below_their_amax(41).to(dtype)
    bits = x.float().view(torch.int32).long()
    keep = (((bits[:, 0] >> 23) & 0xFF) >= 40) & x.float().isfinite().all(dim=1)
    x = x[keep][:int(keep.sum()) // 48 * 48]  # whole rows of 256 and of 96
    mbits, bias = (3, 7) if fp8_dtype == torch.float8_e4m3fn else (2, 15)
    e = _eager(x, fp8_dtype, floor)[1].long()  # (n, 1): one scale a block
    assert int(e.min()) > bias + mbits
    mag = x.float().view(torch.int32).long() & 0x7FFFFFFF
    shift = 23 - mbits
    code = (mag + ((bias - e) << 23) + (1 << (shift - 1)) - 1 + ((mag >> shift) & 1)) >> shift
    return torch.where((code >= -(mbits << mbits)) & (code < 1 << mbits), torch.zeros_like(x), x)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", ELEMENTS)
@pytest.mark.parametrize("floor", [False, True])
def test_fast_paths_alone_give_the_blocks_they_keep(dtype, fp8_dtype, floor, isa):
    """With the float32 fallback compiled out (MXPORT_TEST_FAST_ONLY), the fast paths alone give the eager
    bytes on every block they keep (:func:`_kept_blocks`: whole groups of one scale, of mixed scales, and rows
    of 18 blocks for the per-row path): each rounding position, ties, carries into the next binade,
    saturation, codes flushed to (signed) zero, products that round up to min_normal. The tests above, where
    most blocks hold FP8 subnormals, check the fallback."""
    lib = _lib(isa, fast_only=True)
    blocks = _kept_blocks(dtype, fp8_dtype, floor)
    perm = blocks[torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(43))]
    n = blocks.shape[0] // 19  # rows of 18 blocks and a short one of 17 (the float path casts it)
    rows_593 = perm[:19 * n].reshape(n, 608)[:, :593].contiguous()
    for x in (blocks.reshape(-1, 256), perm.reshape(-1, 96), rows_593):
        _assert_same(x, fp8_dtype, floor, lib=lib)


@pytest.mark.parametrize("isa", _isas())
def test_fast_only_build_needs_its_fallback(isa):
    """The fast-only build differs from the eager kernel on blocks with FP8 subnormal products: the test above
    sees the fast path, not the fallback (and the fallback is what makes the default build right there)."""
    x = _f32_layouts(_f32_blocks_below_their_amax(29))[0]
    q, _ = _native(x, torch.float8_e4m3fn, False, lib=_lib(isa, fast_only=True))
    assert not torch.equal(q, _eager(x, torch.float8_e4m3fn, False)[0])
    _assert_same(x, torch.float8_e4m3fn, False, lib=_lib(isa))


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("fp8_dtype", ELEMENTS)
@pytest.mark.parametrize("which", ["saturating", "high", "tiny"])
def test_f32_rceil_with_another_inv_max_norm(fp8_dtype, which, isa):
    """rceil on :func:`_f32_blocks_below_their_amax` with an inv_max_norm other than f32(1 / max_norm), as the
    eager kernel takes it: 1 / (max_norm * 8/7) (products up to 8/7 max_norm, the ones rounding above it
    saturated), 2^20 / max_norm (scales 20 binades up, clamped at 254 for the largest amaxes: products far
    below 1, FP8 subnormals and zeros), and 2^-149, a float32 subnormal (small scales clamped at 0 and large
    ones whose products pass float32 max: Inf, saturated)."""
    fmt = element_format(fp8_dtype)
    inv = {"saturating": float(np.float32(1.0) / np.float32(fmt.max_norm * 8 / 7)),
           "high": float(np.float32(2.0**20) / np.float32(fmt.max_norm)), "tiny": 2.0**-149}[which]
    elem = int(fp8_dtype == torch.float8_e5m2)
    for x in _f32_layouts(_f32_blocks_below_their_amax(31)):
        q, e = native.quantize_rows(_lib(isa), x, elem, False, inv, fmt.emax)
        rq, re = _rowwise_kernel(x, fmt.max_norm, inv, fmt.emax, fp8_dtype, False, False)
        assert torch.equal(e, re), f"scales differ at {(e != re).nonzero()[:5].tolist()}"
        assert torch.equal(q, rq), f"values differ at {(q != rq).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_f32_quantize_many_with_sums(rounding, isa, monkeypatch):
    """quantize_many with fused sums (the native kernel sums its output tile by tile, through the same row
    functions) on the float32 layouts of :func:`_f32_blocks_below_their_amax`, in each instruction-set branch:
    each tensor gets the eager bytes, and the sums are the eager kernel's (summed with torch ops)."""
    from mxport.quantize import quantize_many
    from mxport.refit.buckets import BucketLayout, ChunkSums
    from mxport.refit.plan import RefitPlan

    monkeypatch.setattr(NATIVE_PATH, "_lib", _lib(isa))

    xs = _f32_layouts(_f32_blocks_below_their_amax(37))
    offsets, pos = [], 5
    for x in xs:
        offsets.append((pos, pos + x.numel() + 3))
        pos += x.numel() + 3 + x.shape[0] * -(-x.shape[1] // 32) + 1
    plan = RefitPlan([("s", "kept", torch.uint8, (pos,))])
    got = {}
    for kernel in ("native", "eager"):
        sums = ChunkSums(plan)
        got[kernel] = quantize_many(xs, rounding=rounding, kernel=kernel, sums=sums, offsets=offsets)
        sizes = BucketLayout(plan, 4096).sizes
        got[kernel + " sums"] = [sums.checksum(b * 4096, n) for b, n in enumerate(sizes)]
    assert got["native sums"] == got["eager sums"]
    for c, x in zip(got["native"], xs, strict=True):
        _assert_components_equal(c, _per_tensor(x, torch.float8_e4m3fn, rounding))


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("fp8_dtype,floor,block_2d",
                         list(itertools.product(ELEMENTS, (False, True), (False, True))))
def test_random_float32_bit_patterns(fp8_dtype, floor, block_2d, isa):
    """Any 32-bit pattern (NaN payloads of both signs included) in blocks of mixed magnitudes."""
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31 - 1, (300, 640), generator=g, dtype=torch.int64).to(torch.int32)
    _assert_same(bits.view(torch.float32), fp8_dtype, floor, block_2d, lib=_lib(isa))


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 1100), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       fp8_dtype=st.sampled_from(ELEMENTS), floor=st.booleans(), binade=st.integers(-140, 120),
       specials=st.booleans(), block_2d=st.booleans())
def test_native_equals_eager_property(m, k, seed, dtype, fp8_dtype, floor, binade, specials, block_2d):
    """Shapes with K not a multiple of 32 or of 512 (partial blocks, partial groups of 16 blocks), M not a
    multiple of 32 (partial 32x32 blocks), 1-row inputs, magnitudes from subnormal to huge, and NaN / ±Inf /
    ±0 sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0 ** binade
    if specials:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        vals = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45, 3.4e38])
        flat[idx] = vals[torch.randint(0, len(vals), (idx.numel(),), generator=g)]
    _assert_same(x.to(dtype), fp8_dtype, floor, block_2d)


def test_edge_rows_through_quantize():
    """The issue's edge rows go through the default (native) path with the right bytes."""
    x = torch.zeros(4, 32)
    x[0, 0] = 480.0                 # rceil: E = 128, 480 -> 240 = 1.875 * 2^7 (0x77)
    x[1, :] = float("nan")          # all NaN: E = 0, every value the NaN byte
    x[2, 0], x[2, 1] = float("inf"), 1.0   # Inf: E = 254
    assert kernel_for(x) == "native"
    c = quantize(x)
    assert c.scale_inv[:, 0].tolist() == [128, 0, 254, 0]
    assert c.data.view(torch.uint8)[0, 0].item() == 0x77
    assert c.data.view(torch.uint8)[1].tolist() == [0x7F] * 32
    assert c.data.view(torch.uint8)[2, 0].item() == 0x7E     # Inf saturates to 448
    assert quantize(x, rounding="floor").scale_inv[0, 0].item() == 127


@pytest.mark.parametrize("kwargs", [dict(), dict(direction="columnwise"), dict(fp8_dtype=torch.float8_e5m2),
                                    dict(block_2d=True), dict(block_2d=True, direction="columnwise")])
def test_threads_and_layouts_match_eager(kwargs):
    """A tensor large enough to be split over threads, 3-D and non-contiguous, equals the eager kernel, on one
    thread and on two."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 300, 1000, generator=g) * 3).to(torch.bfloat16).transpose(0, 1)  # non-contiguous
    want = quantize(x, fast=False, **kwargs)
    saved = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = quantize(x, **kwargs)
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(got.scale_inv, want.scale_inv)
    finally:
        torch.set_num_threads(saved)


def test_kernel_choice():
    x = torch.randn(4, 64)
    assert kernel_for(x) == "native"
    assert kernel_for(x, fast=True) == "native"
    assert kernel_for(x, fast=False) == "eager"
    # quantize() reads float64 as float32 first
    assert kernel_for(x.to(torch.float64)) in ("compiled", "eager")


def test_fallback_without_native(no_native):
    """With the native kernel off (and compile off, as in this test run), quantize runs eager, and fast=True
    says why it cannot."""
    from mxport.quantize import FAST_PATH

    if FAST_PATH.available:
        pytest.skip("torch.compile is enabled in this run")
    x = torch.randn(8, 100).to(torch.bfloat16)
    assert kernel_for(x) == "eager"
    with pytest.raises(RuntimeError, match="no fast kernel is available .native: turned off"):
        quantize(x, fast=True)


def test_self_check_failure_disables_native(monkeypatch):
    """A kernel that gives wrong bytes on the probe tensors is never used.

    quantize falls back, with a reason."""
    from mxport.quantize import _NativePath

    real = native.quantize_rows

    def wrong(lib, x2, *args, **kwargs):
        q, e = real(lib, x2, *args, **kwargs)
        q.view(-1)[0] ^= 1
        return q, e

    monkeypatch.setattr(native, "quantize_rows", wrong)
    path = _NativePath()
    assert not path.available
    assert "self-check failed" in path.disabled_reason


def test_no_compiler_gives_a_clear_reason(monkeypatch, tmp_path):
    from mxport.quantize import _NativePath

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MXPORT_CACHE", str(tmp_path / "cache"))
    path = _NativePath()
    assert not path.available
    assert "no-such-cc" in path.disabled_reason
    x = torch.randn(4, 64)
    assert torch.equal(quantize(x).scale_inv, quantize(x, fast=False).scale_inv)


def test_disable_env(monkeypatch):
    from mxport.quantize import _NativePath

    monkeypatch.setenv(native.ENV_DISABLE, "1")
    assert _NativePath().disabled_reason == f"{native.ENV_DISABLE} is set"


def _quick_cflags(monkeypatch) -> None:
    """The build at -O1: what these tests check (caching, atomic placement, $CC's words) does not depend on
    the optimisation level, and -O3 of the AVX-512 source takes half a minute on a 2-core machine."""
    monkeypatch.setattr(native, "CFLAGS", tuple("-O1" if f == "-O3" else f for f in native.CFLAGS))


def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    _quick_cflags(monkeypatch)
    target = tmp_path / "lib" / native.LIB_NAME
    path = native.build(target)
    assert path == target and path.is_file()
    mtime = path.stat().st_mtime_ns
    assert native.build(target) == path and path.stat().st_mtime_ns == mtime   # reused, not rebuilt
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([native.LIB_NAME, "mxfp8_cpu.c"])
    lib = native.load(path)
    q, e = native.quantize_rows(lib, torch.ones(2, 40), 0, False, 1 / 448, 8)
    # amax 1: the smallest 2^(E-127) >= 1/448 is 2^-8 (E = 119); 1 * 2^8 = 256 is E4M3 0x78
    assert e.tolist() == [[119, 119]] * 2 and q.unique().tolist() == [0x78]


def test_bad_compiler_output_is_reported(tmp_path, monkeypatch):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'fake compiler: broken' >&2\nexit 3\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(native.NativeUnavailable, match="exit 3.*fake compiler: broken"):
        native.build(tmp_path / "out" / native.LIB_NAME)
    assert not (tmp_path / "out" / native.LIB_NAME).exists()


@pytest.mark.parametrize("kernel", ["native", "eager"])
def test_quantize_out_writes_in_place(kernel):
    """``out=(values, scales)``: the same bytes as a fresh quantize, written into the caller's tensors (the
    native kernel directly, the others by copy), for FP8 or uint8 values and uint8 or E8M0 scales."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 7, 100, generator=g) * 5).to(torch.bfloat16)
    want = quantize(x, fp8_dtype=torch.float8_e5m2, fast=False)
    values = torch.full((3, 7, 100), 0xAB, dtype=torch.uint8)
    scales = torch.full((3, 7, 4), 0xAB, dtype=torch.uint8)
    got = quantize(x, torch.float8_e5m2, out=(values, scales), kernel=kernel)
    assert got.data.dtype == torch.float8_e5m2 and got.data.data_ptr() == values.data_ptr()
    assert got.scale_inv.data_ptr() == scales.data_ptr()
    assert torch.equal(values, want.data.view(torch.uint8)) and torch.equal(scales, want.scale_inv)
    if hasattr(torch, "float8_e8m0fnu"):
        v2 = torch.empty(3, 7, 100, dtype=torch.float8_e5m2)
        s2 = torch.empty(3, 7, 4, dtype=torch.float8_e8m0fnu)
        quantize(x, torch.float8_e5m2, out=(v2, s2), kernel=kernel)
        assert torch.equal(s2.view(torch.uint8), want.scale_inv)


def test_quantize_out_bad_arguments():
    x = torch.randn(4, 64)
    v = torch.empty(4, 64, dtype=torch.float8_e4m3fn)
    s = torch.empty(4, 2, dtype=torch.uint8)
    with pytest.raises(TypeError, match="out must be a .values, scales. pair"):
        quantize(x, out=v)
    with pytest.raises(ValueError, match=r"out\[0\] \(values\) must have shape \(4, 64\)"):
        quantize(x, out=(v[:2], s))
    with pytest.raises(ValueError, match=r"out\[1\] \(scales\) must have shape \(4, 2\)"):
        quantize(x, out=(v, s[:, :1]))
    with pytest.raises(TypeError, match=r"out\[0\] \(values\) must be torch.float8_e4m3fn or torch.uint8"):
        quantize(x, out=(v.view(torch.int8), s))
    with pytest.raises(ValueError, match="contiguous"):
        quantize(torch.randn(64, 64), out=(torch.empty(64, 64, dtype=torch.uint8).t(),
                                           torch.empty(64, 2, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="direction='rowwise' only"):
        quantize(x, direction="columnwise", out=(v, s))


def test_quantize_out_must_not_overlap():
    """Outs that share memory with x or with each other are refused (the native kernel would read what it had
    already written: wrong bytes, different from eager)."""
    x = torch.randn(64, 256)
    inside_x = x.view(-1).view(torch.uint8)[:64 * 256].view(64, 256)
    s = torch.empty(64, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"out\[0\] \(values\) and x share memory"):
        quantize(x, out=(inside_x, s))
    buf = torch.empty(64 * 256 + 64 * 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"out\[0\] \(values\) and out\[1\] \(scales\) share memory"):
        quantize(x, out=(buf[:64 * 256].view(64, 256), buf[64 * 256 - 8:64 * 256 - 8 + 512].view(64, 8)))
    v = buf[:64 * 256].view(64, 256)
    quantize(x, out=(v, buf[64 * 256:].view(64, 8)))   # adjacent, not overlapping: fine
    one = torch.empty(4, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="share memory"):
        quantize(torch.randn(4, 1), out=(one, one))


def test_fork_while_a_lock_is_held_does_not_hang_the_child():
    """A fork while another thread holds the native path's lock (its first build) leaves the child with a
    fresh lock, not one nobody will release."""
    import os

    from mxport import native as native_mod

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    NATIVE_PATH._lock.acquire()
    native_mod._POOL_LOCK.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # child: both locks must be free
            ok = NATIVE_PATH._lock.acquire(timeout=5) and native_mod._POOL_LOCK.acquire(timeout=5)
            os._exit(0 if ok else 1)
    finally:
        NATIVE_PATH._lock.release()
        native_mod._POOL_LOCK.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_cc_with_arguments(monkeypatch, tmp_path):
    """$CC is split like a shell word list (``ccache gcc``, ``gcc -O2``), and its words reach the compiler
    ahead of mxport's flags."""
    import shutil

    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    _quick_cflags(monkeypatch)
    source = native.source_text()
    guard = "\n#ifndef MXPORT_TEST_FLAG\n#error no flag\n#endif\n"  # fails the build without $CC's word
    monkeypatch.setattr(native, "source_text", lambda: source + guard)
    monkeypatch.setenv("CC", f"{gcc} -DMXPORT_TEST_FLAG=1")
    assert native.find_compiler() == [gcc, "-DMXPORT_TEST_FLAG=1"]
    lib = native.load(native.build(tmp_path / native.LIB_NAME))
    q, e = native.quantize_rows(lib, torch.ones(1, 32), 0, False, 1 / 448, 8)
    assert e.tolist() == [[119]]


def test_kernel_isa_matches_the_cpu():
    """The kernel is built for the widest instruction set the CPU has.

    AVX-512 (F, BW, VL, DQ), else AVX2 + F16C (AMD Zen and pre-2017 Intel have no AVX-512: before the AVX2
    kernel these machines had no native path)."""
    flags = _cpu_flags()
    lib = native.load(native.build())
    want = "avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else "avx2"
    assert native.isa(lib) == want


@pytest.mark.parametrize("flags", [("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c"),
                                   ("-mavx2", "-mf16c", "-mno-avx512f"), ("-mno-avx2", "-mno-avx512f")])
def test_every_isa_branch_compiles(tmp_path, flags):
    """Each branch of the C source (AVX-512, AVX2 + F16C, none) compiles warning-free, whichever this CPU
    runs (at -O1, which runs the warnings' flow analysis: -O2 of the AVX-512 branch takes most of a minute
    on a 2-core machine, -O0 longer still)."""
    src = tmp_path / "k.c"
    src.write_text(native.source_text())
    cc = native.find_compiler()
    proc = native.run_compiler([*cc, "-O1", "-std=c11", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
                                *flags, "-o", str(tmp_path / "k.so"), str(src)])  # no time limit in tests
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_compiler_runs_have_no_time_limit_in_tests(tmp_path, monkeypatch):
    """A compile on a busy machine took past the 120 s limit of the ISA-branch test and failed it: in the test
    suite (conftest sets $MXPORT_COMPILE_TIMEOUT=0) every compiler run of the build waits as long as it
    takes; elsewhere the limit is COMPILE_TIMEOUT_S, or the variable's."""
    import os
    import subprocess

    limits = []

    def run(args, **kwargs):
        limits.append(kwargs.get("timeout", "none given"))
        return subprocess.CompletedProcess(args, 3, "cc 1.0\n", "no compiler here")

    monkeypatch.setattr(native.subprocess, "run", run)
    with pytest.raises(native.NativeUnavailable, match="exit 3"):
        native.build(tmp_path / native.LIB_NAME)
    native.build_key(native.source_text(), ["cc"])  # runs `cc --version`
    assert os.environ[native.ENV_COMPILE_TIMEOUT] == "0" and limits == [None, None]  # compile, --version
    monkeypatch.delenv(native.ENV_COMPILE_TIMEOUT)
    assert native.compile_timeout() == native.COMPILE_TIMEOUT_S
    monkeypatch.setenv(native.ENV_COMPILE_TIMEOUT, "45")
    assert native.compile_timeout() == 45.0
    monkeypatch.setenv(native.ENV_COMPILE_TIMEOUT, "soon")
    with pytest.raises(native.NativeUnavailable, match="not a number"):
        native.compile_timeout()


def _per_tensor(x, fp8_dtype, rounding):
    return quantize(x, fp8_dtype, rounding=rounding, kernel="eager")


def _assert_components_equal(got, want):
    assert got.direction == "rowwise" and got.data.shape == want.data.shape
    assert torch.equal(got.scale_inv, want.scale_inv)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))


_SHAPES = st.lists(st.tuples(st.integers(0, 70), st.integers(1, 200)), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(shapes=_SHAPES, seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                                              torch.float16, torch.float64]),
       fp8_dtype=st.sampled_from(ELEMENTS), rounding=st.sampled_from(["rceil", "floor"]),
       with_outs=st.booleans(), threads=st.sampled_from([1, 2]))
def test_quantize_many_equals_per_tensor_quantize(shapes, seed, dtype, fp8_dtype, rounding, with_outs,
                                                  threads):
    """quantize_many gives each tensor exactly quantize's bytes: any M (0, 1, ...) and K (multiples of 32 or
    not), every input dtype (float64 goes through quantize), both element formats and roundings, fresh outputs
    or caller's slots, on one thread or cut between threads (MIN_NUMEL_PER_THREAD lowered so small batches
    split, inside tensors too)."""
    from mxport.quantize import quantize_many

    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-20, 20, (m, 1), generator=g)).to(dtype)
          for m, k in shapes]
    outs = None
    if with_outs:
        outs = [(torch.full((m, k), 0xAB, dtype=torch.uint8),
                 torch.full((m, -(-k // 32)), 0xCD, dtype=torch.uint8)) for m, k in shapes]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(native, "MIN_NUMEL_PER_THREAD", 64)
            got = quantize_many(xs, fp8_dtype, rounding=rounding, outs=outs)
    finally:
        torch.set_num_threads(prev)
    assert len(got) == len(xs)
    for i, (x, c) in enumerate(zip(xs, got, strict=True)):
        _assert_components_equal(c, _per_tensor(x, fp8_dtype, rounding))
        if with_outs:  # written in place: the components are views of the caller's tensors
            assert c.data.data_ptr() == outs[i][0].data_ptr()
            assert c.scale_inv.data_ptr() == outs[i][1].data_ptr()


def test_quantize_many_shapes_and_kernels():
    """N-d and 1-row tensors, an empty one, a non-contiguous one, kernel='eager' (no native call: the same
    bytes); bad input raises as quantize does; outputs that overlap an input or each other are refused."""
    from mxport.quantize import quantize_many

    xs = [torch.randn(2, 3, 40), torch.randn(1, 576), torch.randn(0, 64), torch.randn(64, 48).t(),
          torch.randn(5)]
    for kernel in (None, "native", "eager"):
        for x, c in zip(xs, quantize_many(xs, kernel=kernel), strict=True):
            _assert_components_equal(c, _per_tensor(x, torch.float8_e4m3fn, "rceil"))
    assert quantize_many([]) == []
    with pytest.raises(TypeError, match="FP8"):
        quantize_many([torch.randn(4, 32), torch.zeros(4, 32, dtype=torch.float8_e4m3fn)])
    with pytest.raises(ValueError, match="one entry per tensor"):
        quantize_many([torch.randn(4, 32)], outs=[])
    buf = torch.zeros(2 * 4 * 32 + 8, dtype=torch.uint8)
    q, e = buf[:128].view(4, 32), buf[128:132].view(4, 1)
    q2 = buf[64:192].view(4, 32)  # overlaps q (and e)
    with pytest.raises(ValueError, match="overlap"):
        quantize_many([torch.randn(4, 32), torch.randn(4, 32)], outs=[(q, e), (q2, buf[192:196].view(4, 1))])
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="overlap"):  # out of tensor 1 is tensor 0's input
        quantize_many([x, torch.randn(4, 8)], outs=[None, (x.view(torch.uint8).view(-1)[:32].view(4, 8), e)])


def _overlap_cases():
    """(name, x, (values, scales)) where the output overlaps its own input or itself."""
    x = torch.randn(4, 32)
    xb = x.view(torch.uint8).view(-1)
    buf = torch.zeros(256, dtype=torch.uint8)
    base = torch.randn(4, 64)
    gap = base.view(torch.uint8).view(-1)[128:256]  # bytes of base[0, 32:64]: between x's rows, not in them
    return [
        ("values on own input", x, (xb[:128].view(4, 32), buf[200:204].view(4, 1))),
        ("scales on own input", x, (buf[:128].view(4, 32), xb[508:512].view(4, 1))),
        ("scales on own values", x, (buf[:128].view(4, 32), buf[124:128].view(4, 1))),
        ("values in a strided input's span", base[:, :32], (gap.view(4, 32), buf[200:204].view(4, 1))),
    ]


@pytest.mark.parametrize("kernel", [None, "native"])
@pytest.mark.parametrize("case", range(4))
def test_quantize_many_refuses_outs_on_their_own_input_or_each_other(case, kernel):
    """Every output quantize refuses for overlapping its input or its other half, quantize_many refuses too,
    alone or among other tensors, before writing anything; inputs may share memory, and slots packed edge to
    edge in one buffer (a refit arena) are taken."""
    from mxport.quantize import quantize_many

    name, x, out = _overlap_cases()[case]
    with pytest.raises(ValueError, match="overlap"):
        quantize(x, out=out, kernel=kernel)
    other = torch.randn(8, 64)
    snapshot = [t.clone() for t in (x, *out)]
    for tensors, outs in (([x], [out]), ([other, x, other], [None, out, None])):
        with pytest.raises(ValueError, match="overlap"):
            quantize_many(tensors, outs=outs, kernel=kernel)
        assert all(torch.equal(a, b) for a, b in zip((x, *out), snapshot, strict=True)), name
    arena = torch.full((2 * (4 * 32 + 4),), 0xAB, dtype=torch.uint8)
    slots = [(arena[:128].view(4, 32), arena[128:132].view(4, 1)),
             (arena[132:260].view(4, 32), arena[260:264].view(4, 1))]
    y = torch.randn(4, 32)
    got = quantize_many([y, y], outs=slots, kernel=kernel)
    for c in got:
        _assert_components_equal(c, _per_tensor(y, torch.float8_e4m3fn, "rceil"))


def _bad_outs(x):
    """Outputs quantize refuses for x (4, 2, 40) for their dtype, shape, layout or form."""
    def pair(values=None, scales=None):
        return (torch.empty(4, 2, 40, dtype=torch.uint8) if values is None else values,
                torch.empty(4, 2, 2, dtype=torch.uint8) if scales is None else scales)
    return [
        pair(values=torch.empty(4, 2, 40, dtype=torch.float16)),
        pair(values=torch.empty(4, 2, 40, dtype=torch.float8_e5m2)),
        pair(scales=torch.empty(4, 2, 2, dtype=torch.int8)),
        pair(values=torch.empty(8, 40, dtype=torch.uint8)),
        pair(values=torch.empty(4, 2, 41, dtype=torch.uint8)),
        pair(scales=torch.empty(4, 2, 1, dtype=torch.uint8)),
        pair(scales=torch.empty(8, 2, dtype=torch.uint8)),
        pair(scales=torch.empty(4, 2, dtype=torch.uint8)),
        pair(values=torch.empty(4, 40, 2, dtype=torch.uint8).transpose(1, 2)),
        pair(scales=torch.empty(2, 4, 2, dtype=torch.uint8).transpose(0, 1)),
        pair(values=torch.empty(4, 2, 40, dtype=torch.uint8, device="meta")),
        pair()[:1],
        [pair()[0], pair()[1], pair()[1]],
        (pair()[0], None),
    ]


@pytest.mark.parametrize("kernel", [None, "native"])
@pytest.mark.parametrize("case", range(14))
def test_quantize_many_checks_each_out_as_quantize(case, kernel):
    """An out of the wrong dtype, shape, layout, device or form gets quantize's own error from
    quantize_many, alone or in a batch; a good N-d out is written in place with quantize's bytes, and the
    components returned are those quantize returns, field by field."""
    from mxport.quantize import quantize_many

    x = torch.randn(4, 2, 40, dtype=torch.bfloat16)
    bad = _bad_outs(x)[case]
    with pytest.raises((TypeError, ValueError)) as want:
        quantize(x, out=bad, kernel=kernel)
    for tensors, outs in (([x], [bad]), ([torch.randn(3, 64), x], [None, bad])):
        with pytest.raises(want.type, match=re.escape(str(want.value))):
            quantize_many(tensors, outs=outs, kernel=kernel)
    good = (torch.empty(4, 2, 40, dtype=torch.float8_e4m3fn), torch.empty(4, 2, 2, dtype=torch.uint8))
    got = quantize_many([x], outs=[good], kernel=kernel)[0]
    ref = quantize(x, out=(torch.empty_like(good[0]), torch.empty_like(good[1])), kernel=kernel)
    assert got.data.data_ptr() == good[0].data_ptr() and got.scale_inv.data_ptr() == good[1].data_ptr()
    for f in dataclasses.fields(MXFP8Components):
        a, b = getattr(got, f.name), getattr(ref, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, f.name
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f.name
        else:
            assert a == b, f.name


def test_pieces_cover_every_row_once():
    """The cut of a batch between threads: runs in job order, every row of every job exactly once, whole
    32-row groups for 32x32 blocks, at most `threads` runs."""
    jobs = [(torch.empty(m, k), None, None) for m, k in [(1, 7), (300, 576), (0, 5), (64, 33), (33, 1000)]]
    jobs = [j for j in jobs if j[0].shape[0]]
    for threads, step in itertools.product([1, 2, 3, 7], [1, 32]):
        runs = native._pieces(jobs, threads, step)
        assert 1 <= len(runs) <= threads
        flat = [p for run in runs for p in run]
        for j, (x, _, _) in enumerate(jobs):
            mine = [(r0, r1) for jj, r0, r1 in flat if jj == j]
            assert mine[0][0] == 0 and mine[-1][1] == x.shape[0]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))
            assert all(r0 % step == 0 for r0, _ in mine)
        assert [jj for jj, _, _ in flat] == sorted(jj for jj, _, _ in flat)


def test_quantize_many_c_entry_checks_every_job_first():
    """mxport_quantize_many refuses a batch with one bad job (K = 0, an unknown dtype, reserved != 0, a
    negative stream offset when summing) before writing anything; struct mxport_job is the size native.Job
    says."""
    import ctypes

    lib = NATIVE_PATH._lib
    assert lib.mxport_job_size() == ctypes.sizeof(native.Job) == 64
    x = torch.randn(4, 64)
    q, e = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    out = torch.zeros(4, dtype=torch.int64)
    sums = ctypes.byref(native.Sums(1024, 1024, 4, out.data_ptr()))
    for bad in ({"k": 0}, {"in_dtype": 3}, {"reserved": 1}, {"rows": -1}, {"q_off": -1}):
        jobs = (native.Job * 2)()
        for j in jobs:
            j.x, j.rows, j.k, j.q, j.e, j.in_dtype = x.data_ptr(), 4, 64, q.data_ptr(), e.data_ptr(), 0
        for name, value in bad.items():
            setattr(jobs[1], name, value)
        assert lib.mxport_quantize_many(2, jobs, 0, 0, 1 / 448, 8, 0, sums) == -1
        assert not q.any() and not e.any() and not out.any()
    jobs[1].rows, jobs[1].k, jobs[1].in_dtype, jobs[1].reserved, jobs[1].q_off = 4, 64, 0, 0, 0
    assert lib.mxport_quantize_many(2, jobs, 0, 0, 1 / 448, 8, 0, None) == 0 and e.any()
