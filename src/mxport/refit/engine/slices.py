"""What one rank of a vLLM-style TP / EP engine needs (:func:`engine_holdings`) and its own buffers
(:func:`engine_buffers`, vLLM's merged qkv / gate_up / w13)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ...parallel import Layout, attention_problem, engine_shard
from ..mesh import Box, Holding, Local, TensorInfo, scales_box
from ..plan import dtype_from_name
from .plain import receiver_plan


def engine_boxes(name: str, shape: tuple[int, ...], layout: Layout, rank: int, kv_heads: int | None,
                  quantized: bool) -> list[Box]:
    """The boxes of tensor ``name`` (full ``shape``) that engine rank ``rank`` holds: one, or one per block of
    :attr:`~mxport.parallel.Shard.blocks` (a fused gate_up's gate rows, up rows)."""
    shard = engine_shard(name, shape, layout, kv_heads=kv_heads, quantized=quantized)
    if shard.problem:
        raise ValueError(shard.problem)
    if shard.dim is None:
        return [Box.full(shape)]
    dim, tp = shard.dim % len(shape), layout.tp
    if layout.ep > 1 and dim == 0 and len(shape) == 3:  # experts over all tp * ep ranks
        part = rank
    elif shard.parts == tp:
        part = rank % tp
    elif tp % shard.parts == 0:  # KV heads replicated over tp // parts ranks (vLLM num_kv_head_replicas)
        part = rank % tp // (tp // shard.parts)
    else:
        raise ValueError(f"{name}: tp={tp} is not a multiple of its {shard.parts} KV heads (vLLM refuses)")
    return [Box.along(shape, dim, a, b) for a, b in shard.ranges(shape[dim], part)]


def engine_holdings(model: nn.Module, layout: Layout, rank: int, *, kv_heads: int | None = None,
                    plan=None, boxes_of: Callable[[TensorInfo], list[Box] | None] | None = None
                    ) -> list[Holding]:
    """What engine rank ``rank`` of a vLLM-style ``layout`` (``tp * ep`` ranks) needs of a
    :func:`mxport.nn.quantize_model` 'd model: the :func:`~mxport.refit.receiver_plan` tensors, each with the
    box :func:`mxport.parallel.engine_shard` gives it (column-parallel rows or row-parallel K of part ``rank %
    tp``, KV heads fewer than ``tp`` shared by ``tp // kv_heads`` ranks, experts ``[rank * n, (rank + 1) *
    n)`` at ``ep > 1``, the rest whole; scales follow their values). A fused ``experts.gate_up_proj`` at tp >
    1 gives two holdings, gate rows then up rows, as vLLM's ``w13_weight``. ``kv_heads``: None =
    ``model.config.num_key_value_heads``. ``plan``: the tensors instead of the model's (an engine's own model,
    e.g. vLLM's); ``boxes_of(info)``: an engine's own boxes of a values or kept tensor (None: the rule above).

    Raises:
        ValueError: ``rank`` outside ``[0, tp * ep)``; a layout with ``fsdp`` or ``pp``; a row-parallel K
            split not a multiple of 32 for an MXFP8 tensor; head counts vLLM refuses for ``tp``.
    """

    if layout.fsdp != 1 or layout.pp != 1:
        raise ValueError(f"engine layout {layout}: an engine rank is cut by tp and ep only")
    if not (type(rank) is int and 0 <= rank < layout.tp * layout.ep):
        raise ValueError(f"rank must be an int in [0, {layout.tp * layout.ep}) for engine layout {layout}, "
                         f"got {rank!r}")
    config = getattr(model, "config", None)
    if kv_heads is None:
        kv_heads = getattr(config, "num_key_value_heads", None)
    problem = attention_problem(layout.tp, getattr(config, "num_attention_heads", None), kv_heads)
    if problem:
        raise ValueError(f"engine layout {layout}: {problem}")
    plan = plan if plan is not None else receiver_plan(model)[0]
    out: list[Holding] = []
    values: list[Holding] = []
    for e in plan.entries:
        info = TensorInfo(e.name, e.role, e.dtype, tuple(e.shape))
        if e.role == "scales" and values:
            boxes = [scales_box(v.box, v.tensor.shape, name=v.tensor.name, whole_blocks=True) for v in values]
        else:
            boxes = (boxes_of(info) if boxes_of is not None else None) or engine_boxes(
                e.name, info.shape, layout, rank, kv_heads, e.role == "values")
        held = [Holding(info, box) for box in boxes]
        out += held
        values = held if e.role == "values" else []
    return out


_MERGED = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|weight_scale)$")
_MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _stackable(members: Sequence[Holding | None]) -> bool:
    """Whether the holdings can be row blocks of one buffer: all there, of one dtype and rank >= 2, equal in
    every dimension but the rows (dim ``-2``)."""
    if any(x is None for x in members):
        return False
    first = members[0].box.shape
    return all(x.tensor.dtype == members[0].tensor.dtype and len(x.box.shape) == len(first) >= 2
               and x.box.shape[:-2] == first[:-2] and x.box.shape[-1] == first[-1] for x in members)


def _merge_groups(holdings: Sequence[Holding]) -> list[list[Holding]]:
    """Holdings cut from one vLLM merged buffer, each group in row order: q/k/v, gate/up of one layer, and the
    several holdings of one tensor (a fused gate_up at tp > 1)."""
    by_name: dict[str, list[Holding]] = {}
    for h in holdings:
        by_name.setdefault(h.tensor.name, []).append(h)
    groups = [held for held in by_name.values() if len(held) > 1 and _stackable(held)]
    for h in holdings:
        m = _MERGED.match(h.tensor.name)
        if not m or m.group(2) not in ("q_proj", "gate_proj"):
            continue
        parts = _MERGED_PARTS["qkv_proj" if m.group(2) == "q_proj" else "gate_up_proj"]
        found = [by_name.get(f"{m.group(1)}.{p}.{m.group(3)}", []) for p in parts]
        members = [x[0] if len(x) == 1 else None for x in found]
        if _stackable(members) and len(h.box.shape) == 2:
            groups.append(members)
    return groups


def engine_buffers(holdings: Sequence[Holding], device: str | torch.device = "cpu",
                   dtype_of: Callable[[TensorInfo], torch.dtype] | None = None) -> Local:
    """An engine rank's own zero-filled tensors for ``holdings``: ``{name: (box, tensor)}`` (a list of them
    for several boxes of one tensor). q/k/v of one attention, gate/up of one MLP and a fused gate_up's two
    boxes are row views of ONE merged buffer, as vLLM holds them. ``dtype_of(info)``: a buffer's dtype
    (default: the plan's)."""
    dtype_of = dtype_of or (lambda info: dtype_from_name(info.dtype))
    views: dict[Holding, torch.Tensor] = {}
    for group in _merge_groups(holdings):
        first = group[0].box.shape
        rows = [h.box.shape[-2] for h in group]
        merged = torch.zeros((*first[:-2], sum(rows), first[-1]), dtype=dtype_of(group[0].tensor),
                             device=device)
        for h, view in zip(group, torch.split(merged, rows, dim=-2), strict=True):
            views[h] = view
    entries: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    for h in holdings:
        t = views.get(h)
        if t is None:
            t = torch.zeros(h.box.shape, dtype=dtype_of(h.tensor), device=device)
        entries.setdefault(h.tensor.name, []).append((h.box, t))
    return {n: held[0] if len(held) == 1 else held for n, held in entries.items()}
