""":func:`receiver_plan` (an inference model's plan and live targets) and :func:`checkpoint_tensors`
(checkpoint-format pairs for engines' own loaders)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ...checkpoint.naming import FORMATS, quant_names, scale_name
from ...formats import is_fp8_dtype
from ..arena import adopt, adoptable, allocate_targets, storage_users
from ..items import PLAN_NAMING, model_tensors, tensor_items
from ..plan import RefitPlan

__all__ = ["checkpoint_tensors", "model_tensors", "receiver_plan"]


def receiver_plan(model: nn.Module, *, arena: bool = False) -> tuple[RefitPlan, list[torch.Tensor]]:
    """The inference side: the plan derived from the live model, and its live tensors (the targets): FP8
    tensors "values", the uint8 tensor named ``scale_name(values)`` in the same module their "scales"; a uint8
    tensor with such a scale (of its rank) is packed 4-bit "values" (:class:`mxport.fp4_linear.FP4Linear`),
    its ``<name>_scale_2`` a "scales" item too (NVFP4's global scale); the rest "kept". The targets are
    ``detach()`` aliases (same storage and version counter, so derived caches follow a refit).
    ``arena=True`` first moves them into one buffer laid out as the byte stream (same objects, new stable
    addresses: before CUDA graph capture), for direct mode; ValueError, nothing moved, for a tensor that
    cannot move (a view, shared, a subclass, another device)."""
    tensors = model_tensors(model)
    names = {n for n, _ in tensors}
    by_name = dict(tensors)
    items, live, done = [], [], set()
    for name, t in tensors:
        if name in done:
            continue
        sname = scale_name(name, PLAN_NAMING)
        packed = t.dtype == torch.uint8 and sname in names and by_name[sname].dim() == t.dim()
        if (is_fp8_dtype(t.dtype) or packed) and sname in names:  # MXFP8, or 4-bit values packed in uint8
            s = by_name[sname]
            gname = quant_names(name, PLAN_NAMING, "nvfp4")[2]
            glob = packed and gname in names
            items += tensor_items(name, t.dtype, t.shape, scales=(s.dtype, s.shape), global_scale=glob)
            live += [t, s, by_name[gname]] if glob else [t, s]
            done.update((sname, gname) if glob else (sname,))
        else:
            items.append((name, "values" if is_fp8_dtype(t.dtype) else "kept", t.dtype, tuple(t.shape)))
            live.append(t)
    plan = RefitPlan(items)
    if arena:
        slots = allocate_targets(plan, live[0].device)
        users = storage_users(model)
        for e, t, slot in zip(plan.entries, live, slots, strict=True):
            if e.nbytes and not adoptable(t, slot, users):
                raise ValueError(f"receiver_plan(arena=True): {e.name!r} cannot move into the refit arena "
                                 f"(it must be a plain contiguous tensor on {slot.device} that owns its "
                                 f"storage alone); nothing was moved, use arena=False")
        for e, t, slot in zip(plan.entries, live, slots, strict=True):
            if e.nbytes:
                adopt(t, slot)
    return plan, [t.detach() for t in live]


def checkpoint_tensors(plan: RefitPlan, targets: Sequence[torch.Tensor], fmt: str = "modelopt"
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs in checkpoint format ``fmt`` (``mxport.checkpoint.FORMATS``), in plan
    order, for an engine's own loader (vLLM ``load_weights``, SGLang ``update_weights_from_tensor``): FP8
    values, compact uint8 E8M0 scales named per format, kept tensors; the targets themselves, no copy."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {list(FORMATS)}, got {fmt!r}")
    if len(targets) != len(plan):
        raise ValueError(f"targets: got {len(targets)} tensors, the plan has {len(plan)}")
    last_values = None
    for e, t in zip(plan.entries, targets, strict=True):
        if e.role == "values":
            last_values = e.name
            yield e.name, t
        elif e.role == "scales":
            yield (scale_name(last_values, fmt) if last_values else e.name), t
        else:
            yield e.name, t
