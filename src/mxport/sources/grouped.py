"""Grouped (MoE) MXFP8 storage -> one :class:`~mxport.MXFP8Components` per expert, in expert order.

Transformer Engine's grouped storage (``transformer_engine/pytorch/tensor/storage/grouped_tensor_storage.py``,
``GroupedTensorStorage`` / ``GroupedTensor``, ``split_into_quantized_tensors``), duck-typed:

- ``num_tensors``; ``tensor_shapes`` (list of 2-D ``(rows, cols)``, or ``None``: then from ``first_dims`` /
  ``last_dims`` / ``logical_shape``).
- ``rowwise_data`` / ``columnwise_data``: ONE flat uint8 buffer each; expert ``i`` starts at element
  ``offsets[i]`` (or ``tensor_offsets``; without either, at ``i * rows * cols``) and has its logical shape.
- ``scale_inv`` / ``columnwise_scale_inv``: ONE flat uint8 buffer each, holding every expert's TE-padded scale
  grid back to back; expert ``i``'s grid starts at ``scale_inv_offsets[i]`` (``columnwise_scale_inv_offsets``;
  without them, the running sum of the padded grid sizes).
- FP8 type from ``quantizer.dtype`` (TE DType), or an ``_fp8_dtype`` / ``fp8_dtype`` attribute;
  ``_with_gemm_swizzled_scales``: every expert's grid is swizzled on its own.
"""

from __future__ import annotations

import math

import torch

from ..components import MXFP8Components, check_direction
from ..formats import BLOCK_SIZE
from ..layouts import padded_shape
from .te import components_from_te_parts, scale_grid_dims


def is_te_grouped(obj) -> bool:
    """True for objects shaped like TE's ``GroupedTensorStorage`` (``num_tensors``, ``rowwise_data``,
    ``columnwise_data``, ``scale_inv``, ``columnwise_scale_inv``)."""
    return all(
        hasattr(obj, a)
        for a in ("num_tensors", "rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv")
    )


def _as_list(v) -> list[int] | None:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return [int(x) for x in v.tolist()]
    return [int(x) for x in v]


def _grouped_fp8_dtype(obj):
    for name in ("_fp8_dtype", "fp8_dtype"):
        if getattr(obj, name, None) is not None:
            return getattr(obj, name)
    quantizer = getattr(obj, "quantizer", None)
    if quantizer is not None and getattr(quantizer, "dtype", None) is not None:
        return quantizer.dtype
    raise ValueError("grouped storage names no FP8 dtype: "
                     "expected quantizer.dtype or an _fp8_dtype attribute")


def _expert_shapes(obj, n: int) -> list[tuple[int, int]]:
    if getattr(obj, "tensor_shapes", None) is not None:
        shapes = [tuple(int(d) for d in s) for s in obj.tensor_shapes]
    else:
        logical = tuple(int(d) for d in obj.logical_shape)
        first, last = _as_list(getattr(obj, "first_dims", None)), _as_list(getattr(obj, "last_dims", None))
        if first is None:
            first = [logical[0] // n if last is None else logical[0]] * n
        if last is None:
            last = [logical[1]] * n
        shapes = list(zip(first, last, strict=False))
    if len(shapes) != n:
        raise ValueError(f"grouped storage has num_tensors={n} but {len(shapes)} tensor shapes")
    return shapes


def _offsets(given, sizes: list[int], argname: str) -> list[int]:
    if given is None:
        out = [0]
        for s in sizes:
            out.append(out[-1] + s)
        return out
    if len(given) < len(sizes):
        raise ValueError(f"{argname} has {len(given)} entries, needs at least {len(sizes)} (one per expert)")
    return given


def export_te_grouped(obj, direction: str = "rowwise") -> list[MXFP8Components]:
    """Split a TE grouped MXFP8 storage into per-expert components (layout in the module docstring).

    Returns:
        ``num_tensors`` :class:`MXFP8Components`, in expert order. Each ``data`` is a view of the flat buffer
        (same storage); each ``scale_inv`` a view of that expert's padded grid when only rows are padded, else
        a compact copy (always a copy when swizzled), exactly as :func:`mxport.sources.te.export_te`.

    Raises:
        ValueError: no data / scales for ``direction``; a buffer or an expert's scale region too small for the
            shapes; offsets lists that are too short.
        TypeError: buffers of the wrong dtype, an unknown FP8 dtype.
    """
    check_direction(direction)
    n = int(obj.num_tensors)
    prefix = "rowwise_" if direction == "rowwise" else "columnwise_"
    data_buf = getattr(obj, f"{prefix}data")
    scale_name = "scale_inv" if direction == "rowwise" else "columnwise_scale_inv"
    scale_buf = getattr(obj, scale_name)
    if data_buf is None or scale_buf is None:
        raise ValueError(
            f"grouped storage has no {direction} data ({prefix}data or {scale_name} is None)"
        )
    fp8 = _grouped_fp8_dtype(obj)
    shapes = _expert_shapes(obj, n)
    numels = [math.prod(s) for s in shapes]
    grids = [padded_shape(*scale_grid_dims(s, direction), direction) for s in shapes]
    grid_sizes = [r * c for r, c in grids]
    d_off = _offsets(_as_list(getattr(obj, "offsets", None))
                     or _as_list(getattr(obj, "tensor_offsets", None)),
                     numels, "offsets")
    s_off = _offsets(_as_list(getattr(obj, f"{scale_name}_offsets", None)), grid_sizes,
                     f"{scale_name}_offsets")
    flat_data, flat_scale = data_buf.reshape(-1), scale_buf.reshape(-1)
    swizzled = bool(getattr(obj, "_with_gemm_swizzled_scales", False))
    out = []
    for i, (shape, numel, size) in enumerate(zip(shapes, numels, grid_sizes, strict=True)):
        d0, s0 = d_off[i], s_off[i]
        if d0 + numel > flat_data.numel():
            raise ValueError(
                f"{prefix}data holds {flat_data.numel()} elements; "
                f"expert {i} {shape} needs [{d0}, {d0 + numel})"
            )
        if s0 + size > flat_scale.numel():
            raise ValueError(
                f"{scale_name} holds {flat_scale.numel()} bytes; expert {i} {shape} needs its padded grid at "
                f"[{s0}, {s0 + size}): too small for the data"
            )
        out.append(
            components_from_te_parts(
                flat_data[d0 : d0 + numel].view(shape),
                flat_scale[s0 : s0 + size],
                fp8,
                direction,
                swizzled=swizzled,
                names=(f"{prefix}data[expert {i}]", f"{scale_name}[expert {i}]"),
            )
        )
    return out


def split_experts(components: MXFP8Components) -> list[MXFP8Components]:
    """Split 3-D ``[E, N, K]`` components into E per-expert ``[N, K]`` components (views, no copy).

    Rowwise: expert ``e`` gets ``data[e]`` and ``scale_inv[e]``. Columnwise blocks run along the flattened
    ``E * N`` rows, so they stay inside one expert only when ``N % 32 == 0``; expert ``e`` then gets scale
    rows ``[e*N/32, (e+1)*N/32)``.

    Raises:
        ValueError: not 3-D; columnwise with ``N % 32 != 0`` (blocks straddle experts).
    """
    if components.data.dim() != 3:
        raise ValueError(f"expert weights must be 3-D [E, N, K], got shape {tuple(components.shape)}")
    e, n, _ = components.shape
    if components.direction == "rowwise":
        return [MXFP8Components(components.data[i], components.scale_inv[i], "rowwise") for i in range(e)]
    if n % BLOCK_SIZE:
        raise ValueError(
            f"columnwise [E, N, K] components with N={n} (not a multiple of {BLOCK_SIZE}) have blocks "
            "that straddle experts; quantize per expert instead"
        )
    rb = n // BLOCK_SIZE
    return [
        MXFP8Components(components.data[i], components.scale_inv[i * rb : (i + 1) * rb], "columnwise")
        for i in range(e)
    ]
