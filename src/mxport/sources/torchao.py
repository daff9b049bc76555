"""torchao ``MXTensor`` -> :class:`~mxport.MXFP8Components`, duck-typed (torchao is not imported).

torchao 0.18 ``torchao/prototype/mx_formats/mx_tensor.py`` (``MXTensor.__new__``, ``to_mx``, ``dequantize``)
and ``utils.py`` (``to_blocked`` / ``from_blocked``):

- ``qdata``: the FP8 elements (``elem_dtype``), logical shape ``(*lead, K)``; blocks of ``block_size`` run
  along the last dimension of the tensor it was quantized from.
- ``scale``: ``float8_e8m0fnu``, ``(*lead, K // block_size)``; with ``is_swizzled_scales`` it holds
  ``to_blocked`` (cuBLAS 128x4 tiles) of the flattened ``(prod(lead), K // block_size)`` grid.
- A transposed ``MXTensor`` (``qdata.stride(-2) < qdata.stride(-1)``, e.g. after ``.t()``) carries transposed
  views of both: its blocks run along dimension -2, i.e. TE's columnwise direction.
"""

from __future__ import annotations

import torch

from ..components import MXFP8Components, check_direction
from ..formats import BLOCK_SIZE, is_fp8_dtype, numel_of
from . import compact_from_swizzled, scale_bytes, values_view

_ATTRS = ("qdata", "scale", "elem_dtype", "block_size")


def is_torchao_mx(obj) -> bool:
    """True for objects shaped like a torchao ``MXTensor``.

    That is, with ``qdata``, ``scale``, ``elem_dtype`` and ``block_size``."""
    return all(hasattr(obj, a) for a in _ATTRS)


def _is_transposed(q: torch.Tensor) -> bool:
    # the same test torchao's MXTensor.dequantize uses
    return q.dim() >= 2 and q.stride(-2) < q.stride(-1)


def export_torchao(obj, direction: str = "rowwise") -> MXFP8Components:
    """Export a torchao ``MXTensor`` with FP8 elements.

    The direction is the tensor's own: ``"rowwise"`` for an ordinary ``MXTensor`` (blocks along the last dim),
    ``"columnwise"`` for a transposed one (blocks along dim -2; compact scales ``(prod(lead)*K_t/32, N)``).

    Returns:
        :class:`MXFP8Components`: ``data`` is ``obj.qdata`` itself (same storage; a transposed tensor keeps
        its non-contiguous strides); ``scale_inv`` is ``obj.scale`` bit-viewed as uint8 (a view) for an
        ordinary unswizzled tensor, and a contiguous copy when the scales are swizzled (one permute) or
        transposed.

    Raises:
        ValueError: ``direction`` is not the tensor's direction; ``block_size`` != 32; a scale tensor whose
            shape / byte count does not match the data.
        TypeError: ``elem_dtype`` is not FP8 (MXFP4 / MXFP6 are not MXFP8); scales not ``float8_e8m0fnu`` /
            uint8.
    """
    check_direction(direction)
    if obj.block_size != BLOCK_SIZE:
        raise ValueError(f"MXTensor.block_size must be {BLOCK_SIZE} for MXFP8, got {obj.block_size!r}")
    elem = obj.elem_dtype
    if not (isinstance(elem, torch.dtype) and is_fp8_dtype(elem)):
        raise TypeError(
            f"MXTensor.elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 for MXFP8, got {elem!r}"
        )
    values = values_view(obj.qdata, elem, argname="MXTensor.qdata")
    if values.dim() == 0:
        raise ValueError("MXTensor.qdata must have at least one dimension, got a 0-d tensor")
    scale = scale_bytes(obj.scale, argname="MXTensor.scale")
    swizzled = bool(getattr(obj, "is_swizzled_scales", False))
    transposed = _is_transposed(values)
    own = "columnwise" if transposed else "rowwise"
    if direction != own:
        raise ValueError(
            f"this MXTensor holds {own} data only (blocks along dim {-2 if transposed else -1}); "
            f"direction={direction!r} is not available"
        )
    shape = tuple(values.shape)
    if not transposed:
        k = shape[-1]
        nb = -(-k // BLOCK_SIZE)
        if swizzled:
            compact = compact_from_swizzled(scale, numel_of(shape[:-1]), nb, argname="MXTensor.scale")
            return MXFP8Components(values, compact.reshape(*shape[:-1], nb), "rowwise")
        expected = (*shape[:-1], nb)
        if tuple(scale.shape) != expected:
            raise ValueError(f"MXTensor.scale has shape {tuple(scale.shape)}, data {shape} needs {expected}")
        return MXFP8Components(values, scale if scale.is_contiguous() else scale.contiguous(), "rowwise")

    # transposed: logical (*lead, Kt, N); the untransposed original is (*lead, N, Kt), blocks along Kt
    lead, kt, n = shape[:-2], shape[-2], shape[-1]
    if kt % BLOCK_SIZE and lead:
        raise ValueError(f"transposed MXTensor with leading dims needs dim -2 ({kt}) "
                         f"divisible by {BLOCK_SIZE}")
    nb = -(-kt // BLOCK_SIZE)
    if swizzled:
        orig = scale.transpose(-2, -1) if scale.dim() >= 2 else scale
        rows = compact_from_swizzled(orig, numel_of(lead) * n, nb, argname="MXTensor.scale")  # (P*N, nb)
        col = rows.reshape(*lead, n, nb).transpose(-2, -1)
    else:
        expected = (*lead, nb, n)
        if tuple(scale.shape) != expected:
            raise ValueError(f"MXTensor.scale has shape {tuple(scale.shape)}, "
                             f"transposed data {shape} needs {expected}")
        col = scale
    return MXFP8Components(values, col.reshape(-1, n).contiguous(), "columnwise")
