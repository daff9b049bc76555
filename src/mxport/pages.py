"""Fresh output buffers for the CPU kernels: large ones on transparent huge pages, recently freed ones reused.

A new tensor of more than glibc's mmap threshold (at most 32 MiB) is a fresh ``mmap`` on every call, and
Linux hands each page over zero-filled at its first touch: a fresh 8192 x 8192 quantize faulted in 16,385
4 KiB pages (544 with transparent huge pages), and even on huge pages the kernel's zeroing is a second write
of every byte to memory once the output outgrows the caches (64M elements: 0.37 ns per element fresh against
0.24 into a preallocated ``out=``). Below the threshold glibc's heap already recycles freed memory without
either cost; this module does the same for the large outputs: :func:`fresh_bytes` backs a large buffer by its
own anonymous private mapping (advised onto huge pages), and when the last tensor using it dies (its storage's
deleter releases the buffer) the mapping goes back to a small pool of spares, reused by the next request of
the same rounded size with its pages already in place. Every byte of an output is written by the kernel, so a
reused buffer's old contents never show.

The pool holds at most :func:`spare_limit` bytes (``MXPORT_SPARE_MIB``; default the smaller of 1 GiB and 1/32
of the machine's memory; ``0`` turns reuse off); :func:`release_spares` unmaps them now.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import torch

ENV_SPARE_MIB = "MXPORT_SPARE_MIB"
#: outputs of at least this many bytes get their own mapping (huge pages, reuse); smaller ones come from torch
HUGE_PAGE_MIN_BYTES = 4 << 20
HUGE_PAGE = 2 << 20


@dataclass(eq=False)
class _Mapping:
    """One anonymous private mapping of ``size`` bytes usable from ``start`` (2 MiB-aligned)."""
    mm: mmap.mmap
    start: int
    size: int


class _Spares:
    """Freed mappings, oldest first, at most ``spare_limit()`` bytes in all: a new one evicts the oldest
    (shapes that never come back do not hold the pool). Thread-safe; ``give`` may run inside ``take`` on the
    same thread (a garbage collection there), hence the re-entrant lock."""

    def __init__(self):
        self._lock = threading.RLock()
        self._free: list[_Mapping] = []
        self.held = 0

    def take(self, size: int) -> _Mapping | None:
        """The most recently freed spare of exactly ``size`` bytes, if any."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].size == size:
                    self.held -= size
                    return self._free.pop(i)
            return None

    def give(self, m: _Mapping) -> None:
        """Called as the last buffer export of ``m`` is released: keep it, evicting the oldest spares to make
        room (a mapping dropped from the pool is unmapped once nothing uses it)."""
        try:
            limit = spare_limit()
        except ValueError:  # set wrong since the buffer was made (fresh_bytes raises then): keep nothing
            limit = 0
        with self._lock:
            if m.size > limit:
                return
            while self._free and self.held + m.size > limit:
                self.held -= self._free.pop(0).size
            self._free.append(m)
            self.held += m.size

    def clear(self) -> int:
        with self._lock:
            n, self._free, self.held = self.held, [], 0
            return n


_SPARES = _Spares()

if hasattr(os, "register_at_fork"):
    # a fork while another thread is inside the pool would leave the child's lock owned by a thread the child
    # does not have (its first large output, or freeing one, would wait forever): the forking thread holds
    # the lock across the fork (the child's pool is whole) and each side releases it
    os.register_at_fork(before=_SPARES._lock.acquire, after_in_parent=_SPARES._lock.release,
                        after_in_child=_SPARES._lock.release)


def spare_limit() -> int:
    """Bytes of freed output buffers kept for reuse: ``MXPORT_SPARE_MIB`` MiB, else min(1 GiB, memory /
    32) (per process: eight ranks on a node hold at most a quarter of its memory)."""
    env = os.environ.get(ENV_SPARE_MIB, "").strip()
    if env:
        try:
            return max(0, int(env)) << 20
        except ValueError:
            raise ValueError(f"{ENV_SPARE_MIB}={env!r}: expected a whole number of MiB") from None
    try:
        mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        mem = 16 << 30
    return min(1 << 30, mem // 32)


def spare_bytes() -> int:
    """Bytes of freed output buffers held for reuse now."""
    return _SPARES.held


def release_spares() -> int:
    """Unmap every spare buffer now (those still in use are not affected); returns the bytes released."""
    return _SPARES.clear()


def _new_mapping(size: int) -> _Mapping:
    """``size`` bytes (a multiple of 2 MiB) of a new private anonymous mapping, starting 2 MiB-aligned and
    advised onto transparent huge pages where the OS has them."""
    mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
    start = -base % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice, start, size)
        except OSError:  # THP off or unsupported: only speed changes
            pass
    return _Mapping(mm, start, size)


def fresh_bytes(shape: tuple[int, ...]) -> torch.Tensor:
    """A new contiguous uint8 CPU tensor of ``shape`` for a kernel to fill completely (its initial contents
    are unspecified). From :data:`HUGE_PAGE_MIN_BYTES` on it lives on its own huge-page mapping, a spare one
    of the same rounded size when the pool has it (see the module doc). MemoryError when it cannot be
    mapped."""
    n = math.prod(shape)
    if n < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):  # small, or not a POSIX system
        return torch.empty(shape, dtype=torch.uint8)
    spare_limit()  # a bad MXPORT_SPARE_MIB fails here, not in the finalizer of every output (never raised)
    size = -(-n // HUGE_PAGE) * HUGE_PAGE
    m = _SPARES.take(size)
    if m is None:
        try:
            m = _new_mapping(size)
        except OSError:  # out of memory (or mappings): the spares go back to the system, then one more try
            release_spares()
            try:
                m = _new_mapping(size)
            except OSError as exc:  # an allocation failure, as torch.empty's, for callers' TooLargeError
                raise MemoryError(f"cannot map {size} bytes for a fresh output: {exc}") from exc
    view = memoryview(m.mm)[m.start:m.start + n]
    # runs when the tensor's storage, the last user, releases it; never at exit (finalize's default), when
    # the buffers still in use would join the pool and an exit handler's quantize write over them
    weakref.finalize(view, _SPARES.give, m).atexit = False
    return torch.frombuffer(view, dtype=torch.uint8).view(shape)
