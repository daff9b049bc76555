"""Producers -> :class:`~mxport.MXFP8Components`: one module per training framework, all duck-typed.

- :mod:`mxport.sources.te`: Transformer Engine ``MXFP8Tensor`` / ``MXFP8TensorStorage`` (and the way back,
  :func:`mxport.sources.te.to_te_layout`).
- :mod:`mxport.sources.torchao`: torchao ``MXTensor``.
- :mod:`mxport.sources.megatron`: Megatron-LM inference ``MXFP8Tensor``.
- :mod:`mxport.sources.grouped`: TE grouped (MoE) storage (``GroupedTensorStorage``, and ``GroupedTensor``, a
  ``torch.Tensor`` wrapper subclass, also as the ``nn.Parameter`` of ``GroupedLinear(single_grouped_weight)``)
  and 3-D ``[E, N, K]`` expert weights.
- :mod:`mxport.sources.dtensor`: each rank's MXFP8 bytes of a DTensor (FSDP2 / tensor parallel).
- :mod:`mxport.sources.discover`: :func:`native_tensors`, every native MXFP8 producer of an ``nn.Module``
  (parameters, persistent buffers, and plain attributes such as Megatron's ``MXFP8Tensor`` after
  ``quantize_params_to_mxfp8``) by name, in canonical order.

:func:`mxport.export_components` / :func:`mxport.export_grouped_components` (in :mod:`mxport.export`) pick the
right module. This package holds the few helpers they share: the producer's bytes -> FP8 values view, TE's FP8
dtype codes, and padded / swizzled scale grids -> compact scales. None of these modules imports the framework.
"""

from __future__ import annotations

import operator

import torch

from ..formats import FLOAT8_E8M0FNU, as_e8m0_bytes, is_fp8_dtype
from ..layouts import unpad, unswizzle

#: Transformer Engine ``transformer_engine_torch.DType`` codes (``transformer_engine/common/include/
#: transformer_engine/transformer_engine.h``: kFloat8E4M3 = 7, kFloat8E5M2 = 8).
TE_DTYPE_CODES = {7: torch.float8_e4m3fn, 8: torch.float8_e5m2}
_TE_DTYPE_NAMES = {"kfloat8e4m3": torch.float8_e4m3fn, "kfloat8e5m2": torch.float8_e5m2}


def resolve_fp8_dtype(value, *, argname: str = "_fp8_dtype") -> torch.dtype:
    """The torch FP8 dtype named by ``value``.

    Accepts ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, TE's ``DType`` enum (by ``.value`` or ``int()``:
    kFloat8E4M3 = 7, kFloat8E5M2 = 8, or its name ``"kFloat8E4M3"``), or the plain ints 7 / 8.

    Raises:
        TypeError: anything else (e.g. TE kFloat4E2M1, a float dtype), naming ``argname``.
    """
    if isinstance(value, torch.dtype):
        if is_fp8_dtype(value):
            return value
    else:
        code = getattr(value, "value", value)
        if isinstance(code, int) and not isinstance(code, bool) and code in TE_DTYPE_CODES:
            return TE_DTYPE_CODES[code]
        try:  # integer-like only (numpy ints, IntEnum): never truncate a float or parse a string
            as_int = operator.index(value)
        except TypeError:
            as_int = None
        if as_int in TE_DTYPE_CODES and not isinstance(value, bool):
            return TE_DTYPE_CODES[as_int]
        name = str(getattr(value, "name", value)).rsplit(".", 1)[-1].lower()
        if name in _TE_DTYPE_NAMES:
            return _TE_DTYPE_NAMES[name]
    raise TypeError(
        f"{argname} must name an MXFP8 element type: torch.float8_e4m3fn / torch.float8_e5m2 or TE DType "
        f"kFloat8E4M3 (7) / kFloat8E5M2 (8), got {value!r}"
    )


def values_view(data, fp8_dtype: torch.dtype, *, argname: str) -> torch.Tensor:
    """The producer's value bytes as an FP8 tensor of the same shape: a ``.view`` (same storage, same
    ``data_ptr``), never a copy or a value cast.

    ``data`` is ``torch.uint8`` (TE keeps FP8 bytes as uint8) or already ``fp8_dtype``.

    Raises:
        TypeError: ``data`` is not a tensor, has another dtype, or is FP8 of the other format.
    """
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor of uint8 FP8 bytes, got {type(data).__name__}")
    if data.dtype == torch.uint8:
        return data.view(fp8_dtype)
    if data.dtype == fp8_dtype:
        return data
    raise TypeError(
        f"{argname} must hold FP8 bytes as torch.uint8 (or {fp8_dtype} itself), got {data.dtype}"
        + (" (element type disagrees with the declared FP8 dtype)" if is_fp8_dtype(data.dtype) else "")
    )


def scale_bytes(scale, *, argname: str) -> torch.Tensor:
    """E8M0 scale bytes as uint8: uint8 as is, ``float8_e8m0fnu`` bit-viewed (never value-cast).

    Raises TypeError for a missing tensor or any other dtype (e.g. float32 scales of TE's Float8Blockwise).
    """
    if scale is None:
        raise ValueError(f"{argname} is missing (None): the producer holds no scales for this direction")
    if isinstance(scale, torch.Tensor) and scale.dtype not in (torch.uint8, FLOAT8_E8M0FNU):
        raise TypeError(
            f"{argname} must hold E8M0 scale bytes as torch.uint8 or torch.float8_e8m0fnu, got {scale.dtype} "
            "(not an MXFP8 tensor?)"
        )
    return as_e8m0_bytes(scale, argname=argname)


def compact_from_grid(grid: torch.Tensor, rows: int, cols: int, *, padded: tuple[int, int] | None = None,
                      argname: str) -> torch.Tensor:
    """The compact ``(rows, cols)`` corner of a 2-D (padded) scale grid, contiguous.

    A view when only rows are cropped (or nothing is); a copy when columns are cropped, since a view cropping
    the last dimension would not be contiguous (consumers such as safetensors need contiguous scales). Padding
    bytes are never read (TE leaves them uninitialized). With ``padded`` given, the grid must be exactly that
    padded shape or the compact ``(rows, cols)`` itself: a larger grid is some other tensor's scales.

    Raises:
        ValueError: ``grid`` is not 2-D, smaller than ``(rows, cols)``, or (with ``padded``) of another shape.
    """
    if grid.dim() != 2:
        raise ValueError(f"{argname} must be a 2-D scale grid, got shape {tuple(grid.shape)}")
    if grid.shape[0] < rows or grid.shape[1] < cols:
        raise ValueError(
            f"{argname} of shape {tuple(grid.shape)} is too small for the data: "
            f"needs at least ({rows}, {cols}) scales"
        )
    if padded is not None and tuple(grid.shape) not in (tuple(padded), (rows, cols)):
        raise ValueError(
            f"{argname} of shape {tuple(grid.shape)} does not match the data: "
            f"expected TE's padded {tuple(padded)} (or the compact ({rows}, {cols})) scale grid"
        )
    out = unpad(grid, rows, cols)
    return out if out.is_contiguous() else out.contiguous()


def compact_from_swizzled(swizzled: torch.Tensor, rows: int, cols: int, *, argname: str) -> torch.Tensor:
    """Compact ``(rows, cols)`` scales from cuBLAS 128x4-swizzled bytes (any shape holding exactly
    ``roundup(rows,128) * roundup(cols,4)`` bytes): one permute + copy via :func:`mxport.layouts.unswizzle`.

    Raises:
        ValueError: the byte count does not match (a grid too small or too large for the data), naming
            ``argname``.
    """
    try:
        return unswizzle(swizzled, rows, cols)
    except ValueError as exc:
        raise ValueError(f"{argname}: {exc}") from None


__all__ = [
    "TE_DTYPE_CODES",
    "compact_from_grid",
    "compact_from_swizzled",
    "resolve_fp8_dtype",
    "scale_bytes",
    "values_view",
]

# discover imports the helpers above (through te / grouped): imported last
from .discover import is_mxfp8_producer, native_attributes, native_tensors  # noqa: E402

__all__ += ["is_mxfp8_producer", "native_attributes", "native_tensors"]
