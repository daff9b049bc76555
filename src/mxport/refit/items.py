"""What a model contributes to a refit plan: its tensors in canonical order and their plan items — derived the
same way, independently, by the trainer (:class:`~mxport.refit.TrainerSource`) and the inference side
(:func:`~mxport.refit.receiver_plan`), so that their plan digests agree.

Canonical order: ``model.named_modules()`` order; inside a module its own parameters and persistent buffers
sorted by local name, the E8M0 scales right after their values; a tensor shared by several modules (tied
embeddings) appears once, at its first name. Names are the modelopt checkpoint names (``<m>.weight`` values,
``<m>.weight_scale`` scales; docs/format.md), which are also ``MXFP8Linear``'s ``state_dict()`` names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..checkpoint.naming import scale_name
from .plan import Item

#: plan tensor names follow the modelopt checkpoint (also MXFP8Linear state_dict names)
PLAN_NAMING = "modelopt"


def model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter and persistent buffer of ``model`` in canonical order (see
    module doc); shared tensors once. Non-persistent buffers (rotary ``inv_freq``, caches) are not part of a
    refit. Native MXFP8 storage held as a plain module attribute (Megatron-LM's ``quantize_params_to_mxfp8``
    replaces each weight parameter by an ``MXFP8Tensor`` attribute of the same name) is included too, under
    that name (:func:`mxport.sources.native_attributes`): it is an object, not a tensor."""
    from ..sources.discover import native_attributes

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
                 scales: tuple[torch.dtype, Sequence[int]] | None = None) -> list[Item]:
    """The plan items of one model tensor: with ``scales`` (their dtype and shape), MXFP8 values then their
    E8M0 scales under the modelopt scale name; without, a tensor that travels as it is ("kept")."""
    if scales is None:
        return [(name, "kept", dtype, tuple(shape))]
    return [(name, "values", dtype, tuple(shape)),
            (scale_name(name, PLAN_NAMING), "scales", scales[0], tuple(scales[1]))]
