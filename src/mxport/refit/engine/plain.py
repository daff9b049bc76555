"""The inference side of a refit: :func:`receiver_plan` (the plan and live targets of an inference model, e.g.
one made of :class:`~mxport.nn.MXFP8Linear`), :func:`checkpoint_tensors` (``(hf_name, tensor)`` pairs in
checkpoint format for engines' own loaders) and :func:`~mxport.refit.items.model_tensors` (the canonical order
both sides share)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ...checkpoint.naming import FORMATS, scale_name
from ...formats import is_fp8_dtype
from ..arena import adopt, adoptable, allocate_targets, storage_users
from ..items import PLAN_NAMING, model_tensors, tensor_items
from ..plan import RefitPlan

__all__ = ["checkpoint_tensors", "model_tensors", "receiver_plan"]


def receiver_plan(model: nn.Module, *, arena: bool = False
                  ) -> tuple[RefitPlan, list[torch.Tensor]]:
    """The inference side: the plan derived from the live model and its live tensors (the refit targets).

    FP8 tensors are "values"; the uint8 tensor named ``scale_name(values)`` in the same module is their
    "scales"; everything else is "kept". The returned tensors are ``detach()`` aliases of the module's own
    buffers / parameters (not copies): they share storage *and* version counter, so a refit's in-place writes
    bump the module tensors' ``_version`` and derived caches (an MXFP8Linear's decoded weight) follow.
    (``.data`` aliases would not: they get a version counter of their own.)

    ``arena=True`` first moves the model's refit tensors into one buffer laid out as the plan's byte stream
    (:func:`allocate_targets` on the model's device): each tensor's bytes are copied in and its ``.data``
    becomes its view of the buffer — the same parameter / buffer objects, same values, new (from then on
    stable) addresses. A :class:`~mxport.refit.RefitReceiver` given these targets then receives in direct
    mode: buckets land straight in the live weights, with no staging -> live copy per refit. Do it before
    anything records the weights' addresses (CUDA graph capture); references to the old storages taken before
    no longer follow the model.

    Raises:
        ValueError: with ``arena=True``, a tensor that cannot move (a view of a larger or shared storage, a
            tensor subclass, another device); nothing is moved then.
    """
    tensors = model_tensors(model)
    names = {n for n, _ in tensors}
    by_name = dict(tensors)
    items, live, done = [], [], set()
    for name, t in tensors:
        if name in done:
            continue
        sname = scale_name(name, PLAN_NAMING)
        if is_fp8_dtype(t.dtype) and sname in names:
            s = by_name[sname]
            items += tensor_items(name, t.dtype, t.shape, scales=(s.dtype, s.shape))
            live += [t, s]
            done.add(sname)
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
    """``(hf_name, tensor)`` pairs in checkpoint format ``fmt`` (one of ``mxport.checkpoint.FORMATS``), in
    plan order, for an engine's own loader: vLLM ``model.load_weights(iter)`` / ``reload_weights``, SGLang
    ``update_weights_from_tensor(named_tensors)``. Values are FP8 tensors, scales compact uint8 E8M0 named per
    format (``weight_scale`` for modelopt / compressed-tensors, ``weight_scale_inv`` for sglang), kept tensors
    as they are. Tensors are the targets themselves (no copy)."""
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
