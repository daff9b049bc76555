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

import hashlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .buckets import byte_view, checksums
from .mesh import (
    MAX_REASON,
    MeshPlan,
    RefitAgreementError,
    Replica,
    find_replicas,
    gather_checked,
    local_part,
    route_targets,
    route_tensors,
)
from .plan import RefitPlan, RefitPlanMismatch
from .receiver import RefitReceiver, Staged
from .results import REPORT_WORDS, ReceiverResult, ReceiveStats, RefitError, ResultRow, Status, Vote
from .sender import PendingSend, RefitSender
from .transport import PAIR_TAG, PairTransport, Transport

#: "MXRFTSH" and the sharded handshake's version (2: the replica checks' word, the pair outcomes' agreement)
SHARD_HELLO = 0x4D58524654534802

#: the highest version each sharded refit (by global plan digest) reached in this process: a sender or
#: receiver re-created for the same plan (a new group after a failure) starts from it, so versions never go
#: back; the world handshake then takes the highest over all ranks (ranks that were restarted included)
_LAST_VERSION: dict[str, int] = {}


def _remember(global_digest: str, version: int) -> int:
    _LAST_VERSION[global_digest] = max(_LAST_VERSION.get(global_digest, 0), int(version))
    return int(version)


def last_version(global_digest: str) -> int:
    """The highest version a sharded refit of this global plan reached in this process (0: none)."""
    return _LAST_VERSION.get(global_digest, 0)


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
class PairStats(ResultRow):
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
class ShardedSendStats(ResultRow):
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
class ShardedReceiveStats(ResultRow):
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
    """The world's vote on one sharded refit: the :class:`Vote` (every trainer rank a sender), per rank the
    other end of the pair its row concerns (-1: none), and every replicated box whose holders' copies differ
    (``drift``: one line each; ``drifted``: those tensors' names). Holders of a box that drifted vote
    :attr:`Status.REPLICA_DRIFT`, so nobody commits."""

    vote: Vote
    peers: tuple[int, ...]
    drift: tuple[str, ...] = ()
    drifted: tuple[str, ...] = ()

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

    def rejections(self, skip: int | None = None) -> str:
        """Every rank that voted no (but ``skip``), then the replicated boxes whose copies differ."""
        out = "; ".join(self.describe(r) for r in self.vote.no if r.rank != skip)
        if self.drift:
            more = f" (+{len(self.drift) - 8} more)" if len(self.drift) > 8 else ""
            out += ("; " if out else "") + f"replicas differ: {'; '.join(self.drift[:8])}{more}"
        return out


def replica_digests(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The digest of each copy of a replicated box: :func:`~mxport.refit.buckets.checksum` of its bytes
    (zero-padded to whole int64 words), summed where the bytes are (one pass; a copy only for a box that is
    not contiguous in its rank's tensor), all brought to the host at once."""
    out = []
    for t in tensors:
        b = byte_view(t.contiguous())
        if b.numel() % 8:
            b = torch.cat([b, b.new_zeros(8 - b.numel() % 8)])
        out.append(b if b.storage_offset() % 8 == 0 else b.clone())  # int64 words need aligned bytes
    return checksums(out)


@dataclass(frozen=True)
class ReplicaChecks:
    """The replicas a sharded refit's vote compares: per trainer rank, the replicas it holds in the order its
    row carries their digests (``slots[rank][replica index]``); ``width``: the widest row's digest count;
    ``word``: 56 bits of their description (every rank must vote with the same checks)."""

    replicas: tuple[Replica, ...]
    slots: dict[int, dict[int, int]]
    width: int
    word: int

    @classmethod
    def of(cls, replicas: Sequence[Replica]) -> ReplicaChecks:
        slots: dict[int, dict[int, int]] = {}
        for i, rep in enumerate(replicas):
            for t in rep.holders:
                mine = slots.setdefault(t, {})
                mine[i] = len(mine)
        text = json.dumps([[r.tensor.name, *r.box.canonical(), list(r.holders)] for r in replicas],
                          separators=(",", ":"))
        word = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
        return cls(tuple(replicas), slots, max(map(len, slots.values()), default=0), word)

    def held_by(self, rank: int) -> list[Replica]:
        """The replicas ``rank`` holds, in its row's order."""
        return [self.replicas[i] for i in self.slots.get(rank, {})]

    def drift(self, rows: Sequence[torch.Tensor], vote: Vote):
        """``(lines, names, ranks)``: each replica whose holders (those that voted ok) gave different
        digests (``rows``: the vote's rows, digests from word ``REPORT_WORDS + 1`` on)."""
        lines, names, ranks = [], [], set()
        for i, rep in enumerate(self.replicas):
            got = {t: int(rows[t][REPORT_WORDS + 1 + self.slots[t][i]]) for t in rep.holders
                   if vote.rows[t].ok}
            if len(set(got.values())) < 2:
                continue
            groups: dict[int, list[int]] = {}
            for t, d in got.items():
                groups.setdefault(d, []).append(t)
            held = ", ".join(f"rank{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}: digest "
                             f"{d & ((1 << 64) - 1):#018x}" for d, g in groups.items())
            lines.append(f"{rep.tensor.name}{rep.box} differs between trainer ranks "
                         f"{', '.join(map(str, sorted(got)))} ({held})")
            names.append(rep.tensor.name)
            ranks.update(got)
        return tuple(lines), tuple(dict.fromkeys(names)), ranks


NO_REPLICAS = ReplicaChecks.of(())


def world_vote(world: Transport, row: ReceiverResult, peer: int, trainers: Sequence[int],
               checks: ReplicaChecks = NO_REPLICAS, digests: Sequence[int] = ()) -> WorldVote:
    """Every world rank's row (``row``, ``peer``, then the digests of the replicas it holds, zero-padded to
    the widest rank's) in one ``all_gather``; ``trainers``: the senders. A replica whose holders' digests
    differ turns those holders' rows into :attr:`Status.REPLICA_DRIFT` (nobody commits)."""
    pad = [int(d) for d in digests] + [0] * (checks.width - len(digests))
    mine = torch.cat([row.to_tensor(), torch.tensor([peer, *pad], dtype=torch.int64)])
    rows = world.all_gather(mine)
    vote = Vote.tally([r[:REPORT_WORDS] for r in rows], min(trainers), trainers)
    drift, names, ranks = checks.drift(rows, vote) if checks.replicas else ((), (), set())
    if drift:
        marked = tuple(ReceiverResult(r.rank, Status.REPLICA_DRIFT, -1, -1, r.version) if r.rank in ranks
                       else r for r in vote.rows)
        vote = Vote(vote.src, marked, vote.senders)
    return WorldVote(vote, tuple(int(r[REPORT_WORDS]) for r in rows), drift, names)


def _check_digest(global_digest: str) -> bytes:
    try:
        raw = bytes.fromhex(global_digest)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"global_digest must be a hex sha256 (64 hex digits), got {global_digest!r}")
    return raw


def agree_global(world: Transport, global_digest: str, version: int, checks: ReplicaChecks = NO_REPLICAS
                 ) -> int:
    """The world handshake: every rank gives ``[SHARD_HELLO, digest words, version, replicas word]``; returns
    the highest version. Raises :class:`RefitError` for a rank that does not speak it (or a group that
    failed), :class:`RefitPlanMismatch` (on every rank) when any rank's global digest or replica checks
    differ."""
    raw = _check_digest(global_digest)
    head = torch.tensor([SHARD_HELLO], dtype=torch.int64)
    digest = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    tail = torch.tensor([int(version), checks.word], dtype=torch.int64)
    rows = gather_checked(world, torch.cat([head, digest, tail]), "sharded refit handshake")
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
    words = [int(row[6]) for row in rows]
    bad = [r for r, w in enumerate(words) if w != words[0]]
    if bad:
        raise RefitPlanMismatch([f"rank {r}: other replica checks than rank 0's (every rank must pass the "
                                 "same replicas: find_replicas of the agreed MeshPlan)" for r in bad])
    return max(versions)


def _pair_handshakes(world: Transport, endpoints, peers: Sequence[int], version: int, peer_role: str) -> int:
    """Each pair's plan handshake in pair order (a failing pair does not stop the others: its peer runs it
    too), then one world agreement on the outcomes: any failure raises :class:`RefitAgreementError` on every
    rank, naming each failing rank, its pair and the reason. ``peer_role``: "engine" on a trainer rank (its
    pair senders start at ``version``); returns the highest version seen."""
    failures: list[tuple[int, BaseException]] = []
    for peer, ep in zip(peers, endpoints, strict=True):
        if peer_role == "engine":
            ep.version = version
        try:
            ep.handshake()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            failures.append((peer, exc))
            continue
        if peer_role == "engine":
            version = max(version, ep.version)
    mine = "; ".join(f"the pair with {peer_role} rank {p}: {type(e).__name__}: {e}" for p, e in failures)
    text = mine.encode()[:MAX_REASON]
    row = torch.tensor([int(bool(failures)), len(text)], dtype=torch.int64)
    rows = gather_checked(world, row, "sharded refit handshake (pair outcomes)")
    if not any(int(r[0]) for r in rows):
        return version
    lengths = [min(max(int(r[1]), 0), MAX_REASON) for r in rows]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    if text:
        buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    got = gather_checked(world, buf, "sharded refit handshake (pair failures)")
    problems = [f"rank {r}: {got[r][:lengths[r]].numpy().tobytes().decode(errors='replace')}"
                for r, row in enumerate(rows) if int(row[0])]
    raise RefitAgreementError(problems, what="sharded refit handshake failed") from (
        failures[0][1] if failures else None)


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
        replicas: the boxes several trainer ranks hold (:func:`~mxport.refit.mesh.find_replicas` of the
            agreed plan; the same on every world rank, checked): each holder's digest of its copy joins the
            vote, and copies that differ refuse the refit (:meth:`send` needs ``local`` to digest them).
        version: the last refit version this rank knows of (the refit's next one is higher than every
            rank's, and than any this process reached for the same plan: :func:`last_version`).
        sender_kwargs: passed to each pair's :class:`RefitSender` (``use_checksum``, ``inflight``, ...).
    """

    def __init__(self, world: Transport, pairs: Sequence[tuple[int, RefitPlan]], *, global_digest: str,
                 trainers: Sequence[int], tag: int = PAIR_TAG, replicas: Sequence[Replica] = (),
                 version: int = 0, **sender_kwargs):
        _check_digest(global_digest)
        self.world, self.global_digest = world, global_digest
        self.trainers = _check_trainers(world, trainers, True)
        self.checks = ReplicaChecks.of(replicas)
        self.routes: list = []  # the mesh routes of the pairs, when built by from_mesh
        self.engines = [int(e) for e, _ in pairs]
        if len(set(self.engines)) != len(self.engines) or any(e in self.trainers for e in self.engines):
            raise ValueError(f"pairs: each engine rank once, none a trainer rank, got {self.engines}")
        self.senders = [RefitSender(_pair_transport(world, world.rank, e, tag), plan, **sender_kwargs)
                        for e, plan in pairs]
        self.version = max(int(version), last_version(global_digest))
        self._handshaken = False

    @classmethod
    def from_mesh(cls, world: Transport, mesh: MeshPlan, bucket_bytes: int, **kwargs) -> ShardedSender:
        """This trainer rank's sender of an agreed :class:`~mxport.refit.mesh.MeshPlan` (group ranks =
        world ranks): its routes in :func:`pair_order`, the plan's replicas checked; send with
        :meth:`send_local`."""
        routes = ordered_routes(mesh, world.rank)
        self = cls(world, [(r.engine, r.plan(bucket_bytes)) for r in routes], global_digest=mesh.digest,
                   trainers=range(mesh.num_trainers), replicas=find_replicas(mesh), **kwargs)
        self.routes = routes
        return self

    def handshake(self) -> None:
        """The world digest agreement, then each pair's plan handshake in pair order, then the world's
        agreement on the pairs' outcomes (:class:`RefitAgreementError` on every rank if any pair failed)."""
        self.version = agree_global(self.world, self.global_digest, self.version, self.checks)
        self.version = _pair_handshakes(self.world, self.senders, self.engines, self.version, "engine")
        _remember(self.global_digest, self.version)
        self._handshaken = True

    def send_local(self, local: Mapping) -> ShardedSendStats:
        """:meth:`send` of this rank's bytes ``local`` (``{name: (box, tensor)}``, e.g.
        :meth:`~mxport.refit.ShardedTrainerSource.local`) along its routes (a sender built by
        :meth:`from_mesh`), its replicas' digests taken from the same bytes."""
        return self.send({r.engine: route_tensors(r, local) for r in self.routes}, local=local)

    def send(self, streams: Mapping[int, Iterable[torch.Tensor]], *, local: Mapping | None = None
             ) -> ShardedSendStats:
        """One sharded refit: ``streams[engine]`` yields that pair's tensors in its plan's order (as
        :meth:`RefitSender.send`). Digests this rank's copies of the replicas (from ``local``, the rank's
        ``{name: (box, tensor)}`` bytes; needed when it holds any), transmits each pair in order, votes once
        over the world (the digests in its row), then concludes.

        A producer that fails aborts its pair (and this rank sends the rest of its pairs as aborts without
        asking their producers): the engines commit nothing and the producer's error is raised here after the
        vote. So does a replica this rank cannot digest (no ``local``, or a box it lacks).

        Raises:
            RefitError: some rank voted no (``receivers``: every engine rank's result; the message names each
                rank that voted no, why and in which pair; copies of a replicated box that differ, naming the
                tensor and the trainer ranks), or a transport failed (a dead peer, a timeout).
        """
        if not self._handshaken:
            self.handshake()
        self.version = _remember(self.global_digest, self.version + 1)
        t0 = time.perf_counter()
        digests, failed = self._digests(local)
        pendings, pair_stats = self._transmit_all(streams, failed)
        aborted = next((i for i, p in enumerate(pendings) if p.aborted), None)
        ok = aborted is None and failed is None
        row = ReceiverResult(self.world.rank, Status.OK if ok else Status.ABORTED, -1, -1, self.version)
        try:
            wv = world_vote(self.world, row, -1 if aborted is None else self.engines[aborted], self.trainers,
                            self.checks, digests)
        except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
            raise RefitError(f"sharded refit v{self.version} failed: the world vote failed "
                             f"({type(exc).__name__}: {exc}); a rank died or timed out, so engine ranks that "
                             "had every row may have committed it, the others keep their previous weights: "
                             "re-create the group and refit again", kept_version=self.version - 1) from exc
        if failed is not None:
            raise failed
        if aborted is not None:
            self.senders[aborted].conclude(pendings[aborted], wv.vote)  # raises the producer's error
        return self._conclude(pendings, pair_stats, wv, time.perf_counter() - t0)

    def _digests(self, local: Mapping | None) -> tuple[list[int], BaseException | None]:
        """The digest of this rank's copy of every replica it holds (in its row's order), or the error that
        kept it from digesting them (the refit is then aborted)."""
        slots = self.checks.held_by(self.world.rank)
        if not slots:
            return [], None
        if local is None:
            return [], ValueError(f"trainer rank {self.world.rank} holds {len(slots)} replicated box(es) "
                                  "whose copies the vote compares: pass send(..., local=) (its "
                                  "{name: (box, tensor)} bytes) or use send_local")
        try:
            return replica_digests(local_part(local, r.tensor.name, r.box) for r in slots), None
        except Exception as exc:  # noqa: BLE001 - the refit is aborted, the error raised after the vote
            return [], exc

    def _transmit_all(self, streams: Mapping[int, Iterable[torch.Tensor]], failed: BaseException | None):
        """Transmit every pair in order; after the first abort the rest go out as aborts too (all of them
        when ``failed`` already)."""
        unknown = sorted(set(streams) - set(self.engines))
        if unknown and failed is None:
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
                             bucket=bad[0].bucket if bad[0].bucket >= 0 else None, receivers=vote.results,
                             tensors=wv.drifted)
        for s, p in zip(self.senders, pendings, strict=True):
            s.conclude(p, vote)
        total = sum(p.bytes for p in pair_stats)
        return ShardedSendStats(rank=self.world.rank, version=self.version, bytes=total, seconds=seconds,
                                gbps=total / seconds / 1e9 if seconds > 0 else 0.0, pairs=tuple(pair_stats),
                                results=tuple(vote.results))


def ordered_routes(mesh: MeshPlan, rank: int) -> list:
    """The routes group rank ``rank`` takes part in, in :func:`pair_order` (every rank follows it: no
    cycles)."""
    T = mesh.num_trainers
    order = {pair: i for i, pair in enumerate(pair_order(range(T), range(T, T + mesh.num_engines)))}
    return sorted(mesh.routes_of(rank), key=lambda r: order[(r.trainer, r.engine)])


def _refusing(error: BaseException, engine: int) -> Iterator[torch.Tensor]:
    """A producer that fails at once: a pair stream sent as an abort because an earlier pair aborted."""
    raise RuntimeError(f"not sent to engine rank {engine}: an earlier pair stream of this trainer aborted "
                       f"({type(error).__name__}: {error})")
    yield  # pragma: no cover - makes this a generator


def _with_hooks(kwargs: dict, extra: list) -> dict:
    """``kwargs`` with a pair's own refresh hooks (``extra``: empty, or ``[hooks]``) after the shared ones."""
    if not extra:
        return kwargs
    return {**kwargs, "refresh_hooks": [*kwargs.get("refresh_hooks", ()), *extra[0]]}


class ShardedReceiver:
    """An engine rank of a sharded refit.

    Args:
        world: this rank's transport over the whole world group (see :class:`ShardedSender`).
        pairs: ``(trainer world rank, that pair's RefitPlan, its live target tensors)`` for every pair of this
            engine that has bytes to move, in :func:`pair_order` (may be empty: the rank still votes); a
            fourth element, when given, is that pair's own refresh hooks (run when it commits, after the ones
            in ``receiver_kwargs``): e.g. :func:`~mxport.refit.mesh.route_targets`' scatters.
        global_digest, trainers, tag, replicas: as :class:`ShardedSender` (an engine rank digests nothing, but
            votes with rows as wide as the trainers').
        version: the version the live weights hold (a receiver re-created over them after a failure: the
            next refit is newer; it also starts from any this process reached for the same plan).
        receiver_kwargs: passed to each pair's :class:`RefitReceiver` (``use_checksum``, ``refresh_hooks``,
            ``inflight``); always in staging mode, so nothing is written before the world vote.
    """

    def __init__(self, world: Transport, pairs: Sequence[tuple], *,
                 global_digest: str, trainers: Sequence[int], tag: int = PAIR_TAG,
                 replicas: Sequence[Replica] = (), version: int = 0, **receiver_kwargs):
        _check_digest(global_digest)
        self.world, self.global_digest = world, global_digest
        self.trainers = _check_trainers(world, trainers, False)
        self.checks = ReplicaChecks.of(replicas)
        self.peers = [int(p[0]) for p in pairs]
        if len(set(self.peers)) != len(self.peers) or any(t not in self.trainers for t in self.peers):
            raise ValueError(f"pairs: each trainer rank once, each one of {list(self.trainers)}, got "
                             f"{self.peers}")
        self.receivers = [RefitReceiver(_pair_transport(world, t, world.rank, tag), plan, targets,
                                        direct=False, **_with_hooks(receiver_kwargs, hooks))
                          for t, plan, targets, *hooks in pairs]
        self.version = max(int(version), last_version(global_digest))
        self._handshaken = False

    @classmethod
    def from_mesh(cls, world: Transport, mesh: MeshPlan, live: Mapping, bucket_bytes: int,
                  **kwargs) -> ShardedReceiver:
        """This engine rank's receiver of an agreed :class:`~mxport.refit.mesh.MeshPlan` into its live
        tensors ``live`` (``{name: (box, tensor)}``, e.g. :func:`~mxport.refit.engine_buffers`): its routes in
        :func:`pair_order`, each landing in place or through its scatters
        (:func:`~mxport.refit.mesh.route_targets`)."""
        pairs = []
        for r in ordered_routes(mesh, world.rank):
            targets, scatters = route_targets(r, live)
            pairs.append((r.trainer, r.plan(bucket_bytes), targets, scatters))
        return cls(world, pairs, global_digest=mesh.digest, trainers=range(mesh.num_trainers),
                   replicas=find_replicas(mesh), **kwargs)

    def handshake(self) -> None:
        """The world digest agreement, then each pair's plan handshake in pair order, then the world's
        agreement on the pairs' outcomes (:class:`RefitAgreementError` on every rank if any pair failed)."""
        self.version = agree_global(self.world, self.global_digest, self.version, self.checks)
        _pair_handshakes(self.world, self.receivers, self.peers, self.version, "trainer")
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
            wv = world_vote(self.world, row, -1 if first is None else self.peers[first], self.trainers,
                            self.checks)
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
        self.version = _remember(self.global_digest, wv.vote.version)
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
        others = wv.rejections(skip=me)
        bucket, names, status, why = None, list(wv.drifted), Status.PEER_REJECTED, f"rejected by {others}"
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
