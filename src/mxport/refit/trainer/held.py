""":class:`HeldTensorsSource`: the trainer side of a sharded refit from the named tensors (or ranges of one
dimension of them) a rank holds."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ...components import compact_scale_shape
from ...policy import PrecisionPolicy
from ...quantize import quantize
from ..items import model_tensors, tensor_items
from ..mesh import Box, Holding, Local, checked_local, scales_box, tensor_infos
from .whole import kept_wire_dtype


@dataclass(frozen=True)
class HeldItem:
    """What one item holds: its ``box`` of tensor ``name`` of full shape ``full_shape``, in ``dtype``."""

    name: str
    dtype: torch.dtype
    box: Box
    full_shape: tuple[int, ...]


def _held_item(obj, i: int) -> tuple[HeldItem, torch.Tensor]:
    """One checked ``(name, tensor[, dim, start, full_size])`` item: what it holds, and the tensor."""
    if not isinstance(obj, tuple) or len(obj) not in (2, 5):
        raise ValueError(f"items() item {i}: expected (hf_name, tensor) or (hf_name, tensor, dim, start, "
                         f"full_size), got {type(obj).__name__} {obj!r:.80}")
    name, t = obj[0], obj[1]
    if not isinstance(name, str) or not name:
        raise ValueError(f"items() item {i}: the name must be a non-empty str, got {name!r}")
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        raise TypeError(f"items() {name!r}: expected a tensor of at least one dimension, got "
                        f"{type(t).__name__}")
    if len(obj) == 2:
        return HeldItem(name, t.dtype, Box.full(t.shape), tuple(t.shape)), t
    dim, start, full = obj[2:]
    if not all(type(v) is int for v in (dim, start, full)) or not -t.dim() <= dim < t.dim():
        raise ValueError(f"items() {name!r}: dim, start, full_size must be ints with dim in "
                         f"[{-t.dim()}, {t.dim()}), got {obj[2:]}")
    dim %= t.dim()
    if start < 0 or start + t.shape[dim] > full:
        raise ValueError(f"items() {name!r}: [{start}, {start + t.shape[dim]}) of dimension {dim} lies "
                         f"outside its full size {full}")
    shape = list(t.shape)
    shape[dim] = full
    return HeldItem(name, t.dtype, Box.along(shape, dim, start, start + t.shape[dim]), tuple(shape)), t


def _held_items(items: Callable[[], Iterable]) -> list[HeldItem]:
    """What ``items()`` holds, item by item (the tensors are not kept)."""
    out, seen = [], set()
    for i, obj in enumerate(items()):
        h, _ = _held_item(obj, i)
        if h.name in seen:
            raise ValueError(f"items() yields {h.name!r} twice")
        seen.add(h.name)
        out.append(h)
    return out


def _full_entries(names_and_shapes, held: list[HeldItem], policy) -> list[tuple[str, tuple, torch.dtype]]:
    """The model's full list of ``(name, shape, dtype)`` the policy decides on."""
    if names_and_shapes is None:
        if policy.keep_last or policy.include or policy.exclude:
            raise ValueError("HeldTensorsSource: a policy with keep_last / include / exclude decides on the "
                             "whole model (layer count, shared precision groups): pass names_and_shapes")
        return [(h.name, h.full_shape, h.dtype) for h in held]
    if isinstance(names_and_shapes, nn.Module):
        return [(n, tuple(t.shape), t.dtype) for n, t in model_tensors(names_and_shapes)]
    return [(n, tuple(int(s) for s in shape), dtype) for n, shape, dtype in names_and_shapes]


class HeldTensorsSource:
    """The trainer side of a sharded refit for a rank that holds named tensors, not a ``DTensor`` model.

    Args:
        items: a callable returning ``(hf_name, tensor)`` (held whole) or ``(hf_name, tensor, dim, start,
            full_size)`` items (``[start, start + tensor.shape[dim])`` of dimension ``dim``); called here and
            once per :meth:`local`, with the same names, shapes and dtypes.
        names_and_shapes: the WHOLE model's ``(name, full shape, dtype)`` (or an ``nn.Module``, e.g. on the
            meta device) for the policy; None: this rank's, for a policy without keep_last / include /
            exclude.
        policy, fp8_dtype, kept_dtype, kernel: as for :class:`~mxport.refit.TrainerSource`.

    A slice along K must be whole blocks of 32 (else ValueError). Bytes are the full tensor's, cut with the
    box.
    """

    def __init__(self, items: Callable[[], Iterable], *, names_and_shapes=None, policy=None,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, kept_dtype: torch.dtype | None = None,
                 kernel: str | None = None):
        policy = PrecisionPolicy() if policy is None else policy
        self.items, self.fp8_dtype, self.kept_dtype, self.kernel = items, fp8_dtype, kept_dtype, kernel
        held = _held_items(items)
        entries = _full_entries(names_and_shapes, held, policy)
        decisions = {d.name: d for d in policy.decide_all(entries)}
        self.holdings: list[Holding] = []
        self._spec: dict[str, tuple[HeldItem, list[Holding]]] = {}  # by name: as at construction, holdings
        for h in held:
            d = decisions.get(h.name)
            if d is None or d.shape != h.full_shape:
                raise ValueError(f"items() yields {h.name!r} of full shape {h.full_shape}, which "
                                 f"names_and_shapes {'lacks' if d is None else f'gives as {d.shape}'}")
            if d.quantize and not h.dtype.is_floating_point:
                raise TypeError(f"{h.name!r}: the policy quantizes it but items() yields {h.dtype}")
            self._spec[h.name] = (h, self._holdings_of(h, d.quantize))
            self.holdings += self._spec[h.name][1]

    def _holdings_of(self, h: HeldItem, quantized: bool) -> list[Holding]:
        if not quantized:
            kept = self.kept_dtype if self.kept_dtype is not None and h.dtype.is_floating_point else h.dtype
            infos = tensor_infos(tensor_items(h.name, kept, h.full_shape))
            return [Holding(infos[0], h.box)]
        sshape = compact_scale_shape(h.full_shape, "rowwise")
        items = tensor_items(h.name, self.fp8_dtype, h.full_shape, scales=(torch.uint8, sshape))
        values, scales = tensor_infos(items)
        return [Holding(values, h.box), Holding(scales, scales_box(h.box, h.full_shape, name=h.name,
                                                                   whole_blocks=True))]

    def held_names(self) -> frozenset[str]:
        """The names this rank holds (all or part of), as vLLM's ``WeightSource.held_names()``."""
        return frozenset(self._spec)

    @torch.no_grad()
    def local(self) -> Local:
        """``{name: (box, tensor)}`` of this rank's current bytes, one pass over ``items()``; ValueError when
        they differ from construction."""
        out: Local = {}
        for i, obj in enumerate(self.items()):
            h, t = _held_item(obj, i)
            if h.name not in self._spec or h.name in out:
                raise ValueError(f"items() now yields {h.name!r} "
                                 f"{'twice' if h.name in out else 'which it did not at construction'}")
            first, held = self._spec[h.name]
            if h != first:
                raise ValueError(f"items() now yields {h.name!r} as {h.box} of {h.full_shape} {h.dtype}, "
                                 f"at construction {first.box} of {first.full_shape} {first.dtype}")
            x = t.detach()
            if len(held) == 2:
                c = quantize(x, self.fp8_dtype, kernel=self.kernel)
                for part, hd in zip((c.data, c.scale_inv), held, strict=True):
                    out[hd.tensor.name] = (hd.box, checked_local(part, hd))
            else:
                want = kept_wire_dtype(x, self.kept_dtype)
                out[h.name] = (h.box, checked_local(x.to(want).contiguous(), held[0]))
        missing = [h.tensor.name for _, held in self._spec.values() for h in held if h.tensor.name not in out]
        if missing:
            raise ValueError(f"items() no longer yields {missing[:5]}")
        return out


