"""RefitReceiver: receives every bucket and the trailer into staging, validates all of them, then commits with ``copy_`` into the
live tensors — all or nothing, pointers never move."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence

import torch

from .buckets import (
    MAGIC,
    STATUS_ABORT,
    TRAILER_FIXED,
    BucketLayout,
    byte_view,
    checksum,
    pack_bucket,
    read_trailer,
    unpack_segments,
)
from .handshake import exchange_plans
from .plan import RefitPlan
from .transport import Transport


class RefitError(RuntimeError):
    """A refit failed on the receiver; the live weights stayed on ``kept_version``.

    ``bucket`` (int or None) and ``tensors`` (names in that bucket) say where it failed.
    """

    def __init__(self, message: str, *, bucket: int | None = None, tensors: Sequence[str] = (),
                 kept_version: int = 0):
        self.bucket, self.tensors, self.kept_version = bucket, list(tensors), kept_version
        super().__init__(message)


def _names(names: list[str], limit: int = 4) -> str:
    uniq = list(dict.fromkeys(names))
    return ", ".join(uniq[:limit]) + (f" (+{len(uniq) - limit} more)" if len(uniq) > limit else "")


class RefitReceiver:
    """The inference side of refit.

    Args:
        transport: a receiving :class:`~mxport.refit.transport.Transport` endpoint.
        plan: the receiver's own :class:`RefitPlan` (checked against the sender's in :meth:`handshake`).
        targets: the live tensors, one per plan entry in plan order, contiguous, with exactly the planned dtype and
            shape (e.g. an MXFP8Linear's ``weight`` float8 buffer and ``weight_scale`` uint8 buffer). They are only
            ever written with ``copy_`` into views of their storage: pointers stay put (CUDA-graph safe) and each
            write bumps the tensor's ``_version`` (so MXFP8Linear's decoded cache follows).
        use_checksum: verify each bucket's checksum (the sender must write them).
        refresh_hooks: callables run after every successful commit (refresh derived copies: swizzled scales, caches
            that do not follow ``_version``).
        inflight: broadcasts posted ahead of the one being validated.

    Staging (the whole byte stream) and the trailer are allocated once, on the targets' device.
    """

    def __init__(self, transport: Transport, plan: RefitPlan, targets: Sequence[torch.Tensor], *,
                 use_checksum: bool = True, refresh_hooks: Sequence[Callable[[], None]] = (), inflight: int = 4):
        if not isinstance(plan, RefitPlan):
            raise TypeError(f"plan must be a RefitPlan, got {type(plan).__name__}")
        if transport.is_sender:
            raise ValueError(f"transport rank {transport.rank} is the sender; a receiver needs another rank")
        targets = list(targets)
        if len(targets) != len(plan):
            raise ValueError(f"targets: got {len(targets)} tensors, the plan has {len(plan)}")
        for i, t in enumerate(targets):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"targets[{i}] ({plan.entries[i].name!r}) must be a torch.Tensor")
            plan.check_tensor(i, t)
        self.transport, self.plan, self.targets = transport, plan, targets
        self.use_checksum = use_checksum
        self.refresh_hooks = list(refresh_hooks)
        self.inflight = max(1, inflight)
        self.layout = BucketLayout(plan)
        self._views = [byte_view(t, argname=plan.entries[i].name) for i, t in enumerate(targets)]
        self._pointers = self.pointers()
        device = targets[0].device
        self._staging = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
        self._payloads = [self._staging[b * plan.bucket_bytes:b * plan.bucket_bytes + n]
                          for b, n in enumerate(self.layout.sizes)]
        self._trailer = torch.zeros(TRAILER_FIXED + plan.num_buckets, dtype=torch.int64, device=device)
        self.version = 0
        self.last_checksums: list[int] = []
        self._handshaken = False

    # -- state ---------------------------------------------------------------------------------------------------
    def pointers(self) -> list[int]:
        """``data_ptr()`` of every live target."""
        return [t.data_ptr() for t in self.targets]

    def pointers_stable(self) -> bool:
        """True when every live tensor still sits where it was when the receiver was built."""
        return self.pointers() == self._pointers

    def handshake(self) -> None:
        """Exchange plan digests with the sender (raises RefitPlanMismatch on a mismatch, before any payload)."""
        exchange_plans(self.transport, self.plan, self.version)
        self._handshaken = True

    # -- one refit ------------------------------------------------------------------------------------------------
    def receive(self) -> dict:
        """Receive one refit into staging, validate every bucket, then commit all tensors in place.

        Returns:
            dict: ``version`` (the sender's refit version now live), ``bytes``, ``buckets``, ``idle_s`` (waiting
            for the first bucket: the sender was still training / quantizing), ``seconds`` (first bucket in to
            commit done), ``recv_s`` (receiving + validating after the first bucket), ``commit_s`` (unpack into
            live tensors + refresh hooks), ``gbps`` (bytes / seconds / 1e9).

        Raises:
            RefitError: a dead or timed-out peer, a bad header, a checksum mismatch, an abort from the sender, or a
                live tensor whose dtype/shape/pointer changed. The message names the bucket and its tensors; the
                live weights are left exactly as they were (previous version). After a checksum mismatch or an
                abort the transport is still in step and the next refit can succeed; after a dead peer or timeout
                the transport must be re-created.
        """
        if not self._handshaken:
            self.handshake()
        plan, layout = self.plan, self.layout
        local_problem = None  # found before receiving: still drain the stream so sender and receivers stay in step
        try:
            for i, t in enumerate(self.targets):
                plan.check_tensor(i, t)
        except ValueError as exc:
            local_problem = f"a live tensor changed since the receiver was built: {exc}"
        if local_problem is None and not self.pointers_stable():
            local_problem = "a live tensor was moved or reallocated since the receiver was built"
        t0 = t_first = time.perf_counter()
        n = plan.num_buckets
        bufs = [*self._payloads, self._trailer]  # n payload broadcasts, then the trailer
        handles: list = [None] * (n + 1)
        got = [0] * n
        posted = 0
        for b in range(n + 1):
            try:
                while posted <= n and posted <= b + self.inflight:
                    handles[posted] = self.transport.broadcast(bufs[posted], async_op=True)
                    posted += 1
                handles[b].wait()
                handles[b] = None
                if b == 0:
                    t_first = time.perf_counter()
                if b < n and self.use_checksum:  # checksum while later buckets are still on the wire
                    got[b] = checksum(self._payloads[b])
            except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
                where = f"bucket {b} of {n}" if b < n else "the trailer"
                names = layout.tensor_names(b) if b < n else []
                raise RefitError(f"refit failed receiving {where} (tensors: {_names(names)}): "
                                 f"{type(exc).__name__}: {exc}; live weights kept at version {self.version}",
                                 bucket=b if b < n else None, tensors=names, kept_version=self.version) from exc
        magic, version, nb, status, entry, crcs = read_trailer(self._trailer)
        problem: tuple[int | None, str] | None = None
        if local_problem is not None:
            problem = (None, local_problem)
        elif magic != MAGIC or nb != n:
            problem = (None, f"bad trailer (magic {magic:#x}, {nb} buckets, expected {n})")
        elif status == STATUS_ABORT:
            what = f" at tensor {plan.entries[entry].name!r}" if 0 <= entry < len(plan) else ""
            bucket = plan.entries[entry].bucket if 0 <= entry < len(plan) else None
            problem = (bucket, f"the sender aborted refit v{version}{what}")
        elif version <= self.version:
            problem = (None, f"stale refit version {version} (live version is {self.version})")
        elif self.use_checksum:
            for b in range(n):
                if got[b] != crcs[b]:
                    problem = (b, f"checksum mismatch (sent {crcs[b]:#x}, received {got[b]:#x})")
                    break
        recv_s = time.perf_counter() - t_first
        if problem is not None:
            b, why = problem
            names = layout.tensor_names(b) if b is not None else []
            where = f"at bucket {b} of {n} (tensors: {_names(names)})" if b is not None else f"({n} buckets)"
            raise RefitError(f"refit rejected {where}: {why}; live weights kept at version {self.version}",
                             bucket=b, tensors=names, kept_version=self.version)
        t1 = time.perf_counter()
        for b in range(n):
            unpack_segments(layout.segments[b], self._payloads[b], self._views)
        self.version = int(version)
        self.last_checksums = crcs
        for hook in self.refresh_hooks:
            hook()
        t2 = time.perf_counter()
        seconds = t2 - t_first
        return {"version": self.version, "bytes": plan.total_bytes, "buckets": n, "seconds": seconds,
                "idle_s": t_first - t0, "recv_s": recv_s, "commit_s": t2 - t1,
                "gbps": plan.total_bytes / seconds / 1e9 if seconds > 0 else 0.0}

    def verify_live(self) -> bool:
        """True when the live tensors' bytes, re-packed into buckets, have exactly the checksums the sender wrote
        for the last refit (an independent check of the committed bytes; needs sender checksums)."""
        if not self.last_checksums:
            return False
        return all(checksum(payload) == self.last_checksums[b] for b, payload in self._live_buckets())

    def live_crc32(self) -> int:
        """CRC-32 (``zlib.crc32``) of the live tensors' bytes laid out as the plan's byte stream (padding zero):
        equal to the sender's ``stream_crc32`` exactly when the live weights hold the bytes that were sent."""
        crc = 0
        for _, payload in self._live_buckets():
            crc = zlib.crc32(payload.cpu().numpy(), crc)
        return crc

    def _live_buckets(self):
        """``(bucket, payload)`` for each bucket, re-packed from the live tensors into one scratch buffer (each
        payload is valid until the next one is yielded)."""
        scratch = torch.empty(self.plan.bucket_bytes, dtype=torch.uint8, device=self._staging.device)
        for b in range(self.plan.num_buckets):
            payload = scratch[:self.plan.bucket_size(b)]
            pack_bucket(self.layout, b, self._views, payload)
            yield b, payload
