"""Transformer Engine MXFP8 storage <-> :class:`~mxport.MXFP8Components`, duck-typed (TE need not be
installed).

TE's layout (``transformer_engine/pytorch/tensor/storage/mxfp8_tensor_storage.py``, ``MXFP8Quantizer.
get_scale_shape``; summarized in docs/format.md, "Scale layouts: compact, padded, swizzled"), for data of
logical shape ``(*lead, K)`` and ``M = prod(lead)``:

- ``_rowwise_data`` / ``_columnwise_data``: ``torch.uint8`` FP8 bytes with the logical shape (columnwise data
  is not transposed); either may be ``None`` when that usage is off.
- ``_rowwise_scale_inv``: uint8 ``(roundup(M,128), roundup(ceil(K/32),4))``; ``_columnwise_scale_inv``: uint8
  ``(roundup(ceil(M/32),4), roundup(K,128))``. Padding bytes are uninitialized.
- ``_with_gemm_swizzled_scales`` (TE ``optimize_for_gemm``): the same bytes in cuBLAS 128x4-tile swizzled
  order with zero padding; columnwise scales are swizzled as their transpose.
- ``_fp8_dtype``: TE ``DType`` (kFloat8E4M3 = 7, kFloat8E5M2 = 8).

TE's shape rule (``MXFP8Quantizer::get_scale_shape`` in ``pytorch/csrc/quantizer.cpp``: "MXFP8 requires
tensor dims that are divisible by 32"; ``MXFP8Quantizer.is_quantizable`` in
``pytorch/tensor/mxfp8_tensor.py``): K and M must both be multiples of 32 (so the data is at least 2-D); TE
sizes its grids with ``K // 32`` / ``M // 32``. mxport's helpers refuse any other shape
(:func:`check_te_shape`) instead of guessing a grid TE never makes.
"""

from __future__ import annotations

import torch

from ..components import MXFP8Components, check_direction
from ..formats import BLOCK_SIZE, ceil_div, numel_of
from ..layouts import pad, padded_shape, swizzle
from . import compact_from_grid, compact_from_swizzled, resolve_fp8_dtype, scale_bytes, values_view

_TE_ATTRS = ("_rowwise_data", "_columnwise_data", "_rowwise_scale_inv", "_columnwise_scale_inv", "_fp8_dtype")


def is_te_mxfp8(obj) -> bool:
    """True for objects shaped like a TE ``MXFP8Tensor`` / ``MXFP8TensorStorage`` (all of ``_rowwise_data``,
    ``_columnwise_data``, ``_rowwise_scale_inv``, ``_columnwise_scale_inv``, ``_fp8_dtype``)."""
    return all(hasattr(obj, a) for a in _TE_ATTRS)


def check_te_shape(shape, argname: str = "data", direction: str | None = None) -> None:
    """Raise ValueError unless TE can hold MXFP8 data of logical ``shape``: ``K = shape[-1]`` and
    ``M = prod(shape[:-1])`` both multiples of 32 (TE ``MXFP8Quantizer::get_scale_shape``; see the module
    docstring). With ``direction`` (a member of a grouped storage, whose grids TE sizes with the Python
    ``get_scale_shape``'s floor divisions and no check), only the dimension its blocks run along: K rowwise,
    M columnwise."""
    shape = tuple(int(s) for s in shape)
    k = shape[-1] if shape else 1
    m = numel_of(shape[:-1])
    where = f"{argname} of shape {shape} (M={m}, K={k}) is not a TE MXFP8 shape"
    if direction is not None:
        dim, n = ("K", k) if direction == "rowwise" else ("M", m)
        if n % BLOCK_SIZE:
            raise ValueError(f"{where}: TE sizes a grouped member's {direction} grid with {dim} // "
                             f"{BLOCK_SIZE} (MXFP8Quantizer.get_scale_shape), so {dim} must be a multiple of "
                             f"{BLOCK_SIZE}")
    elif k % BLOCK_SIZE or m % BLOCK_SIZE:
        raise ValueError(f"{where}: TE requires M = prod(shape[:-1]) and K = shape[-1] to be multiples of "
                         f"{BLOCK_SIZE} (MXFP8Quantizer::get_scale_shape: 'MXFP8 requires tensor dims that "
                         "are divisible by 32')")


def scale_grid_dims(shape, direction: str) -> tuple[int, int]:
    """The compact 2-D scale grid ``(rows, cols)`` for data of logical ``shape``: rowwise ``(M, ceil(K/32))``,
    columnwise ``(ceil(M/32), K)``, with ``M = prod(shape[:-1])`` (leading dims flattened, as TE does)."""
    k = int(shape[-1])
    m = numel_of(shape[:-1])
    if direction == "rowwise":
        return m, ceil_div(k, BLOCK_SIZE)
    return ceil_div(m, BLOCK_SIZE), k


def components_from_te_parts(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype,
    direction: str,
    *,
    swizzled: bool = False,
    names: tuple[str, str] = ("data", "scale_inv"),
    grouped: bool = False,
) -> MXFP8Components:
    """One direction of a TE MXFP8 storage -> components (see :func:`export_te`, which documents the layout).

    ``data``: uint8 (or FP8) ``(*lead, K)``; ``scale_inv``: uint8 / ``float8_e8m0fnu``, TE-padded 2-D (a 1-D
    buffer holding exactly the padded grid's bytes is accepted too), or swizzled bytes when ``swizzled``.
    ``grouped``: a member of a grouped storage (TE's shape rule for those: :func:`check_te_shape`).
    """
    check_direction(direction)
    dname, sname = names
    if data is None:
        raise ValueError(f"{dname} is missing (None): the producer holds no {direction} data")
    dtype = resolve_fp8_dtype(fp8_dtype)
    values = values_view(data, dtype, argname=dname)
    if values.dim() == 0:
        raise ValueError(f"{dname} must have at least one dimension, got a 0-d tensor")
    check_te_shape(values.shape, dname, direction if grouped else None)
    scale = scale_bytes(scale_inv, argname=sname)
    rows, cols = scale_grid_dims(values.shape, direction)
    if swizzled:
        # columnwise scales are swizzled as their transpose (docs/format.md, "Scale layouts")
        if direction == "rowwise":
            compact = compact_from_swizzled(scale, rows, cols, argname=sname)
        else:
            compact = compact_from_swizzled(scale, cols, rows, argname=sname).t().contiguous()
    else:
        pr, pc = padded_shape(rows, cols, direction)
        if scale.dim() == 1:
            if scale.numel() != pr * pc:
                raise ValueError(
                    f"{sname} is 1-D with {scale.numel()} bytes; "
                    f"{direction} data of shape {tuple(values.shape)} "
                    f"needs TE's padded ({pr}, {pc}) grid = {pr * pc} bytes"
                )
            scale = scale.view(pr, pc)
        compact = compact_from_grid(scale, rows, cols, padded=(pr, pc), argname=sname)
    if direction == "rowwise":
        compact = compact.reshape(*values.shape[:-1], cols)
    return MXFP8Components(values, compact, direction)


def export_te(obj, direction: str = "rowwise") -> MXFP8Components:
    """Export one direction of a TE ``MXFP8Tensor`` / ``MXFP8TensorStorage`` (duck-typed).

    Args:
        obj: has ``_rowwise_data``, ``_columnwise_data`` (uint8, logical shape ``(*lead, K)``),
            ``_rowwise_scale_inv`` (uint8 ``(roundup(M,128), roundup(ceil(K/32),4))``),
            ``_columnwise_scale_inv`` (uint8 ``(roundup(ceil(M/32),4), roundup(K,128))``), ``_fp8_dtype`` (TE
            DType or torch FP8 dtype) and optionally ``_with_gemm_swizzled_scales`` (default False). ``M =
            prod(lead)``.
        direction: ``"rowwise"`` or ``"columnwise"``.

    Returns:
        :class:`MXFP8Components` whose ``data`` is ``obj._<direction>_data.view(fp8)`` (same storage and
        ``data_ptr``: an in-place update of the producer shows through). ``scale_inv`` is a view of TE's grid
        when only rows are padded (rowwise: ``ceil(K/32) % 4 == 0``; columnwise: ``K % 128 == 0``), otherwise
        a contiguous copy of the compact corner; swizzled scales are always a copy (one permute). Padding
        bytes are never read.

    Raises:
        ValueError: no data / scales for ``direction`` (e.g. a rowwise-only storage asked for columnwise), a
            scale grid too small (or, swizzled, of the wrong byte count) for the data, a shape TE does not
            make (M or K not a multiple of 32: :func:`check_te_shape`).
        TypeError: data not uint8 / FP8, scales not uint8 / ``float8_e8m0fnu`` (``float8_e8m0fnu`` is
            bit-viewed, never value-cast), an unknown ``_fp8_dtype``.
    """
    check_direction(direction)
    data = getattr(obj, f"_{direction}_data")
    scale = getattr(obj, f"_{direction}_scale_inv")
    if data is None:
        have = [d for d in ("rowwise", "columnwise") if getattr(obj, f"_{d}_data") is not None]
        raise ValueError(
            f"TE storage has no {direction} data (_{direction}_data is None); "
            f"it holds: {', '.join(have) or 'nothing'}"
        )
    return components_from_te_parts(
        data,
        scale,
        obj._fp8_dtype,
        direction,
        swizzled=bool(getattr(obj, "_with_gemm_swizzled_scales", False)),
        names=(f"_{direction}_data", f"_{direction}_scale_inv"),
    )


def to_te_layout(components: MXFP8Components, swizzled: bool = False, *, grouped: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Components -> the ``(data, scale_inv)`` pair TE stores for that direction.

    The inverse of :func:`export_te`.

    Args:
        components: :class:`MXFP8Components`, rowwise or columnwise, of a shape TE makes (M and K multiples of
            32).
        swizzled: lay the scales out as TE does with ``_with_gemm_swizzled_scales`` / ``optimize_for_gemm``
            (cuBLAS 128x4 tiles; columnwise scales swizzled as their transpose).
        grouped: lay out one member of a grouped storage (TE's shape rule for those: :func:`check_te_shape`).

    Returns:
        ``data``: uint8 with the logical shape, a view of ``components.data`` when it is contiguous.
        ``scale_inv``: a new uint8 tensor of TE's padded shape: rowwise ``(roundup(M,128),
        roundup(ceil(K/32),4))``, columnwise ``(roundup(ceil(M/32),4), roundup(K,128))``; padding bytes are 0;
        swizzled bytes are :func:`mxport.layouts.swizzle` order (of the transpose, for columnwise) in that
        same shape.

    Raises:
        TypeError: ``components`` is not an :class:`MXFP8Components`.
        ValueError: a shape TE cannot hold as MXFP8 (M or K not a multiple of 32: :func:`check_te_shape`).
    """
    if not isinstance(components, MXFP8Components):
        raise TypeError(f"components must be an MXFP8Components, got {type(components).__name__}")
    check_te_shape(components.shape, "components", components.direction if grouped else None)
    data = components.data if components.data.is_contiguous() else components.data.contiguous()
    direction = components.direction
    rows, cols = scale_grid_dims(components.shape, direction)
    compact = components.scale_inv.reshape(rows, cols)
    pr, pc = padded_shape(rows, cols, direction)
    if swizzled:
        grid = swizzle(compact) if direction == "rowwise" else swizzle(compact.t()).reshape(pr, pc)
    else:
        grid = pad(compact, direction)
    if grid.data_ptr() == components.scale_inv.data_ptr():
        grid = grid.clone()
    return data.view(torch.uint8), grid
