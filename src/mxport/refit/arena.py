"""The refit arena (one flat buffer laid out as the plan's byte stream, whose views are the tensors), adopting
a model's own tensors into it, and direct mode's :class:`RollbackCopy`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from .plan import RefitPlan, dtype_from_name


def storage_bytes(storage: torch.UntypedStorage, start: int, nbytes: int,
                  device: torch.device) -> torch.Tensor:
    """A flat ``uint8`` tensor over ``nbytes`` bytes of ``storage`` from byte ``start`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,), (1,))


def allocate_targets(plan: RefitPlan, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Receive buffers for ``plan``: views of one zero-filled ``uint8`` arena of ``plan.total_bytes`` on
    ``device``, each of the planned dtype and shape at its entry's offset (the arena *is* the byte stream), so
    a :class:`~mxport.refit.RefitReceiver` receives into them in direct mode. ValueError for an entry whose
    offset is not a multiple of its item size (never for a :class:`RefitPlan`)."""
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
    """The flat ``uint8`` tensor over the targets' storage when they lie exactly as the plan's byte stream in
    one storage (zero-byte entries not checked), else None."""
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
    """Storage address -> how many of ``model``'s plain parameters and buffers use it."""
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
    """True when ``t`` can move into ``slot``: a plain contiguous tensor of ``slot``'s dtype, shape and device
    that owns its whole storage and shares it with no other tensor of the model."""
    raw = _raw(t)
    return (type(raw) is torch.Tensor and raw.dtype == slot.dtype and raw.shape == slot.shape
            and raw.device == slot.device and raw.nbytes > 0 and raw.is_contiguous()
            and raw.storage_offset() == 0 and raw.untyped_storage().nbytes() == raw.nbytes
            and users.get(raw.untyped_storage().data_ptr()) == 1)


@torch.no_grad()
def adopt(t: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy ``t``'s bytes into ``slot`` and make ``slot`` its storage (``t.data = slot``): the same tensor
    object, autograd identity and version counter, now in the arena."""
    slot.copy_(_raw(t))
    t.data = slot


# -- the receiver's rollback copy ----------------------------------------------------------------------------
def target_versions(targets: list[torch.Tensor]) -> tuple[int, ...] | None:
    """The tensors' ``_version`` counters, or None for inference tensors (which have none)."""
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
    """A copy of the live version, restored from on a failed refit: ``copy`` (a flat ``uint8`` buffer of the
    stream's bytes), filled from the live tensors by ``take(copy)`` and put back by ``put(copy, nbytes)`` (the
    stream's first ``nbytes``). Refreshed in the background by :meth:`start` after every successful refit,
    retaken by :meth:`wait` when needed, put back by :meth:`restore`. :meth:`of_arena`: direct mode's (the
    live tensors are one arena laid out as the stream); the eager receiver's is laid out as the stream over
    scattered live tensors, in host memory (``mxport.refit.stream.receiver``)."""

    def __init__(self, copy: torch.Tensor, targets: list[torch.Tensor],
                 take: Callable[[torch.Tensor], None], put: Callable[[torch.Tensor, int], None]):
        self.copy, self.targets, self._take, self._put = copy, targets, take, put
        t0 = time.perf_counter()
        take(copy)
        self.last_s = time.perf_counter() - t0  # seconds of the last copy
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._versions = target_versions(targets)  # when the copy was last taken (None: not trackable)
        self.stale = False  # a committed refit not copied yet (refreshed by start, or by wait)

    @classmethod
    def of_arena(cls, arena: torch.Tensor, targets: list[torch.Tensor]) -> RollbackCopy:
        """Direct mode's copy: a clone of the live ``arena`` (whose views are ``targets``)."""
        return cls(torch.empty_like(arena), targets, lambda copy: copy.copy_(arena),
                   lambda copy, n: arena[:n].copy_(copy[:n]))

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            self._take(self.copy)
            for t in self.targets[:1]:
                if t.device.type == "cuda":
                    torch.cuda.current_stream(t.device).synchronize()
            self.last_s = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - re-done synchronously by wait
            self._error = exc

    def start(self) -> None:
        """Refresh the copy in a background thread (the arena now holds the version to keep). Not a daemon:
        the interpreter's exit waits for the copy (a bounded memory copy) instead of tearing the process down
        under it, which aborted programs that end right after a refit."""
        self._versions, self.stale = target_versions(self.targets), False
        self._thread = threading.Thread(target=self._run, name="mxport-refit-backup", daemon=False)
        self._thread.start()

    def start_if_stale(self) -> None:
        """:meth:`start`, when a committed refit is not copied yet and no copy is running."""
        if self.stale and self._thread is None:
            self.start()

    def follow(self, patch) -> None:
        """Bring the copy up to what is live by ``patch()`` (the change just committed, applied to the copy:
        a delta refit's few bytes instead of a whole copy); the copy held the previous version."""
        t0 = time.perf_counter()
        patch()
        self.last_s = time.perf_counter() - t0
        self._versions = target_versions(self.targets)

    def note_versions(self) -> None:
        """The targets' counters moved with no write into the bytes this copy holds (another stream's commit
        into the same tensors): record them, unless the copy is already known to be old."""
        if not self.stale and self._error is None:
            self._versions = target_versions(self.targets)

    def wait(self) -> float:
        """Block until the copy holds what is live; return the seconds of the copy that made it so."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None or self.stale or target_versions(self.targets) != self._versions:
            self._error, self.stale = None, False
            t0 = time.perf_counter()
            self._take(self.copy)
            self.last_s = time.perf_counter() - t0
            self._versions = target_versions(self.targets)
        return self.last_s

    def restore(self, nbytes: int) -> None:
        """Put the stream's first ``nbytes`` back from the copy (and bump the targets' versions)."""
        if nbytes > 0:
            self._put(self.copy, nbytes)
        bump_versions(self.targets)
        self._versions = target_versions(self.targets)
