"""StreamReceiver: one byte stream's receiving end: it stages (receive and validate), gives its verdict, and
settles by the coordinator's vote, leaving the live tensors on one complete version, pointers unmoved."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..arena import RollbackCopy, bump_versions, stream_arena, target_versions
from ..buckets import (
    DEFAULT_BUCKET_BYTES,
    MAGIC,
    STATUS_ABORT,
    STATUS_OK,
    TRAILER_FIXED,
    BucketLayout,
    Trailer,
    byte_view,
    checksum,
    pack_bucket,
    unpack_segments,
)
from ..handshake import exchange_plans
from ..plan import RefitPlan
from ..results import AbortReason, ReceiverResult, ReceiveStats, RefitError, Status, Vote
from ..timing import Stopwatch
from ..transport import Transport
from . import delta as dl


@dataclass(frozen=True)
class _Problem:
    """Why a received refit is rejected: the status, a readable reason, where (bucket, entry)."""

    status: Status
    why: str
    bucket: int | None = None
    entry: int = -1


@dataclass(frozen=True)
class Staged:
    """One refit received and judged, not committed (``problem`` None: this rank accepts it)."""

    problem: _Problem | None
    trailer: Trailer
    stopwatch: Stopwatch
    backup_s: float
    wire_bytes: int = 0
    delta: bool = False
    touched: frozenset[str] | None = None  # a delta's plan entries with changed bytes (None: every entry)
    deltas: tuple | None = None  # a delta's parsed buckets (direct mode patches the rollback copy with them)

    @property
    def ok(self) -> bool:
        return self.problem is None


_ABORT_WHY = {AbortReason.BAD_TENSOR: "a tensor that does not match the plan",
              AbortReason.COUNT: "too few or too many tensors",
              AbortReason.PRODUCER: "the producer of the tensors failed",
              AbortReason.INTERNAL: "the sender failed"}


def _wait_quietly(handles: list) -> None:
    """Wait for every posted broadcast, ignoring errors (the transport is broken anyway)."""
    for h in handles:
        if h is not None:
            try:
                h.wait()
            except Exception:  # noqa: BLE001, S110
                pass


def _names(names: list[str], limit: int = 4) -> str:
    uniq = list(dict.fromkeys(names))
    return ", ".join(uniq[:limit]) + (f" (+{len(uniq) - limit} more)" if len(uniq) > limit else "")


class StreamReceiver:
    """The receiving end of one byte stream: ``transport``, ``plan``, ``targets`` as
    :class:`~mxport.refit.RefitReceiver`'s; ``bucket_bytes`` the sender's; ``use_checksum`` verify each
    bucket; ``refresh_hooks`` run after every commit (derived copies that do not follow ``_version``);
    ``inflight`` broadcasts posted ahead; ``direct`` receive straight into the live tensors (None: whenever
    they form one arena laid out as the stream; False: never; True: always, else ValueError); ``delta`` take
    delta refits (only what changed since the live version, patched into a copy of it and checked against
    the new version's checksums) when every endpoint does; ``eager`` (targets that are not one arena): land
    each bucket in a ring of ``inflight + 1`` bucket buffers and write it into the live tensors as soon as it
    is summed, while later buckets are on the wire, with a rollback copy of the live version in host memory
    instead of a staging copy on the device (the vLLM workers' mode: two buckets on the device with
    ``inflight=1``, no commit copy after the vote; a delta is patched bucket by bucket from the live tensors
    in the ring, its payload in a ring buffer when it fits one; ``ring``: buffers to use as the ring, shared
    with other streams received one after another, when there are enough of them, on the live tensors'
    device and each the size of a bucket at least); ``defer_backup``: the rollback copy of a
    committed refit is refreshed only when the owner calls :meth:`start_backup` (else at the next receive).

    In direct and eager mode the live tensors are written *during* a receive and the rollback copy holds the
    previous version (refreshed by one background copy per refit: ``backup_s`` / ``backup_wait_s``), restored
    on any failure: once a receive returns or raises, they hold exactly one complete version."""

    def __init__(self, transport: Transport, plan: RefitPlan, targets: Sequence[torch.Tensor], *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, use_checksum: bool = True, inflight: int = 4,
                 refresh_hooks: Sequence[Callable[[], None]] = (), direct: bool | None = None,
                 delta: bool = False, eager: bool = False, defer_backup: bool = False,
                 ring: Sequence[torch.Tensor] = ()):
        if not isinstance(plan, RefitPlan):
            raise TypeError(f"plan must be a RefitPlan, got {type(plan).__name__}")
        if delta and not use_checksum:
            raise ValueError("delta=True needs use_checksum=True: a patched stream is checked against the "
                             "checksums of the new one")
        #: a delta stream: the stream bytes (staging or the live arena) hold the live version, ``_digest``
        self.want_delta, self.delta, self._base_ok, self._digest = bool(delta), False, False, 0
        #: the plan entries the last committed refit changed (None: every entry, a whole refit)
        self.last_touched: frozenset[str] | None = None
        self._live_versions: tuple | None = None  # the live tensors' _version counters at the last commit
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
        self.layout = BucketLayout(plan, bucket_bytes)
        self._views = [byte_view(t, argname=plan.entries[i].name) for i, t in enumerate(targets)]
        self._pointers = self.pointers()
        arena = stream_arena(plan, targets) if direct is not False else None
        if direct and arena is None:
            raise ValueError("direct=True needs targets that are views of one arena laid out as the plan's "
                             "byte stream (see allocate_targets)")
        self.direct = arena is not None
        self.eager = bool(eager) and arena is None
        self._extra_bytes = 0  # an eager delta's payload buffer beside the ring (one that did not fit it)
        self._prepared: tuple | None = None  # (backup seconds, its wait, holds the base): see prepare
        self.defer_backup = bool(defer_backup)
        self._arena = arena
        device = targets[0].device
        self._trailer = torch.zeros(TRAILER_FIXED + self.layout.num_buckets, dtype=torch.int64, device=device)
        self.version = 0
        self.last_checksums: list[int] = []
        #: direct / eager mode: the previous version, restored from on a failure (direct: the staging buffer
        #: is that copy; eager: host memory laid out as the stream)
        self._rollback_copy = (RollbackCopy.of_arena(arena, targets) if arena is not None
                               else self._scattered_copy() if self.eager else None)
        if self._rollback_copy is None:
            self._staging = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
        else:
            self._staging = self._rollback_copy.copy
        self._payloads = self._bucket_views(self._staging)
        # where the broadcasts land: the live arena (direct), a ring of bucket buffers (eager) or staging
        self._ring_bufs: list[torch.Tensor] = []  # eager: the ring's buffers
        self._landing = (self._bucket_views(arena) if arena is not None
                         else self._ring(device, ring) if self.eager else self._payloads)

    def device_buffers(self) -> dict[int, int]:
        """``{storage address: bytes}`` of what this stream holds on the live tensors' device beside them (an
        eager delta's payload buffer outside the ring as one more entry): receivers sharing a ring count it
        once."""
        if not self.eager:
            return {self._staging.untyped_storage().data_ptr(): self._staging.numel()}
        parts = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in self._ring_bufs}
        if self._extra_bytes:
            parts[-id(self)] = self._extra_bytes
        return parts

    @property
    def buffer_bytes(self) -> tuple[int, int]:
        """``(on the live tensors' device, in host memory)`` bytes this stream holds beside the live tensors:
        staging (device), direct (a rollback copy the arena's size, device), eager (the ring of bucket
        buffers on the device, the rollback copy in host memory)."""
        return sum(self.device_buffers().values()), self._staging.numel() if self.eager else 0

    def _ring(self, device: torch.device, shared: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Eager mode's landing: bucket ``b`` in buffer ``b % (inflight + 1)`` (a bucket is posted only once
        the one before it in that buffer was written into the live tensors); ``shared`` buffers when they
        fit."""
        sizes = self.layout.sizes
        n = min(len(sizes), self.inflight + 1)
        fits = len(shared) >= n and all(b.dtype == torch.uint8 and b.dim() == 1 and b.device == device
                                        and b.numel() >= max(sizes) for b in shared[:n])
        # a shared ring is this stream's whole (a delta's payload may take a buffer the buckets do not)
        ring = list(shared) if fits else [torch.empty(max(sizes), dtype=torch.uint8, device=device)
                                          for _ in range(n)]
        self._ring_bufs = ring
        ring = ring[:n]
        return [ring[b % len(ring)][:n] for b, n in enumerate(sizes)]

    def _scattered_copy(self) -> RollbackCopy:
        """Eager mode's rollback copy: the live tensors packed as the stream into host memory (pinned for
        CUDA targets), put back bucket by bucket."""
        layout, views, B = self.layout, self._views, self.layout.bucket_bytes

        def take(copy: torch.Tensor) -> None:
            for b, n in enumerate(layout.sizes):
                pack_bucket(layout, b, views, copy[b * B:b * B + n])

        def put(copy: torch.Tensor, nbytes: int) -> None:
            for b, n in enumerate(layout.sizes):
                if b * B < nbytes:
                    unpack_segments(layout.segments[b], copy[b * B:b * B + n], views)

        pin = self.targets[0].device.type == "cuda"
        copy = torch.empty(self.plan.total_bytes, dtype=torch.uint8, pin_memory=pin)
        return RollbackCopy(copy, self.targets, take, put)

    def _bucket_views(self, stream: torch.Tensor) -> list[torch.Tensor]:
        B = self.layout.bucket_bytes
        return [stream[b * B:b * B + n] for b, n in enumerate(self.layout.sizes)]

    # -- state -----------------------------------------------------------------------------------------------
    def pointers(self) -> list[int]:
        """``data_ptr()`` of every live target."""
        return [t.data_ptr() for t in self.targets]

    def pointers_stable(self) -> bool:
        """True when every live tensor still sits where it was when the receiver was built."""
        return self.pointers() == self._pointers

    def handshake(self) -> None:
        """Exchange plan digests with the sender (RefitPlanMismatch on a mismatch, before any payload)."""
        _, self.delta = exchange_plans(self.transport, self.plan, self.version, self.layout.bucket_bytes,
                                       delta=self.want_delta)

    # -- direct mode: the rollback copy ----------------------------------------------------------------------
    @property
    def last_backup_s(self) -> float:
        """Direct mode: seconds of the last rollback copy (0.0 in staging mode)."""
        return self._rollback_copy.last_s if self._rollback_copy is not None else 0.0

    def start_backup(self) -> None:
        """Start refreshing the rollback copy in the background (``defer_backup``: after a commit; a no-op
        while one runs, or when the copy already holds the live version)."""
        if self._rollback_copy is not None:
            self._rollback_copy.start_if_stale()

    def wait_backup(self) -> float:
        """Direct mode: wait for the rollback copy of the live version (retaken if it failed or the live
        tensors were written in place since) and return its seconds (0.0 in staging mode)."""
        return self._rollback_copy.wait() if self._rollback_copy is not None else 0.0

    # -- one refit -------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Before any stream of a refit writes: wait for the rollback copy and see whether the live tensors
        still hold the base a delta patches (a sibling stream writing its rows of a tensor this stream shares
        would otherwise read as an in-place write). :meth:`stage` does it itself when nobody did."""
        t0 = time.perf_counter()
        backup_s = self.wait_backup()
        self._prepared = (backup_s, time.perf_counter() - t0, self._holds_base())

    def stage(self) -> Staged:
        """Phase one: receive every bucket and the trailer and judge them, nothing committed; then
        :meth:`verdict` and :meth:`settle` (or :meth:`discard`). RefitError when the transport failed (rolled
        back)."""
        sw = Stopwatch()
        if self._prepared is None:
            self.prepare()
        backup_s, waited, base = self._prepared
        self._prepared = None
        sw.add("backup_wait", waited)
        problem = self._live_problem()  # found before receiving: still drain the stream to stay in step
        sw.mark("posted")
        decision = self._agree(base) if self.delta else None
        delta = decision is not None and decision.delta
        try:
            touched = deltas = None
            if delta:
                got, t_first, bad, deltas = self._receive_delta(decision.nbytes)
                problem = problem or bad
                touched = self._touched(deltas) if deltas is not None else None
            else:
                got, t_first = self._receive_stream([*self._landing, self._trailer], True)
            sw.mark("first", t_first)
            trailer = Trailer.from_tensor(self._trailer)
            problem = problem or self._judge(trailer, got)
        except RefitError:
            raise  # rolled back where it was raised
        except BaseException:  # Ctrl-C (or a bug) once the live tensors may hold unvoted bytes
            self._roll_back(self.plan.total_bytes)
            raise
        sw.mark("judged")
        return Staged(problem, trailer, sw, backup_s, decision.nbytes if delta else self.plan.total_bytes,
                      delta, touched, deltas)

    def verdict(self, staged: Staged) -> ReceiverResult:
        """This rank's row of the vote on ``staged``: ``OK`` or why it rejects, and its live version."""
        p = staged.problem
        if p is None:
            return ReceiverResult(self.transport.rank, Status.OK, -1, -1, self.version)
        return ReceiverResult(self.transport.rank, p.status, -1 if p.bucket is None else p.bucket, p.entry,
                              self.version)

    def settle(self, staged: Staged, vote: Vote) -> ReceiveStats:
        """Phase three: commit ``staged`` on a unanimous ``vote``, else roll back and raise
        :class:`RefitError` (its own reason or ``PEER_REJECTED``; ``COMMIT_FAILED`` when a refresh hook fails
        after a unanimous yes)."""
        if not vote.commit:
            self._roll_back(self.plan.total_bytes)
            raise self._rejection(staged.problem, vote)
        sw = staged.stopwatch
        try:
            with sw.phase("commit"):
                self._commit(staged.trailer)
        except Exception as exc:  # after a unanimous yes: a refresh hook failed (see _commit)
            raise RefitError(f"refit v{vote.version} failed committing on this rank after every rank voted "
                             f"yes ({type(exc).__name__}: {exc}); the other ranks committed it: this rank's "
                             "derived copies (or, staging, its live tensors) may be stale until the next "
                             "refit rewrites them", kept_version=self.version, status=Status.COMMIT_FAILED,
                             receivers=vote.results) from exc
        sw.mark("done")
        self.last_touched = staged.touched
        self._live_versions = target_versions(self.targets)
        if self._rollback_copy is not None and staged.deltas is not None:  # the same delta, not a full copy
            self._rollback_copy.follow(lambda: [dl.apply(d, b) for d, b in zip(staged.deltas, self._payloads,
                                                                                strict=True)])
        elif self._rollback_copy is not None and self.defer_backup:
            self._rollback_copy.stale = True  # copied by start_backup, or at the next receive
        elif self._rollback_copy is not None:
            self._rollback_copy.start()
        seconds = sw.between("first", "done")
        return ReceiveStats(rank=self.transport.rank, version=self.version, bytes=self.plan.total_bytes,
                            buckets=self.layout.num_buckets,
                            direct=self.direct, seconds=seconds, idle_s=sw.between("posted", "first"),
                            recv_s=sw.between("first", "judged"), commit_s=sw["commit"],
                            gbps=self.plan.total_bytes / seconds / 1e9 if seconds > 0 else 0.0,
                            backup_s=staged.backup_s, backup_wait_s=sw["backup_wait"],
                            wire_bytes=staged.wire_bytes, delta=staged.delta)

    def distrust_base(self) -> None:
        """The live tensors may not hold the version committed last (an attestation read other bytes): the
        next refit goes whole instead of patching them."""
        self._base_ok = False

    def note_live(self) -> None:
        """After every stream of a refit committed: record the live tensors' ``_version`` counters again (a
        sibling stream whose targets share a counter with this one's -- row ranges of one engine tensor --
        bumped it after this stream committed; otherwise it would read as an in-place write, and the next
        delta go whole)."""
        self._live_versions = target_versions(self.targets)
        if self._rollback_copy is not None:
            self._rollback_copy.note_versions()

    def discard(self, staged: Staged) -> None:  # noqa: ARG002 - the refit it drops, for the reader
        """Drop ``staged`` without a vote: the live tensors keep the previous version."""
        self._roll_back(self.plan.total_bytes)

    def _live_problem(self) -> _Problem | None:
        """A live tensor whose dtype / shape changed or that moved since the receiver was built, or None."""
        try:
            for i, t in enumerate(self.targets):
                self.plan.check_tensor(i, t)
        except (ValueError, TypeError) as exc:
            return _Problem(Status.LIVE_CHANGED, f"a live tensor changed since the receiver was built: {exc}")
        if not self.pointers_stable():
            return _Problem(Status.LIVE_CHANGED,
                            "a live tensor was moved or reallocated since the receiver was built")
        return None

    # -- a delta stream -------------------------------------------------------------------------------------
    def _agree(self, base: bool) -> dl.Decision:
        """The delta stream's agreement (:func:`~mxport.refit.stream.delta.agree`; ``base``: the live version
        is the one committed last); RefitError if it fails."""
        try:
            return dl.agree(self.transport, 0, self.version, self._digest if base else 0,
                            dl.max_payload(self.layout.sizes))
        except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
            self._roll_back(0)
            raise self._error("failed agreeing on a delta", None, f"{type(exc).__name__}: {exc}",
                              None) from exc

    def _holds_base(self) -> bool:
        """Whether the stream bytes still hold the version committed last: staging always does (until a
        refit lands there); direct mode's live arena only if no live tensor was written in place since (its
        ``_version`` counters), as a change the word-sum checksum cannot see would otherwise survive."""
        if not self._base_ok:
            return False
        return not (self.direct or self.eager) or target_versions(self.targets) == self._live_versions

    def _receive_delta(self, nbytes: int):
        """Receive a delta payload of ``nbytes`` and the trailer, patch the stream bytes (the live version)
        with it and sum every bucket; the checksums, when it came, why it cannot be applied (or None) and the
        parsed bucket deltas."""
        B = self.layout.bucket_bytes
        payload, work = self._delta_buffers(nbytes)
        _, t_first = self._receive_stream([*(payload[s:s + B] for s in range(0, nbytes, B)), self._trailer],
                                          False)
        # the deltas are read again at the settle: in the ring, another stream sharing it may land there first
        in_ring = work is not None and not self._extra_bytes
        host = payload.clone() if in_ring and payload.device.type == "cpu" else payload.cpu()
        try:
            deltas = dl.parse(host, self.layout.sizes, self.plan.total_bytes)
        except ValueError as exc:
            return [0] * self.layout.num_buckets, t_first, _Problem(Status.BAD_DELTA, str(exc)), None
        if work is None:  # staging holds the live version: patched there
            for d, bucket in zip(deltas, self._landing, strict=True):
                dl.apply(d, bucket)
            return [checksum(b) for b in self._landing], t_first, None, tuple(deltas)
        got, problem = self._patch_live(deltas, work)
        return got, t_first, problem, tuple(deltas)

    def _delta_buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(where the payload lands, the eager stream's buffer a bucket is patched in, or None)``: eager,
        the ring's first buffer takes the payload when it fits and another buffer is left to patch in."""
        device, ring = self._trailer.device, self._ring_bufs
        if not self.eager:
            return torch.empty(nbytes, dtype=torch.uint8, device=device), None
        if len(ring) > 1 and nbytes <= ring[0].numel():
            self._extra_bytes = 0
            return ring[0][:nbytes], ring[1]
        self._extra_bytes = nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device=device), ring[0]

    def _patch_live(self, deltas: list, work: torch.Tensor) -> tuple[list[int], _Problem | None]:
        """Eager: each bucket packed from the live tensors into ``work``, patched, summed and, if it changed,
        written back; the checksums, and why the patch failed (or None: judged with the trailer, rolled back
        if rejected). Ctrl-C here restores the live tensors and is raised."""
        got: list[int] = []
        try:
            for b, d in enumerate(deltas):
                bucket = work[:self.layout.sizes[b]]
                pack_bucket(self.layout, b, self._views, bucket)
                dl.apply(d, bucket)
                got.append(checksum(bucket))
                if d.mode != dl.UNCHANGED:
                    unpack_segments(self.layout.segments[b], bucket, self._views)
        except Exception as exc:  # noqa: BLE001 - this rank votes no (every rank then rolls back)
            return got + [0] * (len(deltas) - len(got)), _Problem(
                Status.BAD_DELTA, f"patching the live tensors failed ({type(exc).__name__}: {exc})", len(got))
        except BaseException:
            self._roll_back(self.plan.total_bytes)
            raise
        return got, None

    def _touched(self, deltas: list) -> frozenset[str]:
        """The plan entries with a changed byte (every entry of a bucket that went whole)."""
        entries, B = self.plan.entries, self.layout.bucket_bytes
        starts = torch.tensor([e.offset for e in entries], dtype=torch.int64)
        names: set[str] = set()
        for b, d in enumerate(deltas):
            if d.mode == dl.WHOLE:
                names.update(self.layout.tensor_names(b))
            elif d.mode == dl.WORDS:
                which = torch.searchsorted(starts, b * B + 8 * d.index.long(), right=True) - 1
                names.update(entries[i].name for i in torch.unique(which).tolist())
        return frozenset(names)

    def _receive_stream(self, bufs: list[torch.Tensor], into_stream: bool) -> tuple[list[int], float]:
        """Receive every buffer of ``bufs`` (the last one: the trailer; ``inflight`` posted ahead); buckets
        of the stream itself (``into_stream``) are summed while later ones arrive: their checksums and when
        the first came. A transport failure rolls back what landed and raises :class:`RefitError`."""
        n = len(bufs) - 1
        handles: list = [None] * (n + 1)
        got = [0] * n
        posted = 0
        t_first = time.perf_counter()
        for b in range(n + 1):
            try:
                while posted <= n and posted <= b + self.inflight:
                    handles[posted] = self.transport.broadcast(bufs[posted], async_op=True)
                    posted += 1
                handles[b].wait()
                handles[b] = None
                if b == 0:
                    t_first = time.perf_counter()
                if b < n and self.use_checksum and into_stream:  # summed while later buckets are on the wire
                    got[b] = checksum(bufs[b])
                if b < n and self.eager and into_stream:  # live now, judged with the trailer (rolled
                    # back if rejected)
                    unpack_segments(self.layout.segments[b], bufs[b], self._views)
            except BaseException as exc:  # a dead peer / timeout (RuntimeError from gloo), or Ctrl-C
                if self._rollback_copy is not None:
                    _wait_quietly(handles)  # nothing may still write into the live arena after the restore
                landed = min(posted * self.layout.bucket_bytes, self.plan.total_bytes) if into_stream else 0
                self._roll_back(landed)  # direct / eager: the live tensors back on the previous version
                if not isinstance(exc, Exception):
                    raise
                raise self._error("failed receiving", b if b < n else None, f"{type(exc).__name__}: {exc}",
                                  None, trailer=b == n) from exc
        return got, t_first

    def _judge(self, trailer: Trailer, got: list[int]) -> _Problem | None:
        """Why the received refit must be rejected (trailer, abort, stale version, checksum), or None."""
        plan, n = self.plan, self.layout.num_buckets
        if trailer.magic != MAGIC or trailer.num_buckets != n or trailer.status not in (STATUS_OK,
                                                                                         STATUS_ABORT):
            return _Problem(Status.BAD_TRAILER, f"bad trailer (magic {trailer.magic:#x}, "
                                                f"{trailer.num_buckets} buckets, status {trailer.status}, "
                                                f"expected {n} buckets)")
        if trailer.status == STATUS_ABORT:
            entry = trailer.entry if 0 <= trailer.entry < len(plan) else -1
            what = f" at tensor {plan.entries[entry].name!r}" if entry >= 0 else ""
            why = _ABORT_WHY.get(trailer.reason, "an error on the sender")
            return _Problem(Status.ABORTED, f"the sender aborted refit v{trailer.version}{what} ({why})",
                            self.layout.bucket_of(entry) if entry >= 0 else None, entry)
        if trailer.version <= self.version:
            return _Problem(Status.STALE,
                            f"stale refit version {trailer.version} (live version is {self.version})")
        if self.use_checksum:
            for b in range(n):
                if got[b] != trailer.checksums[b]:
                    return _Problem(Status.CHECKSUM, f"checksum mismatch (sent {trailer.checksums[b]:#x}, "
                                                     f"received {got[b]:#x})", b)
        return None

    def _commit(self, trailer: Trailer) -> None:
        """Make the validated refit live (unpack from staging, or bump the versions in direct mode), then run
        the refresh hooks: after a unanimous yes only a hook can fail (that rank alone raises)."""
        if self.direct or self.eager:
            bump_versions(self.targets)
        else:
            for b in range(self.layout.num_buckets):
                unpack_segments(self.layout.segments[b], self._payloads[b], self._views)
        self.version = int(trailer.version)
        self.last_checksums = trailer.checksums
        self._base_ok, self._digest = True, dl.digest(trailer.checksums)
        for hook in self.refresh_hooks:
            hook()

    def _roll_back(self, nbytes: int) -> None:
        """Direct mode: restore the first ``nbytes`` of the arena from the rollback copy. A delta stream's
        next refit goes whole (staging no longer holds the live version; a live byte may have been
        altered)."""
        self._base_ok = False
        if self._rollback_copy is not None:
            self._rollback_copy.restore(nbytes)

    def vote_failed(self, staged: Staged, exc: BaseException) -> RefitError:
        """The vote on ``staged`` failed (a peer died or timed out): roll back, return the error to raise."""
        problem = staged.problem
        self._roll_back(self.plan.total_bytes)
        why = problem.why if problem is not None else "received and validated"
        return self._error("not committed", problem.bucket if problem else None,
                           f"{why}, but the vote failed ({type(exc).__name__}: {exc}): a peer died or "
                           "timed out",
                           problem.status if problem else None)

    def _rejection(self, problem: _Problem | None, vote: Vote) -> RefitError:
        """The RefitError of a refit some rank voted no on: this rank's own reason, and the other ranks that
        rejected, with their buckets' tensors."""
        n, me = self.layout.num_buckets, self.transport.rank
        others = []
        for r in vote.no:
            same_abort = (problem is not None and problem.status is Status.ABORTED
                          and r.status is Status.ABORTED)
            if r.rank != me and not same_abort:  # an abort is the sender's: every receiver saw the same one
                names = self.layout.tensor_names(r.bucket) if 0 <= r.bucket < n else []
                tensors = f" (tensors: {_names(names)})" if names else ""
                others.append(r.describe(n, vote.sender_ranks) + tensors)
        if problem is not None:
            also = f" (also rejected by {'; '.join(others)})" if others else ""
            return self._error("rejected", problem.bucket, problem.why + also, problem.status,
                               receivers=vote.results)
        return self._error(f"v{vote.version} not committed", None, f"rejected by {'; '.join(others)}",
                           Status.PEER_REJECTED, receivers=vote.results)

    def _error(self, verb: str, bucket: int | None, why: str, status: Status | None, *,
               trailer: bool = False, receivers: Sequence[ReceiverResult] = ()) -> RefitError:
        """The one RefitError of a failed refit: where (bucket and its tensors), why, what stayed live."""
        n = self.layout.num_buckets
        names = self.layout.tensor_names(bucket) if bucket is not None else []
        if bucket is not None:
            where = f"bucket {bucket} of {n} (tensors: {_names(names)})"
        else:
            where = "the trailer" if trailer else f"({n} buckets)"
        restored = " (restored from the rollback copy)" if self._rollback_copy is not None else ""
        at = "at " if verb in ("rejected", "not committed") and bucket is not None else ""
        return RefitError(f"refit {verb} {at}{where}: "
                          f"{why}; live weights kept at version {self.version}{restored}",
                          bucket=bucket, tensors=names, kept_version=self.version, status=status,
                          receivers=receivers)

    def verify_live(self) -> bool:
        """True when the live bytes, re-packed, have the checksums the sender wrote for the last refit."""
        if not self.last_checksums:
            return False
        return all(checksum(payload) == self.last_checksums[b] for b, payload in self._live_buckets())

    def live_crc32(self) -> int:
        """``zlib.crc32`` of the live bytes as the stream: the sender's ``stream_crc32`` if intact."""
        crc = 0
        for _, payload in self._live_buckets():
            crc = zlib.crc32(payload.cpu().numpy(), crc)
        return crc

    def _live_buckets(self):
        """``(bucket, payload)`` of each bucket re-packed from the live tensors (one scratch buffer)."""
        if self.direct:  # the live arena is the stream itself
            yield from enumerate(self._landing)
            return
        scratch = torch.empty(max(self.layout.sizes), dtype=torch.uint8, device=self._trailer.device)
        for b in range(self.layout.num_buckets):
            payload = scratch[:self.layout.sizes[b]]
            pack_bucket(self.layout, b, self._views, payload)
            yield b, payload
