"""The weight formats the pipeline writes (``--quant mxfp8|mxfp4|nvfp4``): one :class:`Quant` record each.

A record says everything export and refit need to know about a format: the bytes of the values (FP8, one
element a byte; E2M1, two a byte), the block along the last dimension, the scale's dtype and whether one
float32 global scale per tensor multiplies the block scales (NVFP4). :meth:`Quant.quantize` is the one
entry to the codecs: :func:`mxport.quantize` for MXFP8, :mod:`mxport.fp4` for the 4-bit formats. Adding a
format is one record here plus its codec.

Whole-row pieces of a tensor quantize to the bytes of the whole tensor (blocks never cross rows; NVFP4 given
the tensor's global scale), which is what lets export stream a tensor in row chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import fp4
from .quantize import quantize as quantize_mxfp8

__all__ = ["QUANTS", "Quant", "Quantized", "get_quant"]


@dataclass(frozen=True)
class Quantized:
    """One quantized tensor (or whole-row piece): ``values`` (FP8, or uint8 with two E2M1 codes a byte),
    ``scale`` (one per block: uint8 E8M0 bytes, or ``float8_e4m3fn`` for NVFP4) and ``global_scale`` (a
    float32 0-d tensor for NVFP4, else None)."""

    values: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Quant:
    """One weight format: ``block`` elements per scale along the last dimension, ``per_byte`` elements a
    value byte, the scale's dtype, whether a per-tensor float32 global scale exists, and the 4-bit codec's
    record (None for MXFP8)."""

    name: str
    block: int
    per_byte: int
    scale_dtype: torch.dtype
    global_scale: bool
    fp4_format: fp4.FP4Format | None = None

    def values_dtype(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.dtype:
        return fp8_dtype if self.per_byte == 1 else torch.uint8

    def values_shape(self, shape) -> tuple[int, ...]:
        shape = tuple(int(s) for s in shape)
        return (*shape[:-1], shape[-1] // self.per_byte)

    def scale_shape(self, shape) -> tuple[int, ...]:
        shape = tuple(int(s) for s in shape)
        return (*shape[:-1], math.ceil(shape[-1] / self.block))

    def aligned(self, k: int) -> bool:
        """Whether a last dimension ``k`` is whole blocks (what every engine's kernels take)."""
        return k > 0 and k % self.block == 0

    def global_scale_of(self, amax: torch.Tensor | float) -> torch.Tensor | None:
        """The tensor's global scale from the largest magnitude of the tensors that share it (NVFP4:
        ``amax / (6 * 448)`` in float32, 1.0 for 0; ModelOpt's ``weight_scale_2``); None for formats
        without one."""
        if not self.global_scale:
            return None
        return fp4.nvfp4_global_scale(torch.as_tensor(amax, dtype=torch.float32).reshape(1))

    def global_divisor_of(self, amax: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
        """NVFP4 as compressed-tensors stores it: the divisor ``d = (6 * 448) / amax`` first (float32; the
        largest float32 where that overflows, an amax below about 7.9e-36; 1.0 for amax 0), then ``g = 1 / d``
        (float32), so that vLLM's ``1 / d`` at load is ``g`` exactly. Returns ``(g, d)``, 0-d."""
        a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
        d = torch.tensor(fp4.E2M1_MAX * fp4.E4M3_MAX, dtype=torch.float32) / a
        d = torch.where(a == 0, torch.ones_like(d), d.clamp(max=torch.finfo(torch.float32).max))
        return 1.0 / d, d

    def quantize(self, x: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 nonzero_scales: bool = False, global_scale: torch.Tensor | None = None) -> Quantized:
        """``x`` (whole rows) in this format; NVFP4 with ``global_scale`` (the whole tensor's, shared by its
        group), or its own when None."""
        if self.fp4_format is None:
            c = quantize_mxfp8(x, fp8_dtype, nonzero_scales=nonzero_scales)
            return Quantized(c.data, c.scale_inv)
        if nonzero_scales:
            raise ValueError(f"nonzero_scales applies to MXFP8's E8M0 bytes, not to {self.name}")
        kwargs = {"global_scale": global_scale} if self.global_scale else {}
        c = fp4.quantize_fp4(x, self.fp4_format, **kwargs)
        return Quantized(c.data, c.scale, c.global_scale)


MXFP8 = Quant("mxfp8", 32, 1, torch.uint8, False)
MXFP4 = Quant("mxfp4", 32, 2, torch.uint8, False, fp4.MXFP4)
NVFP4 = Quant("nvfp4", 16, 2, torch.float8_e4m3fn, True, fp4.NVFP4)
QUANTS = {q.name: q for q in (MXFP8, MXFP4, NVFP4)}


def get_quant(quant: Quant | str) -> Quant:
    """The record of ``quant`` (a record or its name); ValueError naming the known ones."""
    if isinstance(quant, Quant):
        return quant
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {list(QUANTS)}, got {quant!r}")
    return QUANTS[quant]
