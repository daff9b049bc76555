"""StreamSender: one byte stream's sending end. Buckets lying in one storage go out from it, the others are
packed while earlier ones are on the wire, then the trailer; every broadcast has exactly its planned size
(gloo kills a receiver sent more than it posted). A failure sends the rest and an abort trailer, so receivers
fail at once and stay in step."""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..buckets import (
    DEFAULT_BUCKET_BYTES,
    STATUS_ABORT,
    TRAILER_FIXED,
    BucketLayout,
    byte_view,
    canonical_device,
    checksum,
    in_place_payload,
    make_trailer,
    pack_bucket,
)
from ..handshake import exchange_plans
from ..plan import RefitPlan
from ..results import AbortReason, RefitError, SendStats, Vote
from ..timing import Stopwatch
from ..transport import Transport
from . import delta as dl

_END = object()


class _TransportFailed(Exception):
    """The transport itself failed (a dead peer, a timeout): nothing more can be sent on it."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _wait(handle) -> None:
    """Complete a posted broadcast; a transport failure raises _TransportFailed."""
    try:
        handle.wait()
    except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
        raise _TransportFailed(exc) from exc


@dataclass
class _Run:
    """One refit in progress on the sender."""

    version: int
    items: Iterator
    slots: int
    checksums: Callable[[int, int], int] | None = None  # the producer's checksums of stream ranges (see send)
    sources: list = field(default_factory=list)  # flat uint8 views per entry (None once on the wire)
    pending: deque = field(default_factory=deque)  # (handle, pack slot or None, payload kept alive)
    crcs: list = field(default_factory=list)
    stream_crc: int = 0
    zero_copy: int = 0
    posted: int = 0  # bucket broadcasts posted
    released: int = 0  # sources before it are handed to the wire and dropped
    reason: AbortReason = AbortReason.INTERNAL  # what the step under way would abort for
    entry: int = -1  # the plan entry it concerns
    fill_base: bool = False  # delta stream: copy each bucket into the base as it goes out (no base yet)
    wire_bytes: int = 0  # payload bytes broadcast (a delta refit: the delta's)
    delta: bool = False  # this refit went out as a delta
    changed_words: int = 0  # words of the stream that differ from the base (-1: no base to compare)
    full_for: tuple = ()  # receivers (stream ranks) whose base did not match: the refit went out whole

    def __post_init__(self):
        self.slot_busy = [False] * self.slots


@dataclass(frozen=True)
class PendingSend:
    """One refit transmitted, waiting for the vote: ``error`` when it went out as an abort."""

    run: _Run
    stopwatch: Stopwatch
    error: BaseException | None

    @property
    def aborted(self) -> bool:
        return self.error is not None


class StreamSender:
    """The sending end of one byte stream: ``transport`` an endpoint whose rank is the sender, ``plan`` the
    :class:`RefitPlan`, ``bucket_bytes`` a positive multiple of 16 (the receivers', checked), ``use_checksum``
    a per-bucket checksum, ``device`` where the pack buffers live ("cpu" for gloo, the GPU for NCCL),
    ``inflight`` broadcasts and pack buffers in flight (>= 1), ``stream_crc32`` also a ``zlib.crc32`` of the
    stream, ``delta`` send only what changed since the version the receivers hold when every endpoint takes
    deltas (the sender keeps that version's bytes: one more copy of the stream)."""

    def __init__(self, transport: Transport, plan: RefitPlan, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 use_checksum: bool = True, device: str | torch.device = "cpu", inflight: int = 2,
                 stream_crc32: bool = False, delta: bool = False):
        if not isinstance(plan, RefitPlan):
            raise TypeError(f"plan must be a RefitPlan, got {type(plan).__name__}")
        if not transport.is_sender:
            raise ValueError(f"transport rank {transport.rank} is not the sender (src={transport.src})")
        if inflight < 1:
            raise ValueError(f"inflight must be >= 1, got {inflight}")
        if delta and not use_checksum:
            raise ValueError("delta=True needs use_checksum=True: the receivers check the patched stream "
                             "against the checksums of the new one")
        self.want_delta, self.delta = bool(delta), False
        self.base: dl.Base | None = None
        #: a delta stream: ``(bucket start, its BucketDelta)`` of the last refit diffed against a base
        self.last_changes: list = []
        self.transport, self.plan, self.use_checksum = transport, plan, use_checksum
        self.stream_crc32 = stream_crc32
        self.device = canonical_device(device)
        self.layout = layout = BucketLayout(plan, bucket_bytes)
        self.inflight = inflight
        self.version = 0
        # as large as the largest bucket (a bucket size beyond the plan's bytes allocates only those)
        self._packbuf = [torch.zeros(max(layout.sizes), dtype=torch.uint8, device=self.device)
                         for _ in range(min(inflight, layout.num_buckets))]
        # number of entries that must be available before bucket b (entries starting before its end)
        ends = [min((b + 1) * bucket_bytes, plan.total_bytes) for b in range(layout.num_buckets)]
        self._need = [sum(1 for e in plan.entries if e.offset < end) for end in ends]
        self._need[-1] = len(plan)

    def handshake(self) -> None:
        """Exchange plan digests with every receiver (RefitPlanMismatch on all sides on a mismatch)."""
        self.version, self.delta = exchange_plans(self.transport, self.plan, self.version,
                                                  self.layout.bucket_bytes, delta=self.want_delta)
        if self.delta and self.base is None:
            self.base = dl.Base(self.plan.total_bytes, self.device)

    def transmit(self, tensors: Iterable[torch.Tensor], *,
                 checksums: Callable[[int, int], int] | None = None) -> PendingSend:
        """Phase one of a refit: every bucket and the trailer (after a failure: the rest and an abort trailer,
        the error kept); then the vote and :meth:`conclude`. RefitError when the transport failed."""
        self.version += 1
        run = _Run(self.version, iter(tensors), len(self._packbuf), checksums)
        sw = Stopwatch()
        try:
            if self.delta:
                self._send_delta(run, sw)
            else:
                for b in range(self.layout.num_buckets):
                    self._send_bucket(run, b, sw)
            run.reason, run.entry = AbortReason.PRODUCER, -1
            if next(run.items, _END) is not _END:
                run.reason = AbortReason.COUNT
                raise ValueError(f"refit v{run.version}: more tensors than the {len(self.plan)} of the plan")
            with sw.phase("wait"):
                self._drain(run)
        except _TransportFailed as exc:
            raise self._transport_error(run, exc.error) from exc.error
        except BaseException as exc:
            if not self._abort(run, exc):
                raise
            return PendingSend(run, sw, exc)
        with sw.phase("wait"):
            try:
                _wait(self._post(make_trailer(run.version, run.crcs), self.layout.num_buckets))
            except _TransportFailed as exc:
                raise self._transport_error(run, exc.error) from exc.error
        return PendingSend(run, sw, None)

    def conclude(self, pending: PendingSend, vote: Vote) -> SendStats:
        """Phase three: the stats of ``pending`` under ``vote``, or the producer's error after an abort, or
        RefitError when some rank voted no."""
        if pending.error is not None:
            if self.base is not None:
                self.base.settle(pending.run.version, [], False)
            raise pending.error
        run, sw = pending.run, pending.stopwatch
        results = vote.results
        self._raise_rejections(run, vote)
        seconds = sw.elapsed()
        if self.base is not None:  # a refit sent while deltas were off did not bring the base up to date
            self.base.settle(run.version, run.crcs, vote.commit and self.delta)
        return SendStats(rank=self.transport.rank, version=run.version, bytes=self.plan.total_bytes,
                         buckets=self.layout.num_buckets,
                         zero_copy_buckets=run.zero_copy, seconds=seconds, produce_s=sw["produce"],
                         pack_s=sw["pack"], checksum_s=sw["checksum"], wait_s=sw["wait"],
                         stream_crc32=run.stream_crc if self.stream_crc32 else None,
                         gbps=self.plan.total_bytes / seconds / 1e9 if seconds > 0 else 0.0,
                         receivers=tuple(results), wire_bytes=run.wire_bytes, delta=run.delta,
                         changed_words=run.changed_words, delta_s=sw["delta"], full_for=run.full_for)

    def vote_failed(self, pending: PendingSend, exc: BaseException) -> BaseException:
        """The error when the vote on ``pending`` failed: an abort's error with a note, or RefitError."""
        if self.base is not None:
            self.base.settle(pending.run.version, [], False)
        if pending.error is not None:
            pending.error.add_note(f"(aborting the refit failed too: {type(exc).__name__}: {exc})")
            return pending.error
        return self._transport_error(pending.run, exc, in_vote=True)

    # -- one bucket ------------------------------------------------------------------------------------------
    def _send_bucket(self, run: _Run, b: int, sw: Stopwatch) -> None:
        with sw.phase("produce"):
            self._produce(run, b)
        run.reason, run.entry = AbortReason.INTERNAL, -1
        size = self.layout.sizes[b]
        gaps = self.layout.gap_index(b, self.device)
        payload = in_place_payload(self.layout.segments[b], gaps, run.sources, size, self.device)
        slot, crc = None, None
        if payload is None:
            slot = b % len(self._packbuf)
            with sw.phase("wait"):
                while run.slot_busy[slot]:  # wait until this pack buffer is off the wire
                    self._retire_oldest(run)
            payload = self._packbuf[slot][:size]
            with sw.phase("pack"):  # packing sums each chunk while it is in cache: checksum for one pass less
                crc = pack_bucket(self.layout, b, run.sources, payload,
                                  with_checksum=self.use_checksum and run.checksums is None)
        else:
            run.zero_copy += 1
        if self.stream_crc32:
            with sw.phase("checksum"):
                run.stream_crc = zlib.crc32(payload.cpu().numpy(), run.stream_crc)
        with sw.phase("wait"):
            while len(run.pending) >= self.inflight:
                self._retire_oldest(run)
        run.pending.append((self._post(payload, b), slot, payload))
        run.posted += 1
        run.wire_bytes += size
        if run.fill_base:
            with sw.phase("delta"):
                self.base.bucket(self.layout, b).copy_(payload)
        if slot is not None:
            run.slot_busy[slot] = True
        if self.use_checksum and crc is None:
            with sw.phase("checksum"):  # a zero-copy bucket is summed while it is on the wire
                crc = (checksum(payload) if run.checksums is None
                       else run.checksums(b * self.layout.bucket_bytes, size))
        run.crcs.append(crc if crc is not None else 0)
        # release sources that are fully handed to the wire (a generator's tensors can then be freed); entries
        # lie in stream order, so those not released yet start at run.released
        bucket_end, entries, i = b * self.layout.bucket_bytes + size, self.plan.entries, run.released
        while i < len(run.sources) and entries[i].offset + entries[i].nbytes <= bucket_end:
            run.sources[i] = None
            i += 1
        run.released = i

    # -- a delta stream -------------------------------------------------------------------------------------
    def _send_delta(self, run: _Run, sw: Stopwatch) -> None:
        """One refit of a delta stream: diff every bucket against the base (bringing it up to date), agree
        with the receivers whether each holds that base, then send the delta, or every bucket whole. A
        failure before the agreement still agrees (on whole buckets), then aborts as a full refit does."""
        n, base = self.layout.num_buckets, self.base
        payload, failed, run.changed_words, self.last_changes = None, None, -1, []
        if base.ok:
            try:
                deltas = [self._diff_bucket(run, b, sw) for b in range(n)]
                with sw.phase("delta"):
                    payload = dl.encode(deltas, self.plan.total_bytes)
                run.changed_words = sum(d.words for d in deltas)
                self.last_changes = [(b * self.layout.bucket_bytes, d) for b, d in enumerate(deltas)]
            except BaseException as exc:  # noqa: BLE001 - raised after the agreement: receivers stay in step
                failed, run.crcs = exc, []
        base.ok = False  # holds the new bytes (or will): trusted again once this refit is committed
        try:
            # a delta no smaller than the stream goes whole (a receiver would hold its payload for nothing)
            small = payload is not None and payload.numel() < self.plan.total_bytes
            decision = dl.agree(self.transport, payload.numel() if small else -1, base.version,
                                base.digest, dl.max_payload(self.layout.sizes))
        except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
            raise _TransportFailed(exc) from exc
        run.full_for = decision.full_for
        if failed is not None:
            raise failed
        if decision.delta:
            run.delta = True
            self._send_payload(run, payload, sw)
            return
        run.crcs, run.stream_crc, run.fill_base = [], 0, payload is None
        for b in range(n):
            self._send_bucket(run, b, sw)

    def _diff_bucket(self, run: _Run, b: int, sw: Stopwatch) -> dl.BucketDelta:
        """Bucket ``b`` produced and summed, its change from the base, the base brought up to it."""
        with sw.phase("produce"):
            self._produce(run, b)
        size = self.layout.sizes[b]
        new = in_place_payload(self.layout.segments[b], self.layout.gap_index(b, self.device), run.sources,
                               size, self.device)
        crc = None
        if new is None:
            new = self._packbuf[0][:size]
            with sw.phase("pack"):
                crc = pack_bucket(self.layout, b, run.sources, new, with_checksum=run.checksums is None)
        with sw.phase("checksum"):
            if crc is None:
                crc = (checksum(new) if run.checksums is None
                       else run.checksums(b * self.layout.bucket_bytes, size))
            run.crcs.append(crc)
            if self.stream_crc32:
                run.stream_crc = zlib.crc32(new.cpu().numpy(), run.stream_crc)
        with sw.phase("delta"):
            return dl.diff_bucket(self.base.bucket(self.layout, b), new, self.base.scratch)

    def _send_payload(self, run: _Run, payload: torch.Tensor, sw: Stopwatch) -> None:
        """Broadcast a delta payload in pieces of at most the bucket size (the receivers know its length)."""
        B = self.layout.bucket_bytes
        with sw.phase("wait"):
            for start in range(0, payload.numel(), B):
                piece = payload[start:start + B].to(self.device)
                try:
                    self.transport.broadcast(piece, async_op=True).wait()
                except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError
                    raise _TransportFailed(exc) from exc
        run.wire_bytes = int(payload.numel())
        run.posted = self.layout.num_buckets

    def _produce(self, run: _Run, b: int) -> None:
        """Take the items bucket ``b`` needs from the iterator, each checked against its plan entry."""
        while len(run.sources) < self._need[b]:
            i = run.entry = len(run.sources)
            run.reason = AbortReason.PRODUCER
            t = next(run.items, _END)
            if t is _END:
                run.reason = AbortReason.COUNT
                raise ValueError(f"refit v{run.version}: got {i} tensors, the plan has {len(self.plan)} "
                                 f"(first missing: {self.plan.entries[i].name!r})")
            run.reason = AbortReason.BAD_TENSOR
            self.plan.check_tensor(i, t)
            run.sources.append(byte_view(t, argname=self.plan.entries[i].name))

    # -- the wire --------------------------------------------------------------------------------------------
    def _post(self, payload: torch.Tensor, b: int):
        """Broadcast bucket ``b`` (``num_buckets``: the trailer) asynchronously, of its planned size only."""
        n = self.layout.num_buckets
        want = self._planned_size(b) if b < n else (TRAILER_FIXED + n) * 8
        got = payload.nbytes
        if payload.dim() != 1 or got != want:
            raise RuntimeError(f"refit v{self.version}: {'bucket ' + str(b) if b < n else 'the trailer'} is "
                               f"{got} bytes but the plan gives it {want}: not sent")
        try:
            return self.transport.broadcast(payload.to(self.device), async_op=True)
        except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
            raise _TransportFailed(exc) from exc

    def _planned_size(self, b: int) -> int:
        """Bucket ``b``'s size from the plan and the bucket size, independent of the layout."""
        B = self.layout.bucket_bytes
        return min(B, self.plan.total_bytes - b * B)

    def _retire_oldest(self, run: _Run) -> None:
        """Wait for the oldest in-flight broadcast and free its pack buffer slot."""
        handle, slot, _ = run.pending.popleft()
        _wait(handle)
        if slot is not None:
            run.slot_busy[slot] = False

    def _drain(self, run: _Run) -> None:
        while run.pending:
            self._retire_oldest(run)

    def _raise_rejections(self, run: _Run, vote: Vote) -> None:
        if vote.commit:
            return
        # the receivers that voted no; when none did, the other sender(s) that aborted (sharded refit)
        bad = [r for r in vote.no if r.rank not in vote.sender_ranks] or vote.no
        results = vote.results
        parts = "; ".join(r.describe(self.layout.num_buckets, vote.sender_ranks) for r in bad)
        raise RefitError(f"refit v{run.version} was rejected by {len(bad)} of {len(results)} receiver(s): "
                         f"{parts}; no receiver committed it (every one keeps its previous weights)",
                         bucket=bad[0].bucket if bad[0].bucket >= 0 else None,
                         kept_version=min(r.version for r in bad), status=bad[0].status, receivers=results)

    def _transport_error(self, run: _Run, error: BaseException, in_vote: bool = False) -> RefitError:
        """A dead receiver or a timeout during refit ``run``: before the vote no receiver commits; within it,
        those that had every row may have (the message says so)."""
        outcome = ("receivers that had every vote may have committed it, the others keep their previous "
                   "weights: refit again" if in_vote else
                   "no receiver commits this refit (each keeps its previous weights)")
        return RefitError(f"refit v{run.version} failed: the transport failed "
                          f"{'during the vote ' if in_vote else ''}({type(error).__name__}: {error}); a "
                          f"receiver died or timed out, so {outcome}; re-create the group",
                          kept_version=run.version - 1)

    def _abort(self, run: _Run, error: BaseException) -> bool:
        """Send the buckets not posted yet and an abort trailer, so receivers fail at once and stay in step;
        False (with a note on ``error``) when the transport failed meanwhile."""
        try:
            self._drain(run)
            buf = self._packbuf[0]
            for b in range(run.posted, self.layout.num_buckets):
                self._post(buf[:self._planned_size(b)], b).wait()
            trailer = make_trailer(run.version, [0] * self.layout.num_buckets, STATUS_ABORT, run.entry,
                                   run.reason)
            self._post(trailer, self.layout.num_buckets).wait()
        except BaseException as exc:  # noqa: BLE001 - report the first error; this one rides along as a note
            error.add_note(f"(aborting the refit failed too: {type(exc).__name__}: {exc})")
            return False
        return True
