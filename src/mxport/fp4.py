"""MXFP4 and NVFP4: E2M1 elements, two per byte, with their block scales, exact at the bit level.

* **E2M1** (OCP MX v1.0 §5.3.3): sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6;
  no Inf or NaN. Values round to nearest, ties to the even code, and saturate at +-6. Two codes share a byte,
  the even-indexed element in the low nibble (ModelOpt, compressed-tensors and torchao pack so).
* **MXFP4** (OCP MX v1.0): one E8M0 scale byte per block of 32 along the last dimension. ``rounding="rceil"``:
  the smallest power of two ``2**(E-127) >= amax / 6`` (torchao's ``ScaleCalculationMode.RCEIL``, cuBLAS's
  block-scaling rule); ``"floor"``: OCP's §6.3 rule ``floor(log2 amax) - 2``. The elements are
  ``x / 2**(E-127)`` as E2M1.
* **NVFP4** (NVIDIA; ModelOpt 0.47 ``NVFP4QTensor``): one FP8 E4M3 scale per block of 16 and one float32
  global scale per tensor, ``amax / (6 * 448)`` (ModelOpt's ``weight_scale_2``). A block's scale is
  ``block_amax / (6 * global)`` (1.0 for an all-zero block) clamped to [2**-9, 448] and cast to E4M3; its
  elements are ``x / (scale * global)`` as E2M1. Each step is the float32 operation ModelOpt runs, in its
  order, so the bytes are ModelOpt's (the tests compare them; a global scale given by the caller is taken as
  float32). Decoded: ``e2m1 * scale * global``. Where ``amax / (6 * 448)`` is 0 (an all-zero tensor, or an
  amax below about 4e-42: ModelOpt divides 0 by 0 there and writes NaN scales) the global scale is 1.0.

A format is one :class:`FP4Format` record (element codec, block size, scale codec, packing) that
:func:`quantize_fp4` and :meth:`FP4Components.dequantize` read.

On the CPU, where mxport's native library builds (:mod:`mxport.native`, ``mxport_fp4_rows``), one scalar C
pass does the same float32 steps (the torch ops here are the reference, and the tests hold the two
byte-identical over every magnitude and tie); :data:`NATIVE` False forces the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import e8m0_floor, e8m0_rceil, e8m0_to_float

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: E2M1 magnitudes by code (the sign is bit 3)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: the midpoints between neighbouring magnitudes; a magnitude above midpoint i has code > i
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
#: the midpoints whose upper neighbour has the even code (a tie there rounds up)
_TIES_UP = (0.75, 1.75, 3.5)
_NVFP4_SCALE_MIN = 2.0 ** -9  # the smallest E4M3 subnormal
#: use the native kernel where it is available (False: always the torch reference)
NATIVE = True


@dataclass(frozen=True)
class FP4Format:
    """One 4-bit format: its E2M1 elements (packed two per byte, low nibble first), ``block`` elements per
    scale along the last dimension, the scale's codec (``"e8m0"`` bytes or ``"e4m3"`` floats) and whether a
    float32 global scale multiplies the block scales."""

    name: str
    block: int
    scale_codec: str
    global_scale: bool


MXFP4 = FP4Format("mxfp4", 32, "e8m0", False)
NVFP4 = FP4Format("nvfp4", 16, "e4m3", True)
FORMATS = {f.name: f for f in (MXFP4, NVFP4)}


@dataclass(frozen=True)
class FP4Components:
    """A quantized tensor: ``data`` (uint8, the last dimension halved: two E2M1 codes a byte), ``scale``
    (uint8 E8M0 bytes for MXFP4, ``float8_e4m3fn`` for NVFP4; one per block), ``global_scale`` (NVFP4: a
    float32 scalar tensor; MXFP4: None)."""

    format: FP4Format
    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The decoded values: E2M1 element x its block's scale (x the global scale)."""
        values = e2m1_values(unpack_e2m1(self.data))
        blocks = values.reshape(*values.shape[:-1], values.shape[-1] // self.format.block, self.format.block)
        if self.format.scale_codec == "e8m0":
            scale = e8m0_to_float(self.scale)
        else:
            scale = self.scale.to(torch.float32) * self.global_scale
        return (blocks * scale.unsqueeze(-1)).reshape(values.shape).to(dtype)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of float32 ``x``: round to nearest, ties to the even code, saturating at
    +-6; the sign bit set for ``x < 0`` (so -0.0 encodes as +0). ``x`` must hold no NaN."""
    mags = x.abs()
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.searchsorted(midpoints, mags.contiguous(), out_int32=True)  # midpoints strictly below
    ties = torch.tensor(_TIES_UP, dtype=torch.float32, device=x.device)
    code = code + torch.isin(mags, ties).to(torch.int32)
    return (code + (x < 0).to(torch.int32) * 8).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8, 0..15)."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte along the last dimension (even length), the even-indexed one in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: the last dimension ({codes.shape[-1]}) must be even")
    return torch.bitwise_or(torch.bitwise_left_shift(codes[..., 1::2], 4), codes[..., 0::2])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack_e2m1`'s bytes (the last dimension doubled)."""
    low = torch.bitwise_and(packed, 0x0F)
    high = torch.bitwise_right_shift(packed, 4)
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _check(x: torch.Tensor, fmt: FP4Format) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{fmt.name}: x must be a floating-point torch.Tensor")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % fmt.block:
        last = x.shape[-1] if x.dim() else "none: a 0-d tensor"
        raise ValueError(f"{fmt.name}: the last dimension ({last}) must be a positive multiple of "
                         f"{fmt.block}")


def _blocks(x: torch.Tensor, fmt: FP4Format) -> torch.Tensor:
    _check(x, fmt)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{fmt.name}: x holds NaN or Inf, which E2M1 cannot encode")
    return x.reshape(*x.shape[:-1], x.shape[-1] // fmt.block, fmt.block)


def quantize_mxfp4(x: torch.Tensor, *, rounding: str = "rceil") -> FP4Components:
    """MXFP4 of ``x`` along its last dimension (a multiple of 32): see the module doc for ``rounding``
    (``"rceil"`` or ``"floor"``)."""
    _check(x, MXFP4)
    if rounding in ("rceil", "floor") and (got := _native(x, MXFP4, rounding)) is not None:
        return got
    blocks = _blocks(x, MXFP4).to(torch.float32)
    amax = blocks.abs().amax(dim=-1)
    if rounding == "rceil":
        e = e8m0_rceil(amax / E2M1_MAX)
    elif rounding == "floor":
        e = e8m0_floor(amax, 2)  # emax of E2M1: 6 = 1.5 * 2**2
    else:
        raise ValueError(f"rounding must be 'rceil' or 'floor', got {rounding!r}")
    scaled = blocks / e8m0_to_float(e).unsqueeze(-1)  # a power of two: exact
    codes = e2m1_codes(scaled).reshape(x.shape)
    return FP4Components(MXFP4, pack_e2m1(codes), e.to(torch.uint8))  # amax is finite: E <= 254


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` as a float32 0-d tensor, without the copy ``abs()`` makes (``max(-min, max)``:
    exact; NaN propagates); 0 for an empty tensor."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(-lo, hi).float()


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale of ``x``: ``amax / (6 * 448)`` in float32 (ModelOpt's ``weight_scale_2``);
    1.0 for an all-zero tensor."""
    if x.numel() == 0:
        return torch.tensor(1.0)
    g = abs_max(x) / (E2M1_MAX * E4M3_MAX)
    return torch.where(g == 0, torch.ones_like(g), g)


def _check_global_scale(g) -> torch.Tensor:
    t = torch.as_tensor(g, dtype=torch.float32) if not isinstance(g, torch.Tensor) else g.to(torch.float32)
    if t.numel() != 1 or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise ValueError(f"nvfp4: global_scale must be one finite value above 0, got {g!r}")
    return t.reshape(())


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> FP4Components:
    """NVFP4 of ``x`` along its last dimension (a multiple of 16), ModelOpt's rule (module doc);
    ``global_scale`` defaults to :func:`nvfp4_global_scale` of ``x`` (pass one, a float or a one-element
    tensor, to share it, e.g. across the fused parts of a layer: it must be at least ``amax(x) / (6 * 448)``,
    or the largest values saturate)."""
    _check(x, NVFP4)
    g = nvfp4_global_scale(x) if global_scale is None else _check_global_scale(global_scale)
    if bool(torch.isfinite(g)) and (got := _native(x, NVFP4, None, g)) is not None:
        return got
    blocks = _blocks(x, NVFP4)
    block_scale = blocks.abs().amax(dim=-1).float() / (E2M1_MAX * g)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    scale = block_scale.clamp(min=_NVFP4_SCALE_MIN, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (scale.to(torch.float32) * g).unsqueeze(-1)
    codes = e2m1_codes(scaled).reshape(x.shape)
    return FP4Components(NVFP4, pack_e2m1(codes), scale, g)


def _native(x: torch.Tensor, fmt: FP4Format, rounding: str | None, g: torch.Tensor | None = None
            ) -> FP4Components | None:
    """The native kernel's components of ``x`` (checked finite, whole blocks), or None where it does not run
    (:data:`NATIVE` off, not on the CPU, the library unavailable)."""
    from . import native
    from .quantize import NATIVE_PATH

    lib = NATIVE_PATH.lib_for(x) if NATIVE and x.numel() else None
    if lib is None:
        return None
    k = x.shape[-1]
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    scale_dtype = torch.float8_e4m3fn if fmt.scale_codec == "e4m3" else torch.uint8
    q, s = native.fp4_rows(lib, x2, fmt.name, rounding, float(g) if g is not None else 1.0, scale_dtype)
    lead = x.shape[:-1]
    return FP4Components(fmt, q.reshape(*lead, k // 2), s.reshape(*lead, k // fmt.block), g)


def quantize_fp4(x: torch.Tensor, fmt: FP4Format | str, **kwargs) -> FP4Components:
    """:func:`quantize_mxfp4` or :func:`quantize_nvfp4` by the format's record or name."""
    fmt = FORMATS.get(fmt, fmt) if isinstance(fmt, str) else fmt
    if fmt is MXFP4:
        return quantize_mxfp4(x, **kwargs)
    if fmt is NVFP4:
        return quantize_nvfp4(x, **kwargs)
    raise ValueError(f"unknown 4-bit format {fmt!r}; known: {sorted(FORMATS)}")
