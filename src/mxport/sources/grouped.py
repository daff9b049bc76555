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
  ``_with_gemm_swizzled_scales``: every expert's grid is swizzled on its own. Without that attribute, the
  quantizer's ``optimize_for_gemm`` decides, as in TE's ``split_into_quantized_tensors`` (TE versions whose
  ``GroupedTensor.__torch_dispatch__`` did not copy the flag onto ``detach()`` / ``nn.Parameter`` wrappers).
- ``quantizer is None``: a high-precision grouped weight (``rowwise_data`` bf16/fp16/fp32, no scales), as
  ``GroupedLinear(single_grouped_weight=True)`` keeps it without an FP8 recipe.

``GroupedTensor`` (``transformer_engine/pytorch/tensor/grouped_tensor.py``) is ``class GroupedTensor(
GroupedTensorStorage, torch.Tensor)``, a ``torch.Tensor._make_wrapper_subclass`` wrapper whose own ``dtype``
is the nominal high-precision dtype (``fake_dtype``) and whose shape is ``(num_tensors, rows, cols)`` when
every member has the same shape (else ``logical_shape``). TE's ``GroupedLinear(single_grouped_weight=True)``
(``transformer_engine/pytorch/module/grouped_linear.py``, ``make_grouped_weights``) registers it as the ONE
parameter ``weight`` (``weight0`` ... ``weight{n-1}`` become None) via ``torch.nn.Parameter(grouped)``, which
for a wrapper subclass returns a ``GroupedTensor`` again (``detach()`` copies the storage fields,
``_is_param`` set). Both are read here by their attributes only, never through tensor ops (TE bans most of
them on the wrapper).
"""

from __future__ import annotations

import math

import torch

from ..components import MXFP8Components, check_direction
from ..formats import BLOCK_SIZE, FLOAT_DTYPES
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


def _swizzled(obj) -> bool:
    """``_with_gemm_swizzled_scales`` when the object carries it, else ``quantizer.optimize_for_gemm``."""
    if hasattr(obj, "_with_gemm_swizzled_scales"):
        return bool(obj._with_gemm_swizzled_scales)
    return bool(getattr(getattr(obj, "quantizer", None), "optimize_for_gemm", False))


def is_high_precision_grouped(obj) -> bool:
    """True for a TE grouped storage without quantization: ``quantizer`` None, no FP8 dtype attribute, no
    scales, float ``rowwise_data`` (``GroupedLinear(single_grouped_weight=True)`` trained in bf16)."""
    if not is_te_grouped(obj) or getattr(obj, "quantizer", None) is not None:
        return False
    if any(getattr(obj, a, None) is not None for a in ("_fp8_dtype", "fp8_dtype", "scale_inv")):
        return False
    data = obj.rowwise_data
    return isinstance(data, torch.Tensor) and data.dtype in FLOAT_DTYPES


def grouped_float_members(obj) -> list[torch.Tensor]:
    """The members of a high-precision grouped storage, each a view of ``rowwise_data`` with its shape (as
    TE's ``split_into_quantized_tensors`` with ``quantizer is None``).

    Raises:
        ValueError: the buffer is too small for the shapes / offsets.
    """
    n = int(obj.num_tensors)
    shapes = _expert_shapes(obj, n)
    numels = [math.prod(s) for s in shapes]
    flat = obj.rowwise_data.reshape(-1)
    d_off = _offsets(_data_offsets(obj), numels, "offsets")
    out = []
    for i, (shape, numel) in enumerate(zip(shapes, numels, strict=True)):
        if d_off[i] + numel > flat.numel():
            raise ValueError(f"rowwise_data holds {flat.numel()} elements; "
                             f"member {i} {shape} needs [{d_off[i]}, {d_off[i] + numel})")
        out.append(flat[d_off[i] : d_off[i] + numel].view(shape))
    return out


def _data_offsets(obj) -> list[int] | None:
    return _as_list(getattr(obj, "offsets", None)) or _as_list(getattr(obj, "tensor_offsets", None))


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
            shapes; offsets lists that are too short; an expert whose blocked dimension (K rowwise, rows
            columnwise) is not a multiple of 32 (TE sizes its grids with ``// 32``:
            :func:`mxport.sources.te.check_te_shape`).
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
    d_off = _offsets(_data_offsets(obj), numels, "offsets")
    s_off = _offsets(_as_list(getattr(obj, f"{scale_name}_offsets", None)), grid_sizes,
                     f"{scale_name}_offsets")
    flat_data, flat_scale = data_buf.reshape(-1), scale_buf.reshape(-1)
    swizzled = _swizzled(obj)
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
                grouped=True,
            )
        )
    return out


def _span(views: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
    """One view of ``shape`` covering ``views`` when they are contiguous and lie back to back in one storage
    (same storage, each starting where the previous ends); None otherwise."""
    first = views[0]
    step = first.numel() * first.element_size()
    base = first.untyped_storage().data_ptr()
    for i, v in enumerate(views):
        if (not v.is_contiguous() or v.untyped_storage().data_ptr() != base
                or v.data_ptr() != first.data_ptr() + i * step):
            return None
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return first.as_strided(shape, strides, first.storage_offset())


def _uniform_shape(shapes: list[tuple[int, ...]], what: str) -> tuple[int, ...]:
    if len(set(shapes)) != 1:
        raise ValueError(
            f"{what} members have different shapes {sorted(set(shapes))}: they do not form one [E, N, K] "
            "tensor; use export_grouped_components for one MXFP8Components per expert"
        )
    return shapes[0]


def export_te_grouped_stacked(obj, direction: str = "rowwise") -> MXFP8Components:
    """All experts of a TE grouped storage as ONE 3-D ``[E, N, K]`` :class:`MXFP8Components` (the
    ``GroupedTensor``'s own wrapper shape), for :func:`mxport.export_components`.

    Returns:
        ``data``: a view spanning the flat data buffer (same storage). ``scale_inv``: compact rowwise
        ``(E, N, ceil(K/32))`` / columnwise ``(E*N/32, K)``; a view of the flat scale buffer when TE's grids
        need no padding (``N % 128 == 0`` and ``ceil(K/32) % 4 == 0`` rowwise; ``(N/32) % 4 == 0`` and
        ``K % 128 == 0`` columnwise) and are not swizzled, else one contiguous copy.

    Raises:
        ValueError: members of different shapes, or not packed back to back in the data buffer (use
            :func:`mxport.export_grouped_components`); columnwise with ``N % 32 != 0`` (blocks would straddle
            experts); and everything :func:`export_te_grouped` raises.
    """
    parts = export_te_grouped(obj, direction)
    n, k = _uniform_shape([tuple(p.shape) for p in parts], "grouped storage")
    e = len(parts)
    if direction == "columnwise" and n % BLOCK_SIZE:
        raise ValueError(f"columnwise grouped members with N={n} (not a multiple of {BLOCK_SIZE}): blocks of "
                         "one [E, N, K] tensor would straddle experts; use export_grouped_components")
    data = _span([p.data for p in parts], (e, n, k))
    if data is None:
        raise ValueError("grouped members are not packed back to back in the data buffer: no single "
                         "[E, N, K] view exists; use export_grouped_components")
    scales = [p.scale_inv for p in parts]
    rows = scales[0].shape[0]
    shape = (e, *scales[0].shape) if direction == "rowwise" else (e * rows, k)
    scale = _span(scales, shape)
    if scale is None:
        scale = torch.stack(scales) if direction == "rowwise" else torch.cat(scales)
    return MXFP8Components(data, scale, direction)


def grouped_float_stacked(obj) -> torch.Tensor:
    """The members of a high-precision grouped storage as one ``[E, N, K]`` tensor: a view of
    ``rowwise_data`` when they are packed back to back, else a stacked copy.

    Raises:
        ValueError: members of different shapes; a buffer too small.
    """
    members = grouped_float_members(obj)
    shape = _uniform_shape([tuple(m.shape) for m in members], "grouped storage")
    stacked = _span(members, (len(members), *shape))
    return torch.stack(members) if stacked is None else stacked


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
