"""The refit arena: one flat buffer laid out as the plan's byte stream, whose views are the refit's tensors.

- :func:`allocate_targets` allocates one and returns its per-entry views; :func:`stream_arena` finds one
  behind a list of tensors (the receiver's direct mode, the sender's zero-copy buckets); :func:`storage_bytes`
  is the one
  place a flat uint8 view of a storage's bytes is made.
- adoption (:func:`storage_users`, :func:`adoptable`, :func:`adopt`): moving a model's own tensors into their
  views of an arena, the parameter objects unchanged (``t.data = view``).
- :class:`RollbackCopy`: the receiver's copy of the live arena's previous version (direct mode), refreshed in
  the background after every successful refit, restored from on a failure.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from .plan import RefitPlan, dtype_from_name


def storage_bytes(storage: torch.UntypedStorage, start: int, nbytes: int,
                  device: torch.device) -> torch.Tensor:
    """A flat ``uint8`` tensor over ``nbytes`` bytes of ``storage`` from byte ``start`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,), (1,))


def allocate_targets(plan: RefitPlan, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Receive buffers for ``plan`` (for an engine that loads weights itself, see
    :func:`~mxport.refit.checkpoint_tensors`), allocated once and reused for every refit.

    One flat zero-filled ``uint8`` arena of ``plan.total_bytes`` bytes is allocated on ``device``; each
    returned tensor is a view of it with the planned dtype and shape at the entry's byte offset — the arena
    *is* the plan's byte stream. A :class:`~mxport.refit.RefitReceiver` given these targets receives the
    buckets straight into them ("direct mode": no staging -> live copy at commit). The views share the arena's
    storage (and its version counter); keep them alive as long as the engine uses them.

    Raises:
        ValueError: an entry whose offset is not a multiple of its dtype's item size (cannot happen for plans
            built by :class:`RefitPlan`, whose offsets are multiples of 16).
    """
    arena = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
    out = []
    for e in plan.entries:
        dt = dtype_from_name(e.dtype)
        if e.offset % dt.itemsize:
            raise ValueError(f"tensor {e.name!r}: offset {e.offset} is not a multiple of the {e.dtype} item "
                             f"size {dt.itemsize}")
        out.append(arena[e.offset:e.offset + e.nbytes].view(dt).view(e.shape))
    return out


def stream_arena(plan: RefitPlan, targets: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat ``uint8`` tensor over the targets' storage when the targets are laid out exactly as the plan's
    byte stream (``allocate_targets`` does that): all share one storage, each target's first byte sits at
    ``base + entry.offset``, and the storage covers ``[base, base + plan.total_bytes)``. None otherwise.

    Writing the returned tensor writes the targets (and the alignment padding between them, which belongs to
    the stream). Zero-byte entries are not checked (they own no bytes).
    """
    storage, base, device = None, None, None
    for e, t in zip(plan.entries, targets, strict=True):
        if e.nbytes == 0:
            continue
        if not t.is_contiguous():
            return None
        s = t.untyped_storage()
        if storage is None:
            storage, base, device = s, t.data_ptr() - e.offset, t.device
        elif s.data_ptr() != storage.data_ptr() or t.device != device or t.data_ptr() - e.offset != base:
            return None
    if storage is None:
        return None
    start = base - storage.data_ptr()
    if start < 0 or start + plan.total_bytes > storage.nbytes():
        return None
    return storage_bytes(storage, start, plan.total_bytes, device)


# -- adoption ------------------------------------------------------------------------------------------------
def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.data if isinstance(t, nn.Parameter) else t


def storage_users(model: nn.Module) -> dict[int, int]:
    """Storage address -> how many of ``model``'s parameters and buffers (non-persistent ones too) use it;
    plain tensors only (wrapper subclasses such as torchao's MXTensor or TE's MXFP8 storage have no plain
    storage)."""
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


def adoptable(t: torch.Tensor, slot: torch.Tensor, users: dict[int, int]) -> bool:
    """True when ``t`` can move into ``slot`` (its view of an arena): a plain tensor with ``slot``'s dtype,
    shape and device that owns its whole storage and shares it with no other tensor of the model."""
    raw = _raw(t)
    return (type(raw) is torch.Tensor and raw.dtype == slot.dtype and raw.shape == slot.shape
            and raw.device == slot.device and raw.nbytes > 0 and raw.is_contiguous()
            and raw.storage_offset() == 0 and raw.untyped_storage().nbytes() == raw.nbytes
            and users.get(raw.untyped_storage().data_ptr()) == 1)


@torch.no_grad()
def adopt(t: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy ``t``'s bytes into ``slot`` and make ``slot`` its storage (``t.data = slot``): the same tensor
    object (parameter, buffer), its autograd identity and version counter unchanged, now living in the
    arena."""
    slot.copy_(_raw(t))
    t.data = slot


# -- the receiver's rollback copy ----------------------------------------------------------------------------
def target_versions(targets: list[torch.Tensor]) -> tuple[int, ...] | None:
    """The tensors' ``_version`` counters (bumped by every in-place torch write), or None where they have none
    (inference tensors): then only writes made through the receiver are known."""
    try:
        return tuple(t._version for t in targets)
    except RuntimeError:
        return None


def bump_versions(targets: list[torch.Tensor]) -> None:
    """Broadcasts write memory without bumping ``_version``: bump every target's so derived caches follow."""
    for t in targets:
        try:
            torch.autograd.graph.increment_version(t)
        except RuntimeError:  # inference tensors have no version counter
            pass


class RollbackCopy:
    """Direct mode: a copy of the live ``arena`` (the previous version), taken now, refreshed by :meth:`start`
    in a background thread after every successful refit, and retaken by :meth:`wait` when the live tensors
    were written in place meanwhile (their ``_version`` counters moved: a checkpoint load, say) or the
    background copy failed; :meth:`restore` puts it back."""

    def __init__(self, arena: torch.Tensor, targets: list[torch.Tensor]):
        self.arena, self.targets = arena, targets
        t0 = time.perf_counter()
        self.copy = arena.clone()
        self.last_s = time.perf_counter() - t0  # seconds of the last copy
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._versions = target_versions(targets)  # when the copy was last taken (None: not trackable)

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            self.copy.copy_(self.arena)
            if self.copy.device.type == "cuda":
                torch.cuda.current_stream(self.copy.device).synchronize()
            self.last_s = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - re-done synchronously by wait
            self._error = exc

    def start(self) -> None:
        """Refresh the copy in a background thread (the arena now holds the version to keep)."""
        self._versions = target_versions(self.targets)
        self._thread = threading.Thread(target=self._run, name="mxport-refit-backup", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Block until the copy holds what is live; return the seconds of the copy that made it so."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None or target_versions(self.targets) != self._versions:
            self._error = None
            t0 = time.perf_counter()
            self.copy.copy_(self.arena)
            self.last_s = time.perf_counter() - t0
            self._versions = target_versions(self.targets)
        return self.last_s

    def restore(self, nbytes: int) -> None:
        """Put the first ``nbytes`` of the copy back into the arena (and bump the targets' versions)."""
        if nbytes > 0:
            self.arena[:nbytes].copy_(self.copy[:nbytes])
        bump_versions(self.targets)
        self._versions = target_versions(self.targets)
