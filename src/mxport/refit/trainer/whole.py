""":class:`TrainerSource`: a whole model's plan, and per refit its tensors, quantized lazily (optionally
straight into a send buffer laid out as the byte stream)."""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from ...components import compact_scale_shape
from ...export import export_components
from ...nn import plain_float
from ...policy import PrecisionPolicy
from ...quantize import quantize
from ...quants import MXFP8, get_quant
from ...sources.discover import is_mxfp8_producer
from ...sources.dtensor import is_dtensor
from ..arena import adopt, adoptable, allocate_targets, storage_users, stream_arena
from ..buckets import ChunkSums, checksum
from ..items import model_tensors, tensor_items
from ..plan import RefitPlan

#: elements of consecutive weights :meth:`TrainerSource.tensors` quantizes in one batched call (the first
#: weight of a batch may be larger)
BATCH_NUMEL = 1 << 22


def kept_wire_dtype(t: torch.Tensor, kept_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a kept tensor travels in: ``kept_dtype`` for floating-point tensors, else its own."""
    return kept_dtype if kept_dtype is not None and t.is_floating_point() else t.dtype


def _whole(t):
    """``t`` whole: a DTensor gathered with ``full_tensor()`` (a collective over its mesh)."""
    return t.full_tensor() if is_dtensor(t) else t


class TrainerSource:
    """The trainer side: the plan (built once) and, per refit, the tensors to send in plan order.

    Args:
        model: the trainer's model (master weights, or native MXFP8 storage exported as is); DTensor
            parameters are gathered whole, a collective: every rank of their mesh iterates :meth:`tensors`
            together.
        policy: a :class:`mxport.policy.PrecisionPolicy` (None: linear weights MXFP8, the rest kept).
        fp8_dtype, kept_dtype: the quantized weights' element format; the kept tensors' dtype (the receiver's;
            None: their own).
        kernel: the quantize kernel (None = the fastest that takes each weight; all give the same bytes).
        arena: keep one send buffer laid out as the byte stream, so no bucket is packed: weights are quantized
            into it, kept tensors that own their storage in the planned dtype are *adopted* (``.data`` rebound
            to their view: same objects, new addresses, so build it before capturing CUDA graphs), the rest
            copied in at each refit. Enables :meth:`stream_checksum`.
        quant: the weights' format (:mod:`mxport.quants`): ``"mxfp8"``, or ``"mxfp4"`` / ``"nvfp4"`` (packed
            values, block scales and NVFP4's global scale, shared where vLLM fuses as export shares it:
            :func:`mxport.fp4_linear.shared_global_scales`; whole models of plain float weights only).

    Weights travel as values and rowwise E8M0 scales, rceil as :func:`mxport.quantize`; native storage as is.
    """

    def __init__(self, model: nn.Module, policy=None, *,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, kept_dtype: torch.dtype | None = None,
                 arena: bool = False, kernel: str | None = None, quant: str = "mxfp8"):
        policy = PrecisionPolicy() if policy is None else policy
        self.quant = get_quant(quant)
        self.model, self.fp8_dtype, self.kept_dtype = model, fp8_dtype, kept_dtype
        self.tensors_by_name = model_tensors(model)
        self.kernel = kernel
        # native MXFP8 storage (TE, torchao, Megatron): its plan items come from its components
        native = {n: export_components(t) for n, t in self.tensors_by_name if is_mxfp8_producer(t)}
        decisions = policy.decide_all([(n, tuple(native[n].shape), native[n].data.dtype) if n in native else
                                       (n, tuple(t.shape), t.dtype) for n, t in self.tensors_by_name])
        self.quantized = [d.name in native or d.quantize for d in decisions]
        if native and self.quant is not MXFP8:
            raise ValueError(f"native MXFP8 storage ({next(iter(native))}) travels as MXFP8, not "
                             f"{self.quant.name}")
        items, self._width = [], []  # _width: plan entries per model tensor
        for (name, t), q in zip(self.tensors_by_name, self.quantized, strict=True):
            n = len(items)
            if name in native:  # native MXFP8 storage travels in its own element format
                c = native[name]
                items += tensor_items(name, c.fp8_dtype, c.shape, scales=(torch.uint8, c.scale_inv.shape))
            elif q:
                items += self._weight_items(name, t)
            else:
                items += tensor_items(name, kept_wire_dtype(t, kept_dtype), t.shape)
            self._width.append(len(items) - n)
        self.plan = RefitPlan(items)
        first, t = self.tensors_by_name[0]  # the plan has a tensor: the device of the first (its values')
        self._device = native[first].data.device if first in native else t.device
        self.arena = bool(arena)
        self._slots: list[torch.Tensor] | None = self._arena_slots() if self.arena else None
        self._complete = False  # the last tensors() call ran to its end (stream_crc32 covers a whole refit)
        self._sums = ChunkSums(self.plan, self._device) if self.arena else None  # summed as written
        self._starts = [e.offset for e in self.plan.entries]
        self._stream = stream_arena(self.plan, self._slots) if self.arena else None  # the buffer, flat
        self._summed, self._yielded = [False] * len(self.plan), 0  # by the current tensors() call

    def _weight_items(self, name: str, t: torch.Tensor) -> list:
        """The plan items of a weight quantized here: MXFP8 values and E8M0 scales, or the 4-bit record's."""
        q = self.quant
        if q is MXFP8:
            return tensor_items(name, self.fp8_dtype, t.shape,
                                scales=(torch.uint8, compact_scale_shape(t.shape, "rowwise")))
        if not q.aligned(t.shape[-1] if t.dim() else 0) or t.dim() != 2:
            raise ValueError(f"{name}: a {q.name} weight must be 2-D with K a multiple of {q.block}, got "
                             f"{list(t.shape)} (keep it with the policy)")
        return tensor_items(name, torch.uint8, q.values_shape(t.shape),
                            scales=(q.scale_dtype, q.scale_shape(t.shape)), global_scale=q.global_scale)

    @torch.no_grad()
    def _arena_slots(self) -> list[torch.Tensor]:
        """Per plan entry, its view of the send buffer; adopts the kept tensors it can."""
        slots = allocate_targets(self.plan, self._device)
        users = storage_users(self.model)
        i = 0
        for (_, t), q, width in zip(self.tensors_by_name, self.quantized, self._width, strict=True):
            if not q and adoptable(t, slots[i], users):
                adopt(t, slots[i])
            i += width
        return slots

    def stream_crc32(self) -> int:
        """``zlib.crc32`` of the send buffer now: right after a refit of a complete :meth:`tensors` call, what
        a receiver's ``live_crc32`` must equal. ValueError without ``arena=True`` or a complete call."""
        if not self.arena or not self._complete:
            raise ValueError("stream_crc32() needs TrainerSource(arena=True) and a tensors() call that ran "
                             "to its end (a complete refit) before it")
        stream = stream_arena(self.plan, self._slots)
        return 0 if stream is None else zlib.crc32(stream.cpu().numpy())

    @torch.no_grad()
    def tensors(self) -> Iterator[torch.Tensor]:
        """Yield the current weights in plan order, quantized lazily; with ``arena``, views of the send buffer
        (adopted kept ones *are* the parameters)."""
        slots = self._slots
        self._complete = False
        self._summed, self._yielded = [False] * len(self.plan), 0
        if self._sums is not None:
            self._sums.reset()
        i = ready = 0  # ready: entries before it hold this call's quantized bytes in their slots already
        fp4_globals = self._fp4_globals()
        for idx, ((name, t), q) in enumerate(zip(self.tensors_by_name, self.quantized, strict=True)):
            if q and self.quant is not MXFP8:
                yield from self._fp4_parts(i, _whole(t).detach(), fp4_globals.get(name))
                i += self._width[idx]
            elif q:
                if slots is not None and plain_float(t):
                    if idx >= ready:  # this weight and the plain-float weights right after it, in one batch
                        ready = self._quantize_run(idx, i)
                    self._yielded = i + 1
                    yield slots[i]
                    self._yielded = i + 2
                    yield slots[i + 1]
                else:
                    w = _whole(t)
                    c = (quantize(w.detach(), self.fp8_dtype, kernel=self.kernel) if plain_float(w)
                         else export_components(w.data if isinstance(w, nn.Parameter) else w))
                    for j, part in ((i, c.data), (i + 1, c.scale_inv)):
                        if (slots is not None and part.dtype == slots[j].dtype
                                and part.shape == slots[j].shape):
                            part = self._copy_in(j, part)  # native storage: into the send buffer too
                        self._yielded = j + 1
                        yield part.contiguous()
                i += 2
            else:
                x = _whole(t).detach()
                want = kept_wire_dtype(x, self.kept_dtype)
                if slots is not None and x.shape == slots[i].shape and want == slots[i].dtype:
                    if x.data_ptr() != slots[i].data_ptr() or x.dtype != slots[i].dtype:  # not adopted
                        self._copy_in(i, x)  # copy (and cast) in
                    self._yielded = i + 1
                    yield slots[i]
                else:  # a tensor that drifted from the plan goes out as is: the sender refuses it
                    self._yielded = i + 1
                    yield (x.to(want) if x.dtype != want else x).contiguous()
                i += 1
        self._complete = True

    def _fp4_globals(self) -> dict[str, torch.Tensor]:
        """This refit's NVFP4 global scales (one pass over the quantized weights); {} for other formats."""
        if not self.quant.global_scale:
            return {}
        from ...fp4_linear import shared_global_scales

        return shared_global_scales({n: _whole(t) for (n, t), q in zip(self.tensors_by_name, self.quantized,
                                                                      strict=True) if q}, self.quant)

    def _fp4_parts(self, i: int, w: torch.Tensor, global_scale) -> Iterator[torch.Tensor]:
        """Quantize one weight to the 4-bit record and yield its plan entries ``i, i + 1[, i + 2]`` (copied
        into the send buffer and summed, with ``arena``)."""
        q = self.quant.quantize(w, global_scale=global_scale)
        parts = [q.values, q.scale] + ([q.global_scale.reshape(1)] if self.quant.global_scale else [])
        for j, part in enumerate(parts, start=i):
            if self._slots is not None:
                part = self._copy_in(j, part)
            self._yielded = j + 1
            yield part.contiguous()

    def _copy_in(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Copy (and cast) ``x`` into entry ``i``'s slot, summing its bytes as they are written."""
        self._sums.copy_in(self._slots[i], x, self.plan.entries[i].offset)
        self._summed[i] = True
        return self._slots[i]

    def _quantize_run(self, idx: int, i: int) -> int:
        """Quantize entry ``idx`` (slots ``i``, ``i + 1``) and the plain-float weights after it, up to
        :data:`BATCH_NUMEL` elements, in one ``quantize_many`` call; return the first entry not done."""
        from ...quantize import quantize_many

        xs, outs, entries, numel, end = [], [], [], 0, idx
        while (end < len(self.quantized) and self.quantized[end] and (end == idx or numel < BATCH_NUMEL)
               and plain_float(t := self.tensors_by_name[end][1])):
            xs.append(t.detach())
            outs.append((self._slots[i], self._slots[i + 1]))
            entries.append(i)
            numel, end, i = numel + t.numel(), end + 1, i + 2
        offsets = [(self.plan.entries[j].offset, self.plan.entries[j + 1].offset) for j in entries]
        quantize_many(xs, self.fp8_dtype, outs=outs, kernel=self.kernel, sums=self._sums, offsets=offsets)
        for j in entries:
            self._summed[j] = self._summed[j + 1] = True
        return end

    def stream_checksum(self, start: int, size: int) -> int:
        """The refit checksum of the stream bytes ``[start, start + size)`` the current :meth:`tensors` call
        has yielded (``send(..., checksums=source.stream_checksum)``): for whole ``SUM_CELL`` cells only the
        adopted tensors are read, the rest was summed as it was written.

        Raises:
            ValueError: without ``arena=True``, a range outside the stream or not on 8-byte words.
            RuntimeError: a tensor of the range not yielded yet.
        """
        if self._sums is None:
            raise ValueError("stream_checksum() needs TrainerSource(arena=True)")
        end = start + size
        if start < 0 or size < 0 or end > self.plan.total_bytes:
            raise ValueError(f"stream range {start}+{size} falls outside the plan's {self.plan.total_bytes} "
                             "bytes")
        if start % 8 or size % 8:
            raise ValueError(f"stream range {start}+{size} must start and end on 8-byte words (the checksum "
                             "sums int64 words)")
        first, last = bisect.bisect_right(self._starts, start) - 1, bisect.bisect_left(self._starts, end) - 1
        if last >= self._yielded:
            raise RuntimeError(f"stream bytes {start}..{end}: tensor {self.plan.entries[last].name!r} has "
                               "not been produced yet by tensors()")
        if not self._sums.covers(start, size):
            return checksum(self._stream[start:end])
        entries = self.plan.entries
        runs: list[list[int]] = []  # runs of consecutive entries not summed yet (only zero padding between)
        joined = False
        for i in range(max(first, 0), last + 1):
            e = entries[i]
            lo, hi = max(e.offset, start), min(e.offset + e.nbytes, end)
            if self._summed[i] or hi <= lo:
                joined = joined and hi <= lo
            elif joined:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
                joined = True
        return self._sums.checksum(start, size, [(self._stream[a:b], a) for a, b in runs])
