""":class:`ShardedTrainerSource`: the trainer side of a sharded refit for a ``DTensor`` model (FSDP2, tensor
parallel, plain tensors held whole)."""

from __future__ import annotations

import torch
from torch import nn

from ...export import export_components
from ...nn import plain_float
from ...quantize import quantize
from ...sources.dtensor import gather_dims, is_dtensor, local_and_offset, normalized_placement, quantize_local
from ..mesh import Box, Holding, Local, checked_local, scales_box, tensor_infos
from .whole import TrainerSource, kept_wire_dtype


def _dtensor_box(t) -> Box:
    """This rank's box of a ``DTensor``, checked to be a range of the full tensor per dimension."""
    placements = tuple(normalized_placement(p, t.dim()) for p in t.placements)
    gather_dims(tuple(t.shape), tuple(t.device_mesh.shape), placements)  # refuses shards that are not ranges
    local, offset = local_and_offset(t, placements)
    return Box(offset, tuple(o + s for o, s in zip(offset, local.shape, strict=True)))


class ShardedTrainerSource:
    """The trainer side of a sharded refit for one rank of a ``DTensor`` model (``Shard`` / ``_StridedShard``
    placements whose shards are ranges, ``Replicate``, plain tensors held whole); ``policy``, ``fp8_dtype``,
    ``kept_dtype``, ``kernel`` as for :class:`~mxport.refit.TrainerSource`, whose plan it has.

    Boxes (:attr:`holdings`): the local shard's; scales, its rows and every block it overlaps (a block that
    straddles K shards is quantized from the gathered K and held by both). Every byte is that of quantizing
    the full tensor, cut with the box."""

    def __init__(self, model: nn.Module, policy=None, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 kept_dtype: torch.dtype | None = None, kernel: str | None = None):
        base = TrainerSource(model, policy, fp8_dtype=fp8_dtype, kept_dtype=kept_dtype, kernel=kernel)
        self.fp8_dtype, self.kept_dtype, self.kernel = fp8_dtype, kept_dtype, kernel
        self.plan = base.plan  # the global plan: full shapes
        self._tensors = list(zip(base.tensors_by_name, base.quantized, strict=True))
        infos = tensor_infos((e.name, e.role, e.dtype, e.shape) for e in self.plan.entries)
        held, i = [], 0
        for (_, t), q in self._tensors:
            values = _dtensor_box(t) if is_dtensor(t) else Box.full(infos[i].shape)
            held.append(Holding(infos[i], values))
            if q:
                held.append(Holding(infos[i + 1], scales_box(values, infos[i].shape)))
            i += 2 if q else 1
        self.holdings: list[Holding] = held

    @torch.no_grad()
    def local(self) -> Local:
        """``{name: (box, tensor)}`` of this rank's current bytes, once per refit; a collective where a
        ``DTensor`` needs a gather."""
        out: Local = {}
        held = iter(self.holdings)
        for (_, t), q in self._tensors:
            h = next(held)
            if q:
                s = next(held)
                if is_dtensor(t):
                    c = quantize_local(t, self.fp8_dtype, kernel=self.kernel)
                elif plain_float(t):
                    c = quantize(t.detach(), self.fp8_dtype, kernel=self.kernel)
                else:
                    c = export_components(t.data if isinstance(t, nn.Parameter) else t)
                out[h.tensor.name] = (h.box, checked_local(c.data, h))
                out[s.tensor.name] = (s.box, checked_local(c.scale_inv, s))
            else:
                x = t.detach()
                x = x.to_local() if is_dtensor(x) else x
                want = kept_wire_dtype(x, self.kept_dtype)
                out[h.tensor.name] = (h.box, checked_local(x.to(want).contiguous(), h))
        return out


