"""What a refit reports: status codes, votes, results, stats and :class:`RefitError`."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from enum import IntEnum

import torch


class Status(IntEnum):
    """A receiver's outcome of one refit (word 0 of its status report)."""

    OK = 0
    ABORTED = 1  # the sender aborted the refit (its trailer says so)
    CHECKSUM = 2  # a bucket's checksum differs from the sender's
    STALE = 3  # the refit's version is not newer than the live one
    BAD_TRAILER = 4  # the trailer's magic or bucket count is wrong
    LIVE_CHANGED = 5  # a live tensor was moved, or its dtype / shape changed, since the receiver was built
    COMMIT_FAILED = 6  # writing the live tensors or a refresh hook failed
    PEER_REJECTED = 7  # this receiver accepted, another rank voted no: no rank committed
    REPLICA_DRIFT = 8  # a trainer rank's copy of a replicated box differs from another holder's (sharded)
    BAD_DELTA = 9  # a delta refit's payload does not fit this stream (sizes, indices, masks)


class AbortReason(IntEnum):
    """Why the sender aborted (the trailer's reason word)."""

    NONE = 0
    BAD_TENSOR = 1  # an item does not match its plan entry (type, device, dtype, shape, layout)
    COUNT = 2  # too few or too many tensors
    PRODUCER = 3  # the ``tensors`` iterator raised
    INTERNAL = 4  # the sender itself failed (a bucket of the wrong size, a packing error)


#: words of one status report: ``[status, bucket, entry, version]`` (bucket / entry -1 when none)
REPORT_WORDS = 4


@dataclass(frozen=True)
class ReceiverResult:
    """One receiver's outcome of a refit: rank, :class:`Status`, bucket / entry where it failed (-1: nowhere
    in particular), and the version live on it afterwards."""

    rank: int
    status: Status
    bucket: int
    entry: int
    version: int

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def describe(self, num_buckets: int, src: int | Collection[int] = 0) -> str:
        """``receiver 2: checksum at bucket 0 (live version 1)``; ``src``: the sender's rank, or the sender
        ranks of a vote with several."""
        if self.rank in ((src,) if isinstance(src, int) else src):
            return f"the sender: {self.status.name.lower()}"
        where = f" at bucket {self.bucket}" if 0 <= self.bucket < num_buckets else ""
        return f"receiver {self.rank}: {self.status.name.lower()}{where} (live version {self.version})"

    def to_dict(self) -> dict:
        return {**asdict(self), "status": self.status.name.lower()}

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([int(self.status), self.bucket, self.entry, self.version], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, rank: int, t: torch.Tensor) -> ReceiverResult:
        """Parse a peer's report; an unknown status code reads as ``COMMIT_FAILED`` (never ok)."""
        status, bucket, entry, version = (int(x) for x in t.tolist())
        try:
            st = Status(status)
        except ValueError:
            st = Status.COMMIT_FAILED
        return cls(rank, st, bucket, entry, version)


@dataclass(frozen=True)
class Vote:
    """One refit's vote, the same on every rank: every rank's fixed-size row (a receiver's verdict and live
    version, a sender's ``OK`` or ``ABORTED`` and the refit's version); ``commit`` when every row is
    ``OK``."""

    src: int
    rows: tuple[ReceiverResult, ...]
    senders: frozenset[int] = frozenset()

    @classmethod
    def tally(cls, rows: Sequence[torch.Tensor], src: int, senders: Collection[int] = ()) -> Vote:
        """The vote of ``rows`` (row ``r`` from rank ``r``)."""
        senders = frozenset(senders)
        if senders and src not in senders:
            raise ValueError(f"src {src} must be one of the senders {sorted(senders)}")
        return cls(src, tuple(ReceiverResult.from_tensor(r, t) for r, t in enumerate(rows)), senders)

    @property
    def sender_ranks(self) -> frozenset[int]:
        """The ranks that sent (``{src}`` unless ``senders`` says more)."""
        return self.senders or frozenset((self.src,))

    @property
    def version(self) -> int:
        """The refit's version: the highest among the senders' rows."""
        return max(self.rows[s].version for s in self.sender_ranks)

    @property
    def commit(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def no(self) -> list[ReceiverResult]:
        """The rows that voted no (a sender's abort included)."""
        return [r for r in self.rows if not r.ok]

    @property
    def results(self) -> list[ReceiverResult]:
        """Each receiver's final result: ``OK`` at the refit's version when committed; otherwise its own
        rejection, or ``PEER_REJECTED`` where it voted yes, at the version it kept."""
        out = []
        for r in self.rows:
            if r.rank in self.sender_ranks:
                continue
            if self.commit:
                r = ReceiverResult(r.rank, Status.OK, -1, -1, self.version)
            elif r.ok:
                r = ReceiverResult(r.rank, Status.PEER_REJECTED, -1, -1, r.version)
            out.append(r)
        return out


class RefitError(RuntimeError):
    """A refit failed; the live weights stayed on ``kept_version``. ``bucket`` / ``tensors``: where;
    ``receivers``: every receiver's :class:`ReceiverResult` once the ranks voted."""

    def __init__(self, message: str, *, bucket: int | None = None, tensors: Sequence[str] = (),
                 kept_version: int = 0, status: Status | None = None,
                 receivers: Sequence[ReceiverResult] = ()):
        self.bucket, self.tensors, self.kept_version = bucket, list(tensors), kept_version
        self.status, self.receivers = status, list(receivers)
        super().__init__(message)


class ResultRow:
    """Frozen result rows: :meth:`to_dict` gives the JSON form; ``row[key]`` reads one key of it."""

    def to_dict(self) -> dict:
        out = {}
        for f in self.__dataclass_fields__:  # type: ignore[attr-defined]
            v = getattr(self, f)
            out[f] = [x.to_dict() if hasattr(x, "to_dict") else x for x in v] if isinstance(v, tuple) else v
        return out

    def __getitem__(self, key: str):
        return self.to_dict()[key]


@dataclass(frozen=True)
class StreamStats(ResultRow):
    """One byte stream of a refit as this rank saw it: its sender (``trainer``), its receivers (``engines``),
    bytes, buckets, and the seconds this rank spent on it."""

    trainer: int
    engines: tuple[int, ...]
    bytes: int
    buckets: int
    seconds: float


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _summed(parts: Sequence, *fields: str) -> dict:
    return {f: sum(getattr(p, f) for p in parts) for f in fields}


@dataclass(frozen=True)
class SendStats(ResultRow):
    """One refit as a trainer rank saw it (all its streams): ``seconds`` up to the vote, ``produce_s`` inside
    the producer (e.g. quantize), ``stream_crc32`` (one stream, when asked), ``receivers`` every engine rank's
    result, ``streams`` one :class:`StreamStats` each."""

    rank: int
    version: int
    bytes: int
    buckets: int
    zero_copy_buckets: int
    seconds: float
    produce_s: float
    pack_s: float
    checksum_s: float
    wait_s: float
    stream_crc32: int | None
    gbps: float
    receivers: tuple[ReceiverResult, ...]
    streams: tuple[StreamStats, ...] = ()
    #: delta streams: payload bytes on the wire (``bytes``: the full stream's), whether every stream went out
    #: as a delta, the stream's words that changed (-1: no base to compare), seconds diffing, and the
    #: receivers (stream ranks) whose base did not match, so the refit went out whole
    wire_bytes: int = 0
    delta: bool = False
    changed_words: int = 0
    delta_s: float = 0.0
    full_for: tuple[int, ...] = ()

    @classmethod
    def total(cls, rank: int, version: int, parts: Sequence[SendStats], streams: Sequence[StreamStats],
              seconds: float, receivers: Sequence[ReceiverResult]) -> SendStats:
        """One rank's stats of a refit from its streams' (``parts``)."""
        s = _summed(parts, "bytes", "buckets", "zero_copy_buckets", "produce_s", "pack_s", "checksum_s",
                    "wait_s", "wire_bytes", "delta_s")
        changed = [p.changed_words for p in parts]
        return cls(rank=rank, version=version, seconds=seconds, gbps=_rate(s["bytes"], seconds),
                   stream_crc32=parts[0].stream_crc32 if len(parts) == 1 else None,
                   receivers=tuple(receivers), streams=tuple(streams),
                   delta=bool(parts) and all(p.delta for p in parts),
                   changed_words=-1 if -1 in changed else sum(changed),
                   full_for=tuple(r for p in parts for r in p.full_for), **s)


@dataclass(frozen=True)
class ReceiveStats(ResultRow):
    """One refit as an engine rank saw it (all its streams): ``seconds`` from the first bucket to the commit
    (sharded: the whole call), ``idle_s`` waiting for the first bucket, ``backup_s`` / ``backup_wait_s``
    direct mode's rollback copy, ``streams`` one :class:`StreamStats` each."""

    rank: int
    version: int
    bytes: int
    buckets: int
    direct: bool
    seconds: float
    idle_s: float
    recv_s: float
    commit_s: float
    gbps: float
    backup_s: float
    backup_wait_s: float
    streams: tuple[StreamStats, ...] = ()
    wire_bytes: int = 0  # payload bytes received (a delta refit: the delta's)
    delta: bool = False  # every stream of this rank took the refit as a delta

    @classmethod
    def total(cls, rank: int, version: int, parts: Sequence[ReceiveStats], streams: Sequence[StreamStats],
              seconds: float) -> ReceiveStats:
        """One rank's stats of a refit from its streams' (``parts``)."""
        s = _summed(parts, "bytes", "buckets", "idle_s", "recv_s", "commit_s", "backup_s", "backup_wait_s",
                    "wire_bytes")
        return cls(rank=rank, version=version, direct=bool(parts) and all(p.direct for p in parts),
                   delta=bool(parts) and all(p.delta for p in parts),
                   seconds=seconds, gbps=_rate(s["bytes"], seconds), streams=tuple(streams), **s)
