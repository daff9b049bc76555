"""Megatron-LM inference ``MXFP8Tensor`` -> :class:`~mxport.MXFP8Components`, duck-typed.

Megatron-LM ``megatron/core/inference/quantization/mxfp8_tensor.py`` (``MXFP8Tensor`` dataclass,
``validate_mxfp8_tensor``, ``scale_2d``):

- ``data``: ``[M, K]`` ``float8_e4m3fn`` (rowwise blocks along K).
- ``scale``: E8M0 bytes in the cuBLAS 128x4 swizzled layout, 1-D (as FlashInfer / the Triton kernel return it)
  or 2-D ``(roundup(M,128), roundup(K/32,4))`` (``scale_2d()``); ``uint8`` for the ``"flashinfer"`` backend,
  ``float8_e8m0fnu`` for ``"triton"`` (same bytes either way).
- ``backend``: ``"flashinfer"`` | ``"triton"`` | ``None`` (older versions have no such field).
"""

from __future__ import annotations

import torch

from ..components import MXFP8Components, check_direction
from ..formats import BLOCK_SIZE, ceil_div
from ..layouts import swizzled_shape
from . import compact_from_swizzled, scale_bytes, values_view

BACKENDS = ("flashinfer", "triton", None)


def is_megatron_mxfp8(obj) -> bool:
    """True for a non-tensor object with tensor ``data`` and ``scale`` attributes (Megatron's dataclass)."""
    return (
        not isinstance(obj, torch.Tensor)
        and isinstance(getattr(obj, "data", None), torch.Tensor)
        and isinstance(getattr(obj, "scale", None), torch.Tensor)
    )


def export_megatron(obj, direction: str = "rowwise") -> MXFP8Components:
    """Export a Megatron-LM inference ``MXFP8Tensor``: rowwise only.

    Returns:
        :class:`MXFP8Components`: ``data`` is ``obj.data`` (uint8 data is viewed as ``float8_e4m3fn``, the
        only element type Megatron uses; same storage), ``scale_inv`` a compact ``(M, ceil(K/32))`` copy
        unswizzled with one permute (:func:`mxport.layouts.unswizzle`).

    Raises:
        ValueError: ``direction="columnwise"`` (Megatron keeps rowwise data only); data not 2-D; a 2-D scale
            not of the swizzled shape or a scale of the wrong byte count; an unknown ``backend``.
        TypeError: data not FP8 / uint8; scales not uint8 / ``float8_e8m0fnu`` (bit-viewed, never value-cast).
    """
    check_direction(direction)
    if direction != "rowwise":
        raise ValueError("a Megatron MXFP8Tensor holds rowwise data only; "
                         "direction='columnwise' is not available")
    backend = getattr(obj, "backend", None)
    if backend not in BACKENDS:
        raise ValueError(f"MXFP8Tensor.backend must be 'flashinfer', 'triton' or None, got {backend!r}")
    data = obj.data
    fp8 = data.dtype if data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else torch.float8_e4m3fn
    values = values_view(data, fp8, argname="MXFP8Tensor.data")
    if values.dim() != 2:
        raise ValueError(f"MXFP8Tensor.data must be 2-D [M, K], got shape {tuple(values.shape)}")
    m, k = values.shape
    nb = ceil_div(k, BLOCK_SIZE)
    scale = scale_bytes(obj.scale, argname="MXFP8Tensor.scale")
    if scale.dim() == 2 and tuple(scale.shape) != swizzled_shape(m, nb):
        raise ValueError(
            f"MXFP8Tensor.scale is 2-D {tuple(scale.shape)}; Megatron's swizzled grid for data ({m}, {k}) is "
            f"{swizzled_shape(m, nb)}"
        )
    if scale.dim() > 2:
        raise ValueError(f"MXFP8Tensor.scale must be 1-D or 2-D swizzled bytes, "
                         f"got shape {tuple(scale.shape)}")
    compact = compact_from_swizzled(scale, m, nb, argname="MXFP8Tensor.scale")
    return MXFP8Components(values, compact, "rowwise")
