"""Sharded refit: T trainer ranks and E engine ranks in one process group (the "world"), each (trainer,
engine) pair that has bytes to move with its own pair stream — an ordinary :class:`RefitPlan` sent from that
trainer to that engine only, over a :class:`~mxport.refit.transport.PairTransport` — and ONE vote over the
whole world: every engine rank commits all its pair streams or none, and every trainer rank learns the
outcome.

1. Every rank processes its own pairs in :func:`pair_order` (a global order without cycles, so no rank waits
   on a rank that waits on it; with T == E each round is a perfect matching and the pairs run in parallel).
2. Handshake: one world ``all_gather`` of ``[HELLO, global plan digest (4 int64 words), version]`` — every
   rank must give the caller's same global digest, else :class:`RefitPlanMismatch` on every rank — then each
   pair's own plan handshake, in pair order.
3. A refit: trainers transmit each pair stream (buckets + trailer), engines stage each one (receive and
   validate, nothing written to the live tensors: staging mode); then every world rank gives one row
   ``[status, bucket, entry, version, peer]`` in one ``all_gather`` (a :class:`Vote` with every trainer rank
   as a sender; ``peer``: the other end of the pair a rejection concerns, -1 for none); engines settle every
   pair with that vote (all commit or all roll back), trainers raise :class:`RefitError` naming every rank
   that voted no.

A dead peer or a timeout raises :class:`RefitError` on the ranks still alive (within about the group's timeout
per blocked operation); staged pairs are dropped, so the live weights keep their previous version. The group
is then unusable: re-create it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .plan import RefitPlan, RefitPlanMismatch
from .receiver import RefitReceiver, Staged
from .results import REPORT_WORDS, ReceiverResult, ReceiveStats, RefitError, Status, Vote, _Row
from .sender import PendingSend, RefitSender
from .transport import PAIR_TAG, PairTransport, Transport

#: "MXRFTSH" and the sharded handshake's version (1)
SHARD_HELLO = 0x4D58524654534801


def pair_order(trainers: Sequence[int], engines: Sequence[int]) -> list[tuple[int, int]]:
    """Every (trainer rank, engine rank) pair once, in the order every rank processes its own pairs: sorted by
    ``(round, t_index, e_index)`` with ``round = (e_index - t_index) mod max(T, E)``.

    Each round pairs every trainer with at most one engine and every engine with at most one trainer (a
    perfect matching when T == E), so the pairs of one round run in parallel; and the lowest unfinished pair
    always has both its ends on it, so ranks that each follow this order (skipping pairs without bytes) never
    wait on each other in a cycle.
    """
    trainers, engines = [int(t) for t in trainers], [int(e) for e in engines]
    ranks = trainers + engines
    if not trainers or not engines:
        raise ValueError(f"need at least one trainer and one engine rank, got {trainers} and {engines}")
    if len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise ValueError(f"trainer and engine ranks must be distinct non-negative ints, got {trainers} and "
                         f"{engines}")
    m = max(len(trainers), len(engines))
    keys = sorted(((ei - ti) % m, ti, ei) for ti in range(len(trainers)) for ei in range(len(engines)))
    return [(trainers[ti], engines[ei]) for _, ti, ei in keys]


@dataclass(frozen=True)
class PairStats(_Row):
    """One pair stream of a sharded refit: its two world ranks, its bytes and buckets, and the seconds this
    rank spent on it (the trainer transmitting, the engine receiving and validating)."""

    trainer: int
    engine: int
    bytes: int
    buckets: int
    seconds: float


def _pairs_dict(row) -> dict:
    out = {f: getattr(row, f) for f in row.__dataclass_fields__}
    out["pairs"] = [p.to_dict() for p in row.pairs]
    if "results" in out:
        out["results"] = [r.to_dict() for r in row.results]
    return out


@dataclass(frozen=True)
class ShardedSendStats(_Row):
    """One sharded refit as a trainer rank saw it: ``rank`` (its world rank), ``version``, ``bytes`` (all its
    pair streams), ``seconds`` (up to the vote's outcome), ``gbps``, ``pairs`` (:class:`PairStats`, in pair
    order), ``results`` (every engine rank's :class:`ReceiverResult`)."""

    rank: int
    version: int
    bytes: int
    seconds: float
    gbps: float
    pairs: tuple[PairStats, ...]
    results: tuple[ReceiverResult, ...]

    def to_dict(self) -> dict:
        return _pairs_dict(self)


@dataclass(frozen=True)
class ShardedReceiveStats(_Row):
    """One sharded refit as an engine rank saw it: ``rank``, ``version`` (now live), ``bytes`` (all its pair
    streams), ``seconds`` (the whole call: receiving, the vote, the commits), ``commit_s`` (the commits),
    ``gbps``, ``pairs`` (:class:`PairStats`, in pair order)."""

    rank: int
    version: int
    bytes: int
    seconds: float
    commit_s: float
    gbps: float
    pairs: tuple[PairStats, ...]

    def to_dict(self) -> dict:
        return _pairs_dict(self)


@dataclass(frozen=True)
class WorldVote:
    """The world's vote on one sharded refit: the :class:`Vote` (every trainer rank a sender) and, per rank,
    the other end of the pair its row concerns (-1: none)."""

    vote: Vote
    peers: tuple[int, ...]

    def describe(self, r: ReceiverResult) -> str:
        """``engine rank 3: checksum at bucket 1 of the pair with trainer rank 0 (live version 1)``."""
        trainer = r.rank in self.vote.sender_ranks
        peer = self.peers[r.rank]
        where = f" at bucket {r.bucket}" if r.bucket >= 0 else ""
        pair = (f" {'of' if where else 'in'} the pair with {'engine' if trainer else 'trainer'} rank {peer}"
                if peer >= 0 else "")
        live = "" if trainer else f" (live version {r.version})"
        who = "trainer" if trainer else "engine"
        return f"{who} rank {r.rank}: {r.status.name.lower()}{where}{pair}{live}"

    def rejections(self) -> str:
        return "; ".join(self.describe(r) for r in self.vote.no)


def world_vote(world: Transport, row: ReceiverResult, peer: int, trainers: Sequence[int]) -> WorldVote:
    """Every world rank's row (``row`` plus ``peer``) in one ``all_gather``; ``trainers``: the senders."""
    mine = torch.cat([row.to_tensor(), torch.tensor([peer], dtype=torch.int64)])
    rows = world.all_gather(mine)
    vote = Vote.tally([r[:REPORT_WORDS] for r in rows], min(trainers), trainers)
    return WorldVote(vote, tuple(int(r[REPORT_WORDS]) for r in rows))


def _check_digest(global_digest: str) -> bytes:
    try:
        raw = bytes.fromhex(global_digest)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"global_digest must be a hex sha256 (64 hex digits), got {global_digest!r}")
    return raw


def agree_global(world: Transport, global_digest: str, version: int) -> int:
    """The world handshake: every rank gives ``[SHARD_HELLO, digest words, version]``; returns the highest
    version. Raises :class:`RefitError` for a rank that does not speak it, :class:`RefitPlanMismatch` (on
    every rank) when any rank's global digest differs."""
    raw = _check_digest(global_digest)
    head = torch.tensor([SHARD_HELLO], dtype=torch.int64)
    digest = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    rows = world.all_gather(torch.cat([head, digest, torch.tensor([int(version)], dtype=torch.int64)]))
    strangers = [r for r, row in enumerate(rows) if int(row[0]) != SHARD_HELLO]
    if strangers:
        raise RefitError(f"rank {strangers[0]} does not speak the mxport sharded refit handshake; re-create "
                         "the group")
    digests = [row[1:5].numpy().tobytes().hex() for row in rows]
    versions = [int(row[5]) for row in rows]
    if min(versions) < 0:
        raise RefitError(f"rank {versions.index(min(versions))} reported a negative refit version")
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        diffs = [f"rank {r}: global plan digest {digests[r][:16]}... (rank 0: {digests[0][:16]}...)"
                 for r in bad]
        raise RefitPlanMismatch(diffs, local_digest=raw.hex(), remote_digest=digests[bad[0]])
    return max(versions)


def _pair_transport(world: Transport, trainer: int, engine: int, tag: int) -> PairTransport:
    pg = getattr(world, "process_group", None)
    if pg is None:
        raise TypeError(f"world must be a transport over a process group (TorchDistTransport), got "
                        f"{type(world).__name__}")
    return PairTransport(pg, trainer, engine, tag=tag)


def _check_trainers(world: Transport, trainers: Sequence[int], is_trainer: bool) -> tuple[int, ...]:
    out = tuple(int(t) for t in trainers)
    if not out or len(set(out)) != len(out) or not all(0 <= t < world.world_size for t in out):
        raise ValueError(f"trainers must be distinct ranks of the world (size {world.world_size}), got {out}")
    if (world.rank in out) != is_trainer:
        role = "trainer" if is_trainer else "engine"
        raise ValueError(f"world rank {world.rank} is {'not ' if is_trainer else ''}one of the trainer ranks "
                         f"{list(out)}, so it cannot be a sharded {role} endpoint")
    return out


class ShardedSender:
    """A trainer rank of a sharded refit.

    Args:
        world: this rank's transport over the whole world group (a :class:`TorchDistTransport`; its process
            group also carries the pair streams).
        pairs: ``(engine world rank, that pair's RefitPlan)`` for every pair of this trainer that has bytes
            to move, in :func:`pair_order` (may be empty: the rank still votes).
        global_digest: the hex sha256 of the whole refit's plan, the same on every world rank (checked).
        trainers: the world ranks of all trainers (the senders of the vote); this rank among them.
        tag: the pair streams' message tag.
        sender_kwargs: passed to each pair's :class:`RefitSender` (``use_checksum``, ``inflight``, ...).
    """

    def __init__(self, world: Transport, pairs: Sequence[tuple[int, RefitPlan]], *, global_digest: str,
                 trainers: Sequence[int], tag: int = PAIR_TAG, **sender_kwargs):
        _check_digest(global_digest)
        self.world, self.global_digest = world, global_digest
        self.trainers = _check_trainers(world, trainers, True)
        self.engines = [int(e) for e, _ in pairs]
        if len(set(self.engines)) != len(self.engines) or any(e in self.trainers for e in self.engines):
            raise ValueError(f"pairs: each engine rank once, none a trainer rank, got {self.engines}")
        self.senders = [RefitSender(_pair_transport(world, world.rank, e, tag), plan, **sender_kwargs)
                        for e, plan in pairs]
        self.version = 0
        self._handshaken = False

    def handshake(self) -> None:
        """The world digest agreement, then each pair's plan handshake in pair order."""
        self.version = agree_global(self.world, self.global_digest, self.version)
        for s in self.senders:
            s.version = self.version
            s.handshake()
            self.version = max(self.version, s.version)
        self._handshaken = True

    def send(self, streams: Mapping[int, Iterable[torch.Tensor]]) -> ShardedSendStats:
        """One sharded refit: ``streams[engine]`` yields that pair's tensors in its plan's order (as
        :meth:`RefitSender.send`). Transmits each pair in order, votes once over the world, then concludes.

        A producer that fails aborts its pair (and this rank sends the rest of its pairs as aborts without
        asking their producers): the engines commit nothing and the producer's error is raised here after the
        vote.

        Raises:
            RefitError: some rank voted no (``receivers``: every engine rank's result; the message names each
                rank that voted no, why and in which pair), or a transport failed (a dead peer, a timeout).
        """
        if not self._handshaken:
            self.handshake()
        self.version += 1
        t0 = time.perf_counter()
        pendings, pair_stats = self._transmit_all(streams)
        aborted = next((i for i, p in enumerate(pendings) if p.aborted), None)
        row = ReceiverResult(self.world.rank, Status.OK if aborted is None else Status.ABORTED, -1, -1,
                             self.version)
        try:
            wv = world_vote(self.world, row, -1 if aborted is None else self.engines[aborted], self.trainers)
        except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
            raise RefitError(f"sharded refit v{self.version} failed: the world vote failed "
                             f"({type(exc).__name__}: {exc}); a rank died or timed out, so engine ranks that "
                             "had every row may have committed it, the others keep their previous weights: "
                             "re-create the group and refit again", kept_version=self.version - 1) from exc
        if aborted is not None:
            self.senders[aborted].conclude(pendings[aborted], wv.vote)  # raises the producer's error
        return self._conclude(pendings, pair_stats, wv, time.perf_counter() - t0)

    def _transmit_all(self, streams: Mapping[int, Iterable[torch.Tensor]]):
        """Transmit every pair in order; after the first abort the rest go out as aborts too."""
        unknown = sorted(set(streams) - set(self.engines))
        failed: BaseException | None = None
        if unknown:
            failed = ValueError(f"streams for engine ranks {unknown}, which have no pair with trainer rank "
                                f"{self.world.rank} (pairs: {self.engines})")
        pendings: list[PendingSend] = []
        stats: list[PairStats] = []
        for e, s in zip(self.engines, self.senders, strict=True):
            if failed is None and e not in streams:
                failed = ValueError(f"no stream for engine rank {e} (trainer rank {self.world.rank})")
            s.version = self.version - 1  # every pair stream carries the sharded refit's version
            t0 = time.perf_counter()
            try:
                p = s.transmit(streams[e] if failed is None else _refusing(failed, e))
            except RefitError as exc:
                exc.add_note(f"(sharded refit v{self.version}: the pair stream from trainer rank "
                             f"{self.world.rank} to engine rank {e})")
                raise
            pendings.append(p)
            stats.append(PairStats(self.world.rank, e, s.plan.total_bytes, s.plan.num_buckets,
                                   time.perf_counter() - t0))
            if p.aborted and failed is None:
                failed = p.error
        return pendings, stats

    def _conclude(self, pendings, pair_stats, wv: WorldVote, seconds: float) -> ShardedSendStats:
        vote = wv.vote
        if not vote.commit:
            bad = vote.no
            raise RefitError(f"sharded refit v{self.version} was rejected by {len(bad)} rank(s): "
                             f"{wv.rejections()}; no engine rank committed it (every one keeps its previous "
                             "weights)", kept_version=self.version - 1, status=bad[0].status,
                             bucket=bad[0].bucket if bad[0].bucket >= 0 else None, receivers=vote.results)
        for s, p in zip(self.senders, pendings, strict=True):
            s.conclude(p, vote)
        total = sum(p.bytes for p in pair_stats)
        return ShardedSendStats(rank=self.world.rank, version=self.version, bytes=total, seconds=seconds,
                                gbps=total / seconds / 1e9 if seconds > 0 else 0.0, pairs=tuple(pair_stats),
                                results=tuple(vote.results))


def _refusing(error: BaseException, engine: int) -> Iterator[torch.Tensor]:
    """A producer that fails at once: a pair stream sent as an abort because an earlier pair aborted."""
    raise RuntimeError(f"not sent to engine rank {engine}: an earlier pair stream of this trainer aborted "
                       f"({type(error).__name__}: {error})")
    yield  # pragma: no cover - makes this a generator


class ShardedReceiver:
    """An engine rank of a sharded refit.

    Args:
        world: this rank's transport over the whole world group (see :class:`ShardedSender`).
        pairs: ``(trainer world rank, that pair's RefitPlan, its live target tensors)`` for every pair of this
            engine that has bytes to move, in :func:`pair_order` (may be empty: the rank still votes).
        global_digest, trainers, tag: as :class:`ShardedSender`.
        receiver_kwargs: passed to each pair's :class:`RefitReceiver` (``use_checksum``, ``refresh_hooks``,
            ``inflight``); always in staging mode, so nothing is written before the world vote.
    """

    def __init__(self, world: Transport, pairs: Sequence[tuple[int, RefitPlan, Sequence[torch.Tensor]]], *,
                 global_digest: str, trainers: Sequence[int], tag: int = PAIR_TAG, **receiver_kwargs):
        _check_digest(global_digest)
        self.world, self.global_digest = world, global_digest
        self.trainers = _check_trainers(world, trainers, False)
        self.peers = [int(t) for t, _, _ in pairs]
        if len(set(self.peers)) != len(self.peers) or any(t not in self.trainers for t in self.peers):
            raise ValueError(f"pairs: each trainer rank once, each one of {list(self.trainers)}, got "
                             f"{self.peers}")
        self.receivers = [RefitReceiver(_pair_transport(world, t, world.rank, tag), plan, targets,
                                        direct=False, **receiver_kwargs) for t, plan, targets in pairs]
        self.version = 0
        self._handshaken = False

    def handshake(self) -> None:
        """The world digest agreement, then each pair's plan handshake in pair order."""
        self.version = agree_global(self.world, self.global_digest, self.version)
        for r in self.receivers:
            r.handshake()
        self._handshaken = True

    def receive(self) -> ShardedReceiveStats:
        """One sharded refit: stage every pair in order, vote once over the world with this rank's first
        problem (or ok), then settle every pair with that vote — all commit, or all roll back.

        Raises:
            RefitError: some rank voted no (this rank's own reason first, then every other rank's), or a
                transport failed; the live tensors of every pair keep their previous version.
        """
        if not self._handshaken:
            self.handshake()
        t0 = time.perf_counter()
        staged, pair_stats = self._stage_all()
        first = next((i for i, s in enumerate(staged) if not s.ok), None)
        row = ReceiverResult(self.world.rank, Status.OK, -1, -1, self.version)
        if first is not None:
            own = self.receivers[first].verdict(staged[first])
            row = ReceiverResult(self.world.rank, own.status, own.bucket, own.entry, self.version)
        try:
            wv = world_vote(self.world, row, -1 if first is None else self.peers[first], self.trainers)
        except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
            self._discard(staged)
            raise RefitError(f"sharded refit not committed on engine rank {self.world.rank}: every pair was "
                             f"received, but the world vote failed ({type(exc).__name__}: {exc}): a rank "
                             f"died or timed out; live weights kept at version {self.version}",
                             kept_version=self.version) from exc
        return self._settle_all(staged, pair_stats, wv, first, t0)

    def _stage_all(self) -> tuple[list[Staged], list[PairStats]]:
        staged: list[Staged] = []
        stats: list[PairStats] = []
        for t, r in zip(self.peers, self.receivers, strict=True):
            t0 = time.perf_counter()
            try:
                staged.append(r.stage())
            except RefitError as exc:  # a transport failure: this pair rolled back already
                self._discard(staged)
                exc.add_note(f"(sharded refit on engine rank {self.world.rank}: the pair stream from trainer "
                             f"rank {t}; no pair committed, live weights kept at version {self.version})")
                raise
            stats.append(PairStats(t, self.world.rank, r.plan.total_bytes, r.plan.num_buckets,
                                   time.perf_counter() - t0))
        return staged, stats

    def _discard(self, staged: Sequence[Staged]) -> None:
        for r, s in zip(self.receivers, staged, strict=False):
            r.discard(s)

    def _settle_all(self, staged: list[Staged], pair_stats: list[PairStats], wv: WorldVote,
                    first: int | None, t0: float) -> ShardedReceiveStats:
        """Settle every pair with the world vote; raise the first failure once every pair is settled."""
        t_commit = time.perf_counter()
        done: list[ReceiveStats] = []
        errors: list[RefitError] = []
        for r, s in zip(self.receivers, staged, strict=True):
            try:
                done.append(r.settle(s, wv.vote))
            except RefitError as exc:
                errors.append(exc)
        if not wv.vote.commit:
            raise self._rejection(staged, wv, first)
        self.version = wv.vote.version
        if errors:  # a refresh hook failed after a unanimous yes (see RefitReceiver.settle)
            raise errors[0]
        end = time.perf_counter()
        seconds = end - t0
        total = sum(p.bytes for p in pair_stats)
        gbps = total / seconds / 1e9 if seconds > 0 else 0.0
        return ShardedReceiveStats(rank=self.world.rank, version=self.version, bytes=total, seconds=seconds,
                                   commit_s=end - t_commit, gbps=gbps, pairs=tuple(pair_stats))

    def _rejection(self, staged: list[Staged], wv: WorldVote, first: int | None) -> RefitError:
        """The RefitError of a sharded refit some rank voted no on: this rank's own reason (its first pair
        that rejected, with the bucket's tensors), then every other rank that voted no."""
        me = self.world.rank
        others = "; ".join(wv.describe(r) for r in wv.vote.no if r.rank != me)
        bucket, names, status, why = None, [], Status.PEER_REJECTED, f"rejected by {others}"
        if first is not None:
            p, r = staged[first].problem, self.receivers[first]
            bucket, status = p.bucket, p.status
            names = r.layout.tensor_names(bucket) if bucket is not None else []
            where = f" at bucket {bucket} (tensors: {', '.join(dict.fromkeys(names))})" if names else ""
            why = (f"the pair stream from trainer rank {self.peers[first]} was rejected{where}: {p.why}"
                   + (f" (also rejected by {others})" if others else ""))
        return RefitError(f"sharded refit v{wv.vote.version} not committed on engine rank {me}: {why}; no "
                          f"pair committed, live weights kept at version {self.version}", bucket=bucket,
                          tensors=names, kept_version=self.version, status=status, receivers=wv.vote.results)
