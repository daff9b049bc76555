"""export_components / export_grouped_components: any MXFP8 producer (or a float weight) -> MXFP8Components.

One call for both workflows of docs/index.md ("Workflows"): native reuse (Transformer Engine, torchao,
Megatron-LM tensors are exported as views of their bytes, never dequantized or requantized) and
quantize-for-inference (float tensors go through :func:`mxport.quantize`). The per-producer layouts live in
:mod:`mxport.sources`.
"""

from __future__ import annotations

import torch

from .components import MXFP8Components, check_direction
from .formats import FLOAT_DTYPES, describe
from .quantize import quantize
from .sources.grouped import (
    export_te_grouped,
    export_te_grouped_stacked,
    grouped_float_members,
    grouped_float_stacked,
    is_high_precision_grouped,
    is_te_grouped,
    split_experts,
)
from .sources.megatron import export_megatron, is_megatron_mxfp8
from .sources.te import export_te, is_te_mxfp8
from .sources.torchao import export_torchao, is_torchao_mx

ACCEPTED = (
    "a Transformer Engine MXFP8Tensor / MXFP8TensorStorage / GroupedTensor, a torchao MXTensor, a "
    "Megatron-LM inference MXFP8Tensor, an MXFP8Components, or a float32/bfloat16/float16 tensor or "
    "nn.Parameter (quantized)"
)


def _native(obj, direction: str) -> MXFP8Components | None:
    """Components for a native MXFP8 producer, or None when ``obj`` is not one."""
    if isinstance(obj, MXFP8Components):
        if obj.direction != direction:
            raise ValueError(f"these MXFP8Components are {obj.direction}; "
                             f"direction={describe(direction)} is not available")
        return obj
    if is_te_grouped(obj) and not is_high_precision_grouped(obj):
        return export_te_grouped_stacked(obj, direction)
    if is_te_mxfp8(obj):
        return export_te(obj, direction)
    if is_torchao_mx(obj):
        return export_torchao(obj, direction)
    if is_megatron_mxfp8(obj):
        return export_megatron(obj, direction)
    return None




def _is_float_tensor(obj) -> bool:
    """A plain float tensor or nn.Parameter. Tensor subclasses are excluded: an unknown quantized subclass
    (e.g. TE NVFP4Tensor, whose dtype is its nominal bf16) must not be silently dequantized and
    requantized."""
    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and type(obj.data) is torch.Tensor
            and obj.dtype in FLOAT_DTYPES)


def export_components(obj, *, direction: str = "rowwise", **quantize_kwargs) -> MXFP8Components:
    """The MXFP8 values, compact E8M0 scales and direction of ``obj``, without its storage conventions.

    Args:
        obj: one of (checked in this order, duck-typed so no framework needs to be installed):

            - :class:`MXFP8Components`: returned as is.
            - Transformer Engine ``MXFP8Tensor`` / ``MXFP8TensorStorage`` (``_rowwise_data``,
              ``_columnwise_data``, ``_rowwise_scale_inv``, ``_columnwise_scale_inv``, ``_fp8_dtype``,
              ``_with_gemm_swizzled_scales``): see :func:`mxport.sources.te.export_te` for the padded /
              swizzled layouts.
            - torchao ``MXTensor`` with FP8 elements: :func:`mxport.sources.torchao.export_torchao`.
            - Megatron-LM inference ``MXFP8Tensor`` (``data``, swizzled ``scale``, ``backend``):
              :func:`mxport.sources.megatron.export_megatron`.
            - Transformer Engine ``GroupedTensor`` (a ``torch.Tensor`` wrapper subclass; also as the
              ``nn.Parameter`` TE's ``GroupedLinear(single_grouped_weight=True)`` registers as ``weight``) or
              ``GroupedTensorStorage`` with equal member shapes: ONE 3-D ``[E, N, K]`` components, data a view
              of the flat buffer (:func:`mxport.sources.grouped.export_te_grouped_stacked`); with
              ``quantizer`` None (a bf16 grouped weight) the stacked members are quantized like a float
              tensor. :func:`export_grouped_components` gives one components per expert instead.
            - a float32 / bfloat16 / float16 (float64 read as float32) tensor or ``nn.Parameter``: quantized
              with :func:`mxport.quantize` (``quantize_kwargs`` such as ``fp8_dtype``, ``rounding``,
              ``block_2d`` pass through).
        direction: ``"rowwise"`` (blocks of 32 along the last dim) or ``"columnwise"`` (along the flattened
            leading dims), TE's terms.
        **quantize_kwargs: only for float input; passing them with an MXFP8 producer is a TypeError (the
            native path never requantizes).

    Returns:
        :class:`MXFP8Components`. Values are always a view of the producer's bytes (same storage and
        ``data_ptr``; an optimizer step writing the producer in place shows through). Scales are a view unless
        padding in the last dimension or a swizzle forces a copy; a copy is contiguous and made with one
        slice / permute, never a per-element loop. Exported scales are always contiguous.

    Raises:
        TypeError: an object of any other kind (the message lists what is accepted), an integer / FP8 tensor
            without scales, an unknown tensor subclass (never dequantized behind your back), quantize options
            given with an MXFP8 producer, wrong dtypes inside a producer.
        ValueError: no data for ``direction`` (e.g. a rowwise-only TE storage asked for columnwise), scale
            grids too small / of the wrong shape for the data, an unknown ``direction``; a TE grouped tensor
            whose members differ in shape, are not packed back to back, or (columnwise, ``N % 32 != 0``) would
            have blocks straddling experts (use :func:`export_grouped_components`).
    """
    if not isinstance(direction, str):
        raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {describe(direction)}")
    check_direction(direction)
    native = _native(obj, direction)
    if native is not None:
        if quantize_kwargs:
            raise TypeError(
                f"quantize options {sorted(quantize_kwargs)} apply to float tensors only; "
                f"{type(obj).__name__} is already MXFP8 and is exported as is "
                "(dequantize it first to requantize)"
            )
        return native
    if _is_float_tensor(obj):
        if obj.dim() == 0:
            raise ValueError("obj must have at least one dimension (blocks run along the last one), "
                             "got a 0-d tensor")
        return quantize(obj.detach(), direction=direction, **quantize_kwargs)
    if is_high_precision_grouped(obj):
        return quantize(grouped_float_stacked(obj).detach(), direction=direction, **quantize_kwargs)
    if isinstance(obj, torch.Tensor) and type(obj) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"export_components got a tensor subclass {type(obj).__name__} that is not a known MXFP8 "
            f"producer; expected {ACCEPTED} (convert it to a plain tensor first)"
        )
    if isinstance(obj, torch.Tensor):
        raise TypeError(f"export_components got a {obj.dtype} tensor without scales; expected {ACCEPTED}")
    raise TypeError(f"export_components accepts {ACCEPTED}; got {type(obj).__name__}")


def export_grouped_components(obj, *, direction: str = "rowwise", **quantize_kwargs) -> list[MXFP8Components]:
    """Per-expert MXFP8 components of a grouped (MoE) weight, in expert order.

    Args:
        obj: one of

            - Transformer Engine grouped storage (``GroupedTensorStorage`` / ``GroupedTensor``, also wrapped
              in ``nn.Parameter``: one flat data buffer, per-expert offsets, per-expert padded scale grids):
              see :func:`mxport.sources.grouped.export_te_grouped`. A high-precision one (``quantizer``
              None) has each member quantized with :func:`mxport.quantize` (``quantize_kwargs`` pass
              through).
            - a 3-D ``[E, N, K]`` float tensor / ``nn.Parameter``: each expert quantized on its own with
              :func:`mxport.quantize` (``quantize_kwargs`` pass through), so columnwise blocks never straddle
              experts.
            - anything :func:`export_components` accepts whose data is 3-D ``[E, N, K]`` (3-D
              :class:`MXFP8Components`, a TE / torchao tensor): exported, then split per expert
              (:func:`mxport.sources.grouped.split_experts`).
        direction: ``"rowwise"`` or ``"columnwise"``.

    Returns:
        A list of :class:`MXFP8Components`, one per expert; views / copies as in :func:`export_components`.

    Raises:
        TypeError: an unsupported object; quantize options with an MXFP8 producer.
        ValueError: no data for ``direction``, data that is not 3-D, scale regions too small, columnwise 3-D
            components whose blocks straddle experts.
    """
    check_direction(direction)
    if is_high_precision_grouped(obj):
        members = grouped_float_members(obj)
        return [quantize(m.detach(), direction=direction, **quantize_kwargs) for m in members]
    if is_te_grouped(obj):
        if quantize_kwargs:
            raise TypeError(f"quantize options {sorted(quantize_kwargs)} apply to float tensors only")
        return export_te_grouped(obj, direction)
    if _is_float_tensor(obj) and not (is_te_mxfp8(obj) or is_torchao_mx(obj)):
        if obj.dim() != 3:
            raise ValueError(f"expert weights must be 3-D [E, N, K], got shape {tuple(obj.shape)}")
        x = obj.detach()
        return [quantize(x[i], direction=direction, **quantize_kwargs) for i in range(x.shape[0])]
    return split_experts(export_components(obj, direction=direction, **quantize_kwargs))
