"""What every rank of a refit's group agrees on together: the streams' global order (:func:`ordered_streams`),
the handshake (:func:`agree_global`, :func:`pair_handshakes`: digest, version, replica checks, each stream's
plan) and ONE vote (:func:`world_vote`). A one-rank refit is the world of one multicast stream."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .buckets import byte_view, checksums
from .mesh import MAX_REASON, MeshPlan, RefitAgreementError, Replica, gather_checked
from .plan import RefitPlanMismatch
from .results import REPORT_WORDS, ReceiverResult, RefitError, Status, Vote
from .transport import PairTransport, TorchDistTransport, Transport, subgroup

#: "MXRFTSH" and the sharded handshake's version (2: the replica checks' word, the pair outcomes' agreement)
SHARD_HELLO = 0x4D58524654534802

#: the highest version each sharded refit (by global plan digest) reached in this process: a sender or
#: receiver re-created for the same plan (a new group after a failure) starts from it, so versions never go
#: back; the world handshake then takes the highest over all ranks (ranks that were restarted included)
_LAST_VERSION: dict[str, int] = {}


def remember(global_digest: str, version: int) -> int:
    _LAST_VERSION[global_digest] = max(_LAST_VERSION.get(global_digest, 0), int(version))
    return int(version)


def last_version(global_digest: str) -> int:
    """The highest version a sharded refit of this global plan reached in this process (0: none)."""
    return _LAST_VERSION.get(global_digest, 0)


def pair_order(trainers: Sequence[int], engines: Sequence[int]) -> list[tuple[int, int]]:
    """Every (trainer rank, engine rank) pair once, by ``(round, t_index, e_index)``, ``round = (e_index -
    t_index) mod max(T, E)``: the lowest unfinished pair always has both ends on it, so no ranks wait in a
    cycle."""
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
class WorldVote:
    """The world's vote on one sharded refit: the :class:`Vote`, per rank the other end of the pair its row
    concerns (-1: none), and the replicated boxes whose copies differ (``drift`` lines, ``drifted`` names)."""

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
    """The :func:`~mxport.refit.buckets.checksum` of each copy of a replicated box, zero-padded to words."""
    out = []
    for t in tensors:
        b = byte_view(t.contiguous())
        if b.numel() % 8:
            b = torch.cat([b, b.new_zeros(8 - b.numel() % 8)])
        out.append(b if b.storage_offset() % 8 == 0 else b.clone())  # int64 words need aligned bytes
    return checksums(out)


@dataclass(frozen=True)
class ReplicaChecks:
    """The replicas a sharded refit's vote compares: ``slots[rank][replica index]`` (the digest's place in
    that rank's row), ``width`` (the widest row's count) and ``word`` (56 bits of their description)."""

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
        """``(lines, names, ranks)`` of each replica whose holders that voted ok gave different digests."""
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
    """Every world rank's row (``row``, ``peer``, its replicas' digests, zero-padded) in one ``all_gather``;
    holders of a replica whose digests differ vote :attr:`Status.REPLICA_DRIFT`."""
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


def check_digest(global_digest: str) -> bytes:
    try:
        raw = bytes.fromhex(global_digest)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"global_digest must be a hex sha256 (64 hex digits), got {global_digest!r}")
    return raw


def agree_global(world: Transport, global_digest: str, version: int, checks: ReplicaChecks = NO_REPLICAS
                 ) -> int:
    """The world handshake, ``[SHARD_HELLO, digest words, version, replicas word]`` from every rank; returns
    the highest version. RefitError for a stranger or a failed group, RefitPlanMismatch when digests or
    replica checks differ."""
    raw = check_digest(global_digest)
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


def pair_handshakes(world: Transport, endpoints, peers: Sequence[int], version: int, peer_role: str) -> int:
    """Each stream's plan handshake in pair order, then one world agreement on the outcomes: any failure
    raises :class:`RefitAgreementError` on every rank, naming the rank, its stream and why. ``peer_role``
    "engine" on a trainer rank (its streams start at ``version``); returns the highest version seen."""
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
    mine = "; ".join(f"{_stream_name(peer_role, p)}: {type(e).__name__}: {e}" for p, e in failures)
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


def _stream_name(peer_role: str, peer) -> str:
    """``the pair with engine rank 4``, or ``the multicast stream to engine ranks 2, 3``."""
    if isinstance(peer, tuple) and len(peer) > 1:
        return f"the multicast stream to {peer_role} ranks {', '.join(map(str, peer))}"
    return f"the pair with {peer_role} rank {peer[0] if isinstance(peer, tuple) else peer}"


def stream_transport(world: Transport, trainer: int, engines: Sequence[int], tag: int) -> Transport:
    """One stream's transport from world rank ``trainer``: a :class:`PairTransport` tagged ``tag`` to one
    engine, a :func:`~mxport.refit.transport.subgroup` to several."""
    pg = getattr(world, "process_group", None)
    if pg is None:
        raise TypeError(f"world must be a transport over a process group (TorchDistTransport), got "
                        f"{type(world).__name__}")
    if len(engines) == 1:
        return PairTransport(pg, trainer, engines[0], tag=tag)
    transport = TorchDistTransport.from_group(subgroup(pg, [trainer, *engines]))  # the trainer is its rank 0
    transport.ranks = (trainer, *engines)  # its handshake names its receivers by their world ranks
    return transport


def check_trainers(world: Transport, trainers: Sequence[int], is_trainer: bool) -> tuple[int, ...]:
    out = tuple(int(t) for t in trainers)
    if not out or len(set(out)) != len(out) or not all(0 <= t < world.world_size for t in out):
        raise ValueError(f"trainers must be distinct ranks of the world (size {world.world_size}), got {out}")
    if (world.rank in out) != is_trainer:
        role = "trainer" if is_trainer else "engine"
        raise ValueError(f"world rank {world.rank} is {'not ' if is_trainer else ''}one of the trainer ranks "
                         f"{list(out)}, so it cannot be a sharded {role} endpoint")
    return out


def ordered_streams(mesh: MeshPlan, rank: int) -> list[tuple]:
    """The streams group rank ``rank`` takes part in, ``(route, engine ranks)``, the routes to an engine's
    replicas as one multicast stream, in :func:`pair_order` of their first pair."""
    T = mesh.num_trainers
    order = {pair: i for i, pair in enumerate(pair_order(range(T), range(T, T + mesh.num_engines)))}
    streams: dict[tuple, tuple] = {}
    for r in mesh.routes_of(rank):
        engines = mesh.replicas_of(r.engine)
        streams.setdefault((r.trainer, engines), (r, engines))
    return sorted(streams.values(), key=lambda s: order[(s[0].trainer, s[1][0])])


class WorldSide:
    """What the two coordinators share: the world transport and this rank's streams (a world of one multicast
    stream lends that stream's transport, plan and layout)."""

    world: Transport
    streams: list
    trainers: tuple[int, ...]
    global_digest: str | None

    def _start(self, world: Transport, streams: list, ends: list, trainers: Sequence[int],
               global_digest: str | None = None, replicas: Sequence[Replica] = (), version: int = 0) -> None:
        """This end's ``streams`` (``ends``: each one's other end or ends); a sharded end (``global_digest``)
        starts from the highest version this process reached for its plan."""
        self.world, self.streams, self.ends, self.trainers = world, streams, list(ends), tuple(trainers)
        self.global_digest, self.checks, self._handshaken = global_digest, ReplicaChecks.of(replicas), False
        self.version = version if global_digest is None else max(int(version), last_version(global_digest))

    @property
    def multicast(self) -> bool:
        """True for a world of one multicast stream (built from a transport and a plan)."""
        return self.global_digest is None

    @property
    def transport(self) -> Transport:
        return self.streams[0].transport if self.multicast else self.world

    @property
    def senders(self) -> tuple[int, ...]:
        """The world ranks that send (one stream: its transport's sender now)."""
        return (self.streams[0].transport.src,) if self.multicast else self.trainers

    @transport.setter
    def transport(self, transport: Transport) -> None:
        """A world of one stream on a new group (the old one failed): the stream's transport is the world."""
        self._one().transport = self.world = transport

    def close(self) -> None:
        """Shut down the groups made for this end's multicast streams; the end is unusable afterwards."""
        if not self.multicast:
            for s in self.streams:
                s.transport.close()  # a pair stream's close leaves the world's group alone

    @property
    def plan(self):
        return self._one().plan

    @property
    def layout(self):
        return self._one().layout

    def _one(self):
        if not self.multicast:
            raise AttributeError("a sharded refit has several streams (one per pair, each with its plan, "
                                 "transport and targets): see .streams")
        return self.streams[0]
