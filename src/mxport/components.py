"""MXFP8Components: FP8 element values + compact E8M0 shared scales, the export contract (docs/format.md)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from .formats import (
    BLOCK_SIZE,
    FLOAT_DTYPES,
    allocating,
    as_e8m0_bytes,
    ceil_div,
    describe,
    e8m0_to_float,
    element_format,
    is_fp8_dtype,
    numel_of,
)

DIRECTIONS = ("rowwise", "columnwise")
#: output dtypes of dequantize (an FP8 / E8M0 output would silently re-round the decoded values)
DEQUANTIZE_DTYPES = FLOAT_DTYPES


def check_direction(direction: str, *, argname: str = "direction") -> str:
    """Validate a TE direction name; raises ValueError for anything but "rowwise" / "columnwise"."""
    if direction not in DIRECTIONS:
        raise ValueError(f"{argname} must be 'rowwise' or 'columnwise', got {describe(direction)}")
    return direction


def check_block_size(block_size: int, *, argname: str = "block_size") -> int:
    """MXFP8 blocks hold 32 elements (OCP MX v1.0 §5.2). Returns it as a Python int.

    Raises TypeError for a non-integer (floats are not truncated), ValueError for any other size.
    """
    if isinstance(block_size, bool):
        raise TypeError(f"{argname} must be an integer, got {describe(block_size)}")
    try:
        value = operator.index(block_size)
    except TypeError:
        raise TypeError(f"{argname} must be an integer, got {describe(block_size)}") from None
    if value != BLOCK_SIZE:
        raise ValueError(f"{argname} must be {BLOCK_SIZE} for MXFP8, got {describe(block_size)}")
    return value


def compact_scale_shape(shape: tuple[int, ...] | torch.Size, direction: str = "rowwise") -> tuple[int, ...]:
    """The compact E8M0 scale shape for a tensor of logical ``shape`` (docs/format.md, "Scale layouts").

    rowwise: ``(*shape[:-1], ceil(K/32))``; columnwise: ``(ceil(M/32), K)`` with ``M = prod(shape[:-1])``.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise ValueError("shape must have at least one dimension (MX blocks run along a dimension)")
    k = shape[-1]
    if check_direction(direction) == "rowwise":
        return (*shape[:-1], ceil_div(k, BLOCK_SIZE))
    return (ceil_div(numel_of(shape[:-1]), BLOCK_SIZE), k)


@dataclass(frozen=True, repr=False)
class MXFP8Components:
    """One MXFP8 tensor as its parts: FP8 values, compact E8M0 scale bytes and the direction of the blocks.

    Attributes:
        data: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, the tensor's logical shape ``(*lead, K)``.
        scale_inv: ``torch.uint8`` E8M0 bytes (value 2**(E-127); 255 is NaN), compact (no padding, no
            swizzle): rowwise ``(*lead, ceil(K/32))``; columnwise ``(ceil(M/32), K)`` with ``M = prod(lead)``.
            A ``float8_e8m0fnu`` tensor is accepted and bit-viewed as uint8.
        direction: ``"rowwise"`` (blocks of 32 along K) or ``"columnwise"`` (blocks of 32 along M).
        block_size: 32.

    A short last block (K or M not a multiple of 32) has its own scale. Decoding is
    ``x = float(q) * 2**(E-127)`` in float32 (OCP MX v1.0 §6.2).

    Raises:
        TypeError: ``data`` not an FP8 tensor, ``scale_inv`` not uint8 / float8_e8m0fnu.
        ValueError: a 0-d ``data``, a scale shape that does not match the data, an unknown direction, a block
            size other than 32, data and scales on different devices.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    direction: str = "rowwise"
    block_size: int = BLOCK_SIZE

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor):
            raise TypeError(f"data must be a torch.Tensor of FP8 values, got {type(self.data).__name__}")
        if not is_fp8_dtype(self.data.dtype):
            raise TypeError(f"data must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.data.dtype}")
        if self.data.dim() == 0:
            raise ValueError("data must have at least one dimension, got a 0-d tensor")
        object.__setattr__(self, "scale_inv", as_e8m0_bytes(self.scale_inv, argname="scale_inv"))
        check_direction(self.direction)
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        expected = compact_scale_shape(self.data.shape, self.direction)
        if tuple(self.scale_inv.shape) != expected:
            raise ValueError(
                f"scale_inv shape {tuple(self.scale_inv.shape)} does not match {self.direction} data "
                f"of shape {tuple(self.data.shape)}: expected compact {expected}"
            )
        if self.scale_inv.device != self.data.device:
            raise ValueError(f"scale_inv is on {self.scale_inv.device} but data is on {self.data.device}")

    def __repr__(self) -> str:
        """Shape, element, direction and device.

        Never the values: a huge or meta tensor cannot be printed.
        """
        return (f"MXFP8Components(shape={tuple(self.shape)}, element={self.element!r}, "
                f"direction={self.direction!r}, scale_shape={tuple(self.scale_inv.shape)}, "
                f"device={str(self.device)!r})")

    # -- descriptive properties ------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        """The tensor's logical shape."""
        return self.data.shape

    @property
    def fp8_dtype(self) -> torch.dtype:
        """``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
        return self.data.dtype

    @property
    def element(self) -> str:
        """"e4m3" or "e5m2"."""
        return element_format(self.data.dtype).name

    @property
    def nbytes(self) -> int:
        """Bytes of values plus scales (1 byte each)."""
        return self.data.numel() + self.scale_inv.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def metadata(self) -> dict[str, Any]:
        """A JSON-able description: what a reader needs to decode ``data`` and ``scale_inv``."""
        return {
            "format": "mxfp8",
            "element": self.element,
            "block_size": self.block_size,
            "direction": self.direction,
            "shape": list(self.shape),
            "scale_shape": list(self.scale_inv.shape),
            "scale_encoding": "e8m0",
            "scale_dtype": "uint8",
            "scale_layout": "compact",
        }

    def scale_as_float(self) -> torch.Tensor:
        """float32 2**(E-127) with the compact scale shape."""
        return e8m0_to_float(self.scale_inv)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode to ``dtype`` with the logical shape: ``float(q) * 2**(E-127)`` in float32, then cast."""
        return dequantize(self, dtype)


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...] | torch.Size, direction: str) -> torch.Tensor:
    """Broadcast a compact per-block tensor to one entry per element, as a 2-D ``(M, K)`` tensor.

    ``scale`` is compact in ``direction`` for a tensor of logical ``shape``; works for any dtype.
    """
    k = int(shape[-1])
    m = numel_of(shape[:-1])
    if direction == "rowwise":
        s2 = scale.reshape(m, ceil_div(k, BLOCK_SIZE))
        return s2.repeat_interleave(BLOCK_SIZE, dim=1)[:, :k]
    return scale.repeat_interleave(BLOCK_SIZE, dim=0)[:m, :]


def dequantize(components: MXFP8Components, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode MXFP8 components: ``x = float32(q) * 2**(E-127)``, computed in float32, then cast to ``dtype``.

    Returns a tensor of ``components.shape`` on the components' device. E = 255 decodes to NaN for its block.

    Raises:
        TypeError: ``components`` is not an :class:`MXFP8Components`, or ``dtype`` is not float32 / bfloat16 /
            float16 / float64.
    """
    if not isinstance(components, MXFP8Components):
        raise TypeError(f"components must be an MXFP8Components, got {type(components).__name__}")
    if not isinstance(dtype, torch.dtype) or dtype not in DEQUANTIZE_DTYPES:
        raise TypeError(f"dtype must be torch.float32, bfloat16, float16 or float64, got {describe(dtype)}")
    shape = components.shape
    with allocating("components", components.data):
        scale = expand_scale(e8m0_to_float(components.scale_inv), shape, components.direction)
        q = components.data.reshape(scale.shape).to(torch.float32)
        return (q * scale).reshape(shape).to(dtype)
