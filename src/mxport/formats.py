"""Element and scale codecs for MXFP8, exact at the bit level.

Everything here is plain elementwise torch code (no Python loops, no data-dependent control flow), so the same
functions serve the eager path and the ``torch.compile`` fast path of :func:`mxport.quantize`.

Sources: OCP Microscaling Formats (MX) v1.0 §5.3 (E8M0), §5.4 (FP8 elements), §6.3 (floor scale rule);
Transformer Engine ``common/util/ptx.cuh`` (``float_to_e8m0``, ``exp2f_rcp``) for the "rceil" rule.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MAX = 254  # largest finite E8M0 byte: 2**127
FP8_CANONICAL_NAN = 0x7F  # NaN in both E4M3 (S.1111.111) and E5M2 (S.11111.11)

#: ``torch.float8_e8m0fnu`` where this torch has it (2.7+), else ``None``. mxport carries scales as uint8
#: bytes.
FLOAT8_E8M0FNU = getattr(torch, "float8_e8m0fnu", None)

#: the high-precision float dtypes mxport quantizes from and decodes to
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

#: safetensors header dtype names -> torch dtypes (``F8_E8M0`` where this torch has ``float8_e8m0fnu``)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    **({"F8_E8M0": FLOAT8_E8M0FNU} if FLOAT8_E8M0FNU is not None else {}),
}


@dataclass(frozen=True)
class ElementFormat:
    """An FP8 element format of MXFP8 (OCP MX v1.0 §5.4).

    ``emax`` is the exponent of the largest power of two representable (8 for E4M3, 15 for E5M2); it is the
    ``emax_elem`` of the floor scale rule.
    """

    name: str  # "e4m3" | "e5m2"
    dtype: torch.dtype
    max_norm: float  # 448.0 | 57344.0
    emax: int


E4M3 = ElementFormat("e4m3", torch.float8_e4m3fn, 448.0, 8)
E5M2 = ElementFormat("e5m2", torch.float8_e5m2, 57344.0, 15)
_BY_DTYPE = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}
_BY_NAME = {E4M3.name: E4M3, E5M2.name: E5M2, "float8_e4m3fn": E4M3, "float8_e5m2": E5M2}


def describe(value) -> str:
    """A short description of an argument for error messages: a tensor by its shape, dtype and device (never
    its values: printing a huge or meta tensor fails), anything else by its repr, cut to 80 characters."""
    if isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} of shape {tuple(value.shape)}, {value.dtype}, on {value.device}"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def element_format(fp8_dtype: torch.dtype | str, *, argname: str = "fp8_dtype") -> ElementFormat:
    """The :class:`ElementFormat` for ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (or "e4m3" / "e5m2").

    Raises TypeError for anything else, naming ``argname``.
    """
    if isinstance(fp8_dtype, torch.dtype):
        fmt = _BY_DTYPE.get(fp8_dtype)
    else:
        fmt = _BY_NAME.get(fp8_dtype.lower()) if isinstance(fp8_dtype, str) else None
    if fmt is None:
        raise TypeError(
            f"{argname} must be torch.float8_e4m3fn or torch.float8_e5m2 (or 'e4m3' / 'e5m2'), "
            f"got {describe(fp8_dtype)}"
        )
    return fmt


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    """True for the two MXFP8 element dtypes."""
    return dtype in _BY_DTYPE


def as_e8m0_bytes(scale: torch.Tensor, *, argname: str = "scale_inv") -> torch.Tensor:
    """E8M0 scales as ``torch.uint8`` bit patterns: uint8 is returned as is, ``float8_e8m0fnu`` is bit-viewed
    (never value-cast). Anything else raises TypeError naming ``argname``."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor of uint8 E8M0 bytes, got {type(scale).__name__}")
    if scale.dtype == torch.uint8:
        return scale
    if FLOAT8_E8M0FNU is not None and scale.dtype == FLOAT8_E8M0FNU:
        return scale.view(torch.uint8)
    raise TypeError(
        f"{argname} must hold E8M0 scale bytes as torch.uint8 (or torch.float8_e8m0fnu, bit-viewed), "
        f"got {scale.dtype}"
    )


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes to float32 2**(E-127), built from bits: E=0 -> 2**-127, E=255 -> NaN (OCP MX
    §5.3)."""
    e32 = e.to(torch.int32)
    normal = torch.bitwise_left_shift(e32, 23)  # exponent field E, mantissa 0: exactly 2**(E-127) for E >= 1
    bits = torch.where(e32 == 0, torch.full_like(e32, 0x00400000), normal)  # 2**-127 is an FP32 subnormal
    bits = torch.where(e32 == E8M0_NAN, torch.full_like(e32, 0x7FC00000), bits)
    return bits.view(torch.float32)


def e8m0_multiplier(e: torch.Tensor) -> torch.Tensor:
    """float32 2**(127-E), the reciprocal of the scale, built from bits: E=254 -> 2**-127, E=0 -> 2**127.

    E=255 gives NaN. ``e`` is any integer tensor of biased exponents.
    """
    e32 = e.to(torch.int32)
    field = 254 - e32  # exponent field of 2**(127-E)
    bits = torch.where(field >= 1, torch.bitwise_left_shift(field.clamp(min=0), 23),
                       torch.full_like(e32, 0x00400000))
    bits = torch.where(e32 == E8M0_NAN, torch.full_like(e32, 0x7FC00000), bits)
    return bits.view(torch.float32)


def e8m0_rceil(v: torch.Tensor) -> torch.Tensor:
    """E8M0 byte (int32 tensor) = the smallest E with 2**(E-127) >= v, for float32 ``v >= 0``.

    Clamped to [0, 254]: v == 0 -> 0, v Inf -> 254 (saturating), v NaN -> 255. Computed from the float's
    exponent and mantissa bits; a float log2 is wrong near powers of two. Matches TE ``float_to_e8m0`` with
    satfinite (``cvt.rp.satfinite.ue8m0x2.f32``).
    """
    bits = v.contiguous().view(torch.int32)
    exp = torch.bitwise_and(torch.bitwise_right_shift(bits, 23), 0xFF)
    mant = torch.bitwise_and(bits, 0x7FFFFF)
    # normal: v = 2**(exp-127) * 1.m -> exp (+1 if m > 0); subnormal: v <= 2**-127 -> 0, else 1
    round_up = (mant > 0) & ((exp != 0) | (mant > 0x400000))
    e = exp + round_up.to(torch.int32)
    e = torch.clamp(e, 0, E8M0_MAX)
    return torch.where(torch.isnan(v), torch.full_like(e, E8M0_NAN), e)


def e8m0_floor(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """E8M0 byte (int32 tensor) of the OCP MX v1.0 §6.3 rule: E-127 = floor(log2 amax) - emax, clamped to
    [0, 254].

    floor(log2 amax) is the float32 exponent field minus 127 (exact, no float log2). Zero and subnormal amax
    (floor(log2) <= -127) clamp to 0; Inf -> 254; NaN -> 255.
    """
    a = amax.to(torch.float32).contiguous()
    exp = torch.bitwise_and(torch.bitwise_right_shift(a.view(torch.int32), 23), 0xFF)
    e = torch.clamp(exp - 127 - emax + E8M0_BIAS, 0, E8M0_MAX)
    e = torch.where(exp == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(a), torch.full_like(e, E8M0_MAX), e)
    return torch.where(torch.isnan(a), torch.full_like(e, E8M0_NAN), e)


def saturating_cast(x: torch.Tensor, max_norm: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32 -> FP8 bytes (``torch.uint8``; view them as ``fp8_dtype``): round-to-nearest-even, saturating
    to ±max_norm (Inf -> ±max_norm); every NaN -> 0x7F.

    PyTorch's own cast does not saturate (480 -> NaN in E4M3), so values are clamped first (``clamp`` keeps
    NaN). Every NaN becomes the canonical byte 0x7F (a NaN in both E4M3 and E5M2, as ``cvt.rn.satfinite``
    gives), so the eager and compiled casts, whose NaN sign bits differ, produce identical bytes. E4M3 is
    computed from the float32 bits (:func:`_saturating_cast_e4m3`); for E5M2 the NaN test runs on the bytes
    (low 7 bits 0x7D..0x7F). Returning bytes (not FP8) keeps a compiled caller's output a single fused pass.
    """
    if fp8_dtype == torch.float8_e4m3fn:
        return _saturating_cast_e4m3(x, max_norm)
    q = torch.clamp(x, -max_norm, max_norm).to(fp8_dtype).view(torch.uint8)
    nan_min = 0x7D
    return torch.where(torch.bitwise_and(q, 0x7F) >= nan_min, torch.full_like(q, FP8_CANONICAL_NAN), q)


def _saturating_cast_e4m3(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """float32 -> E4M3 bytes by integer arithmetic on the float32 bits (same contract as
    :func:`saturating_cast`).

    All lanes stay 32-bit until the final narrowing, which the compiled kernel vectorizes far better than the
    FP8 convert + byte-wise NaN fix-up (checked equal to ``saturating_cast``'s cast on all 2**32 float32
    patterns). Normal results (|x| >= 2**-6): round the mantissa to 3 bits, nearest-even, by adding 0x7FFFF +
    lsb and shifting (a carry into the exponent is the correct rounding), then rebias 127 -> 7. Subnormal
    results: the integer nearest-even to |x| * 2**9, read from the mantissa of |x| * 2**9 + 2**23 (exact for
    |x| < 2**-6).
    """
    a = torch.clamp(x.abs(), max=max_norm)  # NaN stays NaN (either sign); Inf -> max_norm
    bits = a.view(torch.int32)
    rounded = bits + 0x7FFFF + torch.bitwise_and(torch.bitwise_right_shift(bits, 20), 1)
    normal = torch.bitwise_right_shift(rounded, 20) - (120 << 3)  # (exp - 127 + 7) << 3 | mantissa
    subnormal = (a * 512.0 + 8388608.0).view(torch.int32) - 0x4B000000
    mag = torch.where(a < 0.015625, subnormal, normal)
    sign = torch.bitwise_and(torch.bitwise_right_shift(x.view(torch.int32), 24), 0x80)
    q = torch.where(a != a, torch.full_like(mag, FP8_CANONICAL_NAN), torch.bitwise_or(mag, sign))
    return q.to(torch.uint8)


def ceil_div(a: int, b: int) -> int:
    """Integer ceil(a / b) for a >= 0, b > 0."""
    return -(-a // b)


def roundup(a: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= a."""
    return ceil_div(a, multiple) * multiple


def numel_of(shape) -> int:
    """prod(shape) as a Python int (1 for an empty shape)."""
    return math.prod(int(s) for s in shape)


class TooLargeError(MemoryError, ValueError):
    """The result of a call cannot be allocated (e.g. for a huge ``expand()``ed view that holds no memory of
    its own): a MemoryError, and a ValueError naming the argument and the size."""


def is_alloc_failure(exc: BaseException) -> bool:
    """True for an exception that says memory could not be allocated (CPU allocator, CUDA OOM,
    MemoryError)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in msg or "not enough memory" in msg)


@contextlib.contextmanager
def allocating(argname: str, t) -> Iterator[None]:
    """Raise an allocation failure inside (CPU allocator RuntimeError, CUDA OutOfMemoryError, MemoryError) as
    a :class:`TooLargeError` naming ``argname`` and its shape."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if not is_alloc_failure(exc):
            raise
        raise TooLargeError(f"{argname} of shape {tuple(t.shape)} ({numel_of(t.shape):.3g} elements) is too "
                            f"large: its result cannot be allocated on {t.device}") from None
