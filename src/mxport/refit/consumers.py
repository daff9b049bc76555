"""Both ends of a model refit: the trainer's plan and tensors (from its high-precision model and the precision
policy) and the inference model's plan and live targets (its :class:`~mxport.nn.MXFP8Linear` buffers and kept
tensors), plus an iterator of ``(hf_name, tensor)`` pairs in checkpoint format for engines' own loaders.

Canonical order (both sides derive it independently, so the plan digests agree):
``model.named_modules()`` order; inside a module its own parameters and persistent buffers sorted by local name,
the E8M0 scales right after their values; a tensor shared by several modules (tied embeddings) appears once, at
its first name. Names are the modelopt checkpoint names (``<m>.weight`` values, ``<m>.weight_scale`` scales), which
are also ``MXFP8Linear``'s ``state_dict()`` names.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..checkpoint.naming import FORMATS, scale_name
from ..components import compact_scale_shape
from ..formats import is_fp8_dtype
from .plan import RefitPlan

#: plan tensor names follow the modelopt checkpoint (also MXFP8Linear state_dict names)
PLAN_NAMING = "modelopt"


def model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter and persistent buffer of ``model`` in canonical order (see module
    doc); shared tensors once. Non-persistent buffers (rotary ``inv_freq``, caches) are not part of a refit."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for prefix, mod in model.named_modules():
        local = dict(mod.named_parameters(recurse=False))
        for n, b in mod.named_buffers(recurse=False):
            if b is not None and n not in mod._non_persistent_buffers_set:
                local[n] = b
        for n in sorted(local):
            t = local[n]
            if id(t) in seen:
                continue
            seen.add(id(t))
            out.append((f"{prefix}.{n}" if prefix else n, t))
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.data if isinstance(t, nn.Parameter) else t


def _kept_dtype(t: torch.Tensor, kept_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a kept tensor travels in: ``kept_dtype`` for floating-point tensors, else its own (integer and
    bool buffers are never cast)."""
    return kept_dtype if kept_dtype is not None and t.is_floating_point() else t.dtype


def _storage_users(model: nn.Module) -> dict[int, int]:
    """Storage address -> how many of ``model``'s parameters and buffers (non-persistent ones too) use it; plain
    tensors only (wrapper subclasses such as torchao's MXTensor or TE's MXFP8 storage have no plain storage)."""
    users: dict[int, int] = {}
    seen: set[int] = set()
    for t in (*model.parameters(), *model.buffers()):
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        raw = _raw(t)
        if type(raw) is torch.Tensor:
            ptr = raw.untyped_storage().data_ptr()
            users[ptr] = users.get(ptr, 0) + 1
    return users


def _adoptable(t: torch.Tensor, slot: torch.Tensor, users: dict[int, int]) -> bool:
    """True when ``t`` can move into ``slot`` (its view of an arena): a plain tensor with ``slot``'s dtype, shape
    and device that owns its whole storage and shares it with no other tensor of the model."""
    raw = _raw(t)
    return (type(raw) is torch.Tensor and raw.dtype == slot.dtype and raw.shape == slot.shape
            and raw.device == slot.device and raw.nbytes > 0 and raw.is_contiguous() and raw.storage_offset() == 0
            and raw.untyped_storage().nbytes() == raw.nbytes and users.get(raw.untyped_storage().data_ptr()) == 1)


@torch.no_grad()
def _adopt(t: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy ``t``'s bytes into ``slot`` and make ``slot`` its storage (``t.data = slot``): the same tensor object
    (parameter, buffer), its autograd identity and version counter unchanged, now living in the arena."""
    slot.copy_(_raw(t))
    t.data = slot


class TrainerSource:
    """The trainer side: the plan (built once) and, per refit, the tensors to send in plan order.

    Args:
        model: the trainer's model with high-precision master weights (or native MXFP8 storage, exported as is).
        policy: a :class:`mxport.policy.PrecisionPolicy` (None = default: linear weights MXFP8; embeddings,
            lm_head, norms, routers kept).
        bucket_bytes: payload bytes per bucket.
        fp8_dtype: element format of quantized weights.
        kept_dtype: dtype kept tensors travel in (must be the receiver's); None = their own dtype.
        arena: keep one send buffer laid out as the whole plan's byte stream (:func:`allocate_targets` on the
            weights' device, ``plan.total_bytes``, allocated here) so that :class:`~mxport.refit.RefitSender` sends
            every bucket straight from it, without packing, and nothing is allocated per refit. Quantized weights
            are written into it by ``quantize(..., out=...)``. A kept tensor (embedding, norms) that owns its whole
            storage alone (no other parameter or buffer of the model, persistent or not, shares it) and already has
            the planned dtype and the buffer's device is *adopted*, here: its bytes are copied in and its ``.data``
            becomes its view of the buffer (like Megatron's contiguous parameter buffer), so the optimizer updates
            it in place there and a refit never copies it; the parameter objects, their values, gradients and the
            optimizer's references are unchanged, their addresses are not — build the source before capturing CUDA
            graphs of the training step (a graph captured earlier keeps writing the old, freed storage). Any other
            kept tensor (another dtype, a view of a larger storage, one whose ``.data`` was replaced since) and
            any weight exported from native MXFP8 storage are copied in at every refit. References to an adopted
            tensor's old storage taken before (a ``p.data`` kept elsewhere) no longer follow the parameter, and
            ``torch.save`` of an adopted tensor (or of a ``state_dict``) writes the whole send buffer it is a view
            of, once (``save_pretrained`` / safetensors write each tensor's own bytes). Costs about the model's
            refit size for the trainer's lifetime, less the adopted tensors' old storage; off by default.

    Quantized tensors travel as values (``fp8_dtype``, the weight's shape) and rowwise E8M0 scales (uint8,
    ``(*shape[:-1], ceil(K/32))``); quantization follows :func:`mxport.quantize` (rceil).
    """

    def __init__(self, model: nn.Module, policy=None, *, bucket_bytes: int,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, kept_dtype: torch.dtype | None = None,
                 arena: bool = False):
        from ..policy import PrecisionPolicy

        policy = PrecisionPolicy() if policy is None else policy
        self.model, self.fp8_dtype, self.kept_dtype = model, fp8_dtype, kept_dtype
        self.tensors_by_name = model_tensors(model)
        decisions = policy.decide_all([(n, tuple(t.shape), t.dtype) for n, t in self.tensors_by_name])
        self.quantized = [d.quantize for d in decisions]
        items = []
        for (name, t), q in zip(self.tensors_by_name, self.quantized, strict=True):
            if q:
                items.append((name, "values", fp8_dtype, tuple(t.shape)))
                items.append((scale_name(name, PLAN_NAMING), "scales", torch.uint8,
                              compact_scale_shape(t.shape, "rowwise")))
            else:
                items.append((name, "kept", _kept_dtype(t, kept_dtype), tuple(t.shape)))
        self.plan = RefitPlan(items, bucket_bytes)
        self.arena = bool(arena)
        self._slots: list[torch.Tensor] | None = self._arena_slots() if self.arena else None
        self._complete = False  # the last tensors() call ran to its end (stream_crc32 covers a whole refit)

    @torch.no_grad()
    def _arena_slots(self) -> list[torch.Tensor]:
        """Per plan entry, its view of the send buffer (the whole stream); adopts the kept tensors it can (see
        ``arena`` in the class doc)."""
        slots = allocate_targets(self.plan, self.tensors_by_name[0][1].device)
        users = _storage_users(self.model)
        i = 0
        for (_, t), q in zip(self.tensors_by_name, self.quantized, strict=True):
            if not q and _adoptable(t, slots[i], users):
                _adopt(t, slots[i])
            i += 2 if q else 1
        return slots

    def stream_crc32(self) -> int:
        """CRC-32 (``zlib.crc32``) of the send buffer as it is now, laid out as the plan's byte stream (padding
        zero): right after a refit of a complete :meth:`tensors` call, and before the trainer changes its weights
        again (the adopted kept tensors live in the buffer), it is the CRC of what was sent — the value a
        receiver's :meth:`~mxport.refit.RefitReceiver.live_crc32` must equal. Computed outside the refit (about
        3 GB/s on CPU), so a bit-exactness check does not slow the send. 0 for a plan of empty tensors.

        Raises:
            ValueError: without ``arena=True``, or when no :meth:`tensors` call has run to its end.
        """
        import zlib

        if not self.arena or not self._complete:
            raise ValueError("stream_crc32() needs TrainerSource(arena=True) and a tensors() call that ran to its "
                             "end (a complete refit) before it")
        from .buckets import stream_arena

        stream = stream_arena(self.plan, self._slots)
        return 0 if stream is None else zlib.crc32(stream.cpu().numpy())

    @torch.no_grad()
    def tensors(self) -> Iterator[torch.Tensor]:
        """Yield the current weights in plan order, quantizing lazily (one weight at a time). With ``arena`` the
        yielded tensors are views of the send buffer: quantized ones hold this call's bytes until the next call,
        adopted kept ones *are* the trainer's parameters (they change when the optimizer steps)."""
        from ..nn import _plain_float, weight_components
        from ..quantize import quantize

        slots = self._slots
        self._complete = False
        i = 0
        for (_, t), q in zip(self.tensors_by_name, self.quantized, strict=True):
            if q:
                if slots is not None and _plain_float(t):
                    quantize(t.detach(), self.fp8_dtype, out=(slots[i], slots[i + 1]))
                    yield slots[i]
                    yield slots[i + 1]
                else:
                    c = weight_components(t, self.fp8_dtype)
                    for j, part in ((i, c.data), (i + 1, c.scale_inv)):
                        if slots is not None and part.dtype == slots[j].dtype and part.shape == slots[j].shape:
                            part = slots[j].copy_(part)  # native storage: into the send buffer too (one copy)
                        yield part.contiguous()
                i += 2
            else:
                x = t.detach()
                want = _kept_dtype(x, self.kept_dtype)
                if slots is not None and x.shape == slots[i].shape and want == slots[i].dtype:
                    slot = slots[i]
                    if x.data_ptr() != slot.data_ptr() or x.dtype != slot.dtype:  # not adopted: copy (and cast) in
                        slot.copy_(x)
                    yield slot
                else:  # (a tensor whose dtype or shape drifted from the plan goes out as is: the sender refuses it)
                    yield (x.to(want) if x.dtype != want else x).contiguous()
                i += 1
        self._complete = True

def receiver_plan(model: nn.Module, bucket_bytes: int, *, arena: bool = False
                  ) -> tuple[RefitPlan, list[torch.Tensor]]:
    """The inference side: the plan derived from the live model and its live tensors (the refit targets).

    FP8 tensors are "values"; the uint8 tensor named ``scale_name(values)`` in the same module is their "scales";
    everything else is "kept". The returned tensors are ``detach()`` aliases of the module's own buffers /
    parameters (not copies): they share storage *and* version counter, so a refit's in-place writes bump the
    module tensors' ``_version`` and derived caches (an MXFP8Linear's decoded weight) follow. (``.data`` aliases
    would not: they get a version counter of their own.)

    ``arena=True`` first moves the model's refit tensors into one buffer laid out as the plan's byte stream
    (:func:`allocate_targets` on the model's device): each tensor's bytes are copied in and its ``.data`` becomes its
    view of the buffer — the same parameter / buffer objects, same values, new (from then on stable) addresses. A
    :class:`~mxport.refit.RefitReceiver` given these targets then receives in direct mode: buckets land straight in
    the live weights, with no staging -> live copy per refit. Do it before anything records the weights'
    addresses (CUDA graph capture); references to the old storages taken before no longer follow the model.

    Raises:
        ValueError: with ``arena=True``, a tensor that cannot move (a view of a larger or shared storage, a tensor
            subclass, another device); nothing is moved then.
    """
    tensors = model_tensors(model)
    names = {n for n, _ in tensors}
    by_name = dict(tensors)
    items, live, done = [], [], set()
    for name, t in tensors:
        if name in done:
            continue
        if is_fp8_dtype(t.dtype):
            items.append((name, "values", t.dtype, tuple(t.shape)))
            live.append(t)
            sname = scale_name(name, PLAN_NAMING)
            if sname in names:
                s = by_name[sname]
                items.append((sname, "scales", s.dtype, tuple(s.shape)))
                live.append(s)
                done.add(sname)
        else:
            items.append((name, "kept", t.dtype, tuple(t.shape)))
            live.append(t)
    plan = RefitPlan(items, bucket_bytes)
    if arena:
        slots = allocate_targets(plan, live[0].device)
        users = _storage_users(model)
        for e, t, slot in zip(plan.entries, live, slots, strict=True):
            if e.nbytes and not _adoptable(t, slot, users):
                raise ValueError(f"receiver_plan(arena=True): {e.name!r} cannot move into the refit arena (it must "
                                 f"be a plain contiguous tensor on {slot.device} that owns its storage alone); "
                                 f"nothing was moved, use arena=False")
        for e, t, slot in zip(plan.entries, live, slots, strict=True):
            if e.nbytes:
                _adopt(t, slot)
    return plan, [t.detach() for t in live]


def allocate_targets(plan: RefitPlan, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Receive buffers for ``plan`` (for an engine that loads weights itself, see :func:`checkpoint_tensors`),
    allocated once and reused for every refit.

    One flat zero-filled ``uint8`` arena of ``plan.total_bytes`` bytes is allocated on ``device``; each returned
    tensor is a view of it with the planned dtype and shape at the entry's byte offset — the arena *is* the plan's
    byte stream. A :class:`~mxport.refit.RefitReceiver` given these targets receives the buckets straight into
    them ("direct mode": no staging -> live copy at commit). The views share the arena's storage (and its version
    counter); keep them alive as long as the engine uses them.

    Raises:
        ValueError: an entry whose offset is not a multiple of its dtype's item size (cannot happen for plans built
            by :class:`RefitPlan`, whose offsets are multiples of 16).
    """
    from .plan import dtype_from_name

    arena = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
    out = []
    for e in plan.entries:
        dt = dtype_from_name(e.dtype)
        if e.offset % dt.itemsize:
            raise ValueError(f"tensor {e.name!r}: offset {e.offset} is not a multiple of the {e.dtype} item size "
                             f"{dt.itemsize}")
        out.append(arena[e.offset:e.offset + e.nbytes].view(dt).view(e.shape))
    return out


def checkpoint_tensors(plan: RefitPlan, targets: Sequence[torch.Tensor], fmt: str = "modelopt"
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs in checkpoint format ``fmt`` (one of ``mxport.checkpoint.FORMATS``), in plan
    order, for an engine's own loader: vLLM ``model.load_weights(iter)`` / ``reload_weights``, SGLang
    ``update_weights_from_tensor(named_tensors)``. Values are FP8 tensors, scales compact uint8 E8M0 named per
    format (``weight_scale`` for modelopt / compressed-tensors, ``weight_scale_inv`` for sglang), kept tensors as
    they are. Tensors are the targets themselves (no copy)."""
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
