"""What a model contributes to a refit plan: its tensors in canonical order and their plan items, derived
alike and independently by the trainer and the engine, so that their plan digests agree.

Canonical order: ``model.named_modules()`` order; inside a module its parameters and persistent buffers by
local name, scales right after their values; a shared tensor (tied embeddings) once, at its first name. Names
are modelopt checkpoint names (``<m>.weight``, ``<m>.weight_scale``), ``MXFP8Linear``'s state_dict names."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..checkpoint.naming import quant_names, scale_name
from ..sources.discover import native_attributes
from .plan import Item

#: plan tensor names follow the modelopt checkpoint (also MXFP8Linear state_dict names)
PLAN_NAMING = "modelopt"


def model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter and persistent buffer of ``model`` in canonical order, shared
    tensors once; native MXFP8 storage held as a module attribute (Megatron's ``MXFP8Tensor``) too."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for prefix, mod in model.named_modules():
        local = dict(mod.named_parameters(recurse=False))
        for n, b in mod.named_buffers(recurse=False):
            if b is not None and n not in mod._non_persistent_buffers_set:
                local[n] = b
        local.update(native_attributes(mod))
        for n in sorted(local):
            t = local[n]
            if id(t) in seen:
                continue
            seen.add(id(t))
            out.append((f"{prefix}.{n}" if prefix else n, t))
    return out


def tensor_items(name: str, dtype: torch.dtype, shape: Sequence[int], *,
                 scales: tuple[torch.dtype, Sequence[int]] | None = None,
                 global_scale: bool = False) -> list[Item]:
    """The plan items of one model tensor: with ``scales`` (their dtype and shape), the values (MXFP8, or
    packed 4-bit uint8) then their block scales and, with ``global_scale`` (NVFP4), the one-element float32
    global scale ``<name>_scale_2`` (also a "scales" item); without, one kept tensor."""
    if scales is None:
        return [(name, "kept", dtype, tuple(shape))]
    items = [(name, "values", dtype, tuple(shape)),
             (scale_name(name, PLAN_NAMING), "scales", scales[0], tuple(scales[1]))]
    if global_scale:
        items.append((quant_names(name, PLAN_NAMING, "nvfp4")[2], "scales", torch.float32, (1,)))
    return items
