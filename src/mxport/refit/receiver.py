"""RefitReceiver: the engine side of a refit, one coordinator for every layout: ``RefitReceiver(transport,
plan, targets)`` (a world of ONE multicast stream; staging or direct mode) or ``RefitReceiver.from_mesh(world,
mesh, live)`` (one of E engine ranks, staged). It stages this rank's streams, votes once with the whole world
and settles every stream by that vote: all commit, or none."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from .mesh import MeshPlan, Replica, find_replicas, route_targets
from .plan import RefitPlan
from .results import ReceiverResult, ReceiveStats, RefitError, Status, StreamStats
from .stream import Staged, StreamReceiver
from .transport import PAIR_TAG, Transport
from .world import (
    WorldSide,
    WorldVote,
    agree_global,
    check_digest,
    check_trainers,
    ordered_streams,
    pair_handshakes,
    remember,
    stream_transport,
    world_vote,
)


class RefitReceiver(WorldSide):
    """The engine side of a refit (see the module doc for the ways to build one).

    Args:
        transport: a receiving :class:`~mxport.refit.transport.Transport` endpoint.
        plan: the receiver's own :class:`RefitPlan` (checked against the sender's in :meth:`handshake`).
        targets: the live tensors, one per plan entry, contiguous, of the planned dtype and shape; only ever
            written in place (pointers stay put, CUDA-graph safe), each refit bumping their ``_version``.
        stream_kwargs: :class:`~mxport.refit.stream.StreamReceiver`'s (``bucket_bytes``, ``use_checksum``,
            ``refresh_hooks``, ``inflight``, ``direct``, ``delta``, ``eager``).
    """

    def __init__(self, transport: Transport, plan: RefitPlan, targets: Sequence[torch.Tensor],
                 **stream_kwargs):
        stream = StreamReceiver(transport, plan, targets, **stream_kwargs)
        receivers = tuple(r for r in range(transport.world_size) if r != transport.src)
        self._start(transport, [stream], [(transport.src, receivers)], (transport.src,))

    @classmethod
    def for_pairs(cls, world: Transport, pairs: Sequence[tuple], *, global_digest: str,
                  trainers: Sequence[int], tag: int = PAIR_TAG, replicas: Sequence[Replica] = (),
                  version: int = 0, **stream_kwargs) -> RefitReceiver:
        """An engine rank of a sharded refit (arguments as :meth:`RefitSender.for_pairs`): ``pairs``
        ``(trainer world rank, its RefitPlan, its live targets[, its own refresh hooks])`` in pair order (may
        be empty), ``version`` the version the live weights hold; every stream staged (nothing written before
        the vote), or with ``eager=True`` written into its live tensors bucket by bucket (one ring of bucket
        buffers for all its streams, received one after another) and restored from a host rollback copy
        unless every rank votes yes."""
        ends = [(int(p[0]), (world.rank,)) for p in pairs]
        return cls._of_streams(world, [(e, *p[1:]) for e, p in zip(ends, pairs, strict=True)], global_digest,
                               trainers, tag, replicas, version, stream_kwargs)

    @classmethod
    def from_mesh(cls, world: Transport, mesh: MeshPlan, live: Mapping, **kwargs) -> RefitReceiver:
        """This engine rank's receiver of an agreed :class:`~mxport.refit.mesh.MeshPlan` into its ``live``
        tensors (``{name: (box, tensor)}``, e.g. :func:`~mxport.refit.engine_buffers`), one stream per route.
        ``kwargs``: :meth:`for_pairs`'."""
        streams = []
        for r, engines in ordered_streams(mesh, world.rank):
            targets, scatters = route_targets(r, live)
            streams.append(((r.trainer, engines), r.plan(), targets, scatters))
        kw = {k: kwargs.pop(k) for k in ("tag", "version") if k in kwargs}
        return cls._of_streams(world, streams, mesh.digest, range(mesh.num_trainers), kw.get("tag", PAIR_TAG),
                               find_replicas(mesh), kw.get("version", 0), kwargs)

    @classmethod
    def _of_streams(cls, world: Transport, streams: Sequence[tuple], global_digest: str,
                    trainers: Sequence[int], tag: int, replicas: Sequence[Replica], version: int,
                    stream_kwargs: dict) -> RefitReceiver:
        check_digest(global_digest)
        trainers = check_trainers(world, trainers, False)
        peers = [t for (t, _), *_ in streams]
        if len(set(peers)) != len(peers) or any(t not in trainers for t in peers):
            raise ValueError(f"pairs: each trainer rank once, each one of {list(trainers)}, got {peers}")
        stream_kwargs = {"ring": _shared_ring(streams, stream_kwargs), **stream_kwargs}
        receivers = [StreamReceiver(stream_transport(world, t, engines, tag), plan, targets, direct=False,
                                    **_with_hooks(stream_kwargs, hooks))
                     for (t, engines), plan, targets, *hooks in streams]
        self = cls.__new__(cls)
        self._start(world, receivers, [e for e, *_ in streams], trainers, global_digest, replicas, version)
        return self

    @property
    def peers(self) -> list[int]:
        """Each stream's trainer rank (its ends are ``(trainer rank, the engine ranks it reaches)``)."""
        return [t for t, _ in self.ends]

    @property
    def version(self) -> int:
        """The refit version live on this rank."""
        return self.streams[0].version if self.multicast else self._version

    @version.setter
    def version(self, value: int) -> None:
        """The version live here; every stream refuses a refit that is not newer."""
        self._version = value
        for s in self.streams:
            s.version = value

    # -- a world of one stream: its stream's parts ----------------------------------------------------------
    @property
    def targets(self) -> list[torch.Tensor]:
        return self._one().targets

    @property
    def direct(self) -> bool:
        """Whether the stream lands straight in the live tensors (one arena, a rollback copy)."""
        return self._one().direct

    @property
    def last_backup_s(self) -> float:
        """Direct mode: seconds of the last rollback copy (0.0 in staging mode)."""
        return self._one().last_backup_s

    def pointers(self) -> list[int]:
        """``data_ptr()`` of every live target (of every stream)."""
        return [p for s in self.streams for p in s.pointers()]

    def pointers_stable(self) -> bool:
        """True when every live tensor still sits where it was when the receiver was built."""
        return all(s.pointers_stable() for s in self.streams)

    def touched_tensors(self) -> set[str] | None:
        """The tensors whose bytes the last committed refit changed (a delta refit), by name (a sharded
        stream's box suffix dropped); None when it rewrote every tensor (a whole refit)."""
        parts = [s.last_touched for s in self.streams]
        if any(p is None for p in parts):
            return None
        return {n.split("[", 1)[0] for p in parts for n in p}

    def wait_backup(self) -> float:
        """Direct mode: block until the rollback copy of the live version is complete; its seconds."""
        return sum(s.wait_backup() for s in self.streams)

    def start_backup(self) -> None:
        """``defer_backup=True``: start refreshing the rollback copies now (after the caller's own work on the
        new weights, e.g. re-deriving and attesting them, which the copy would otherwise compete with)."""
        for s in self.streams:
            s.start_backup()

    def distrust_base(self) -> None:
        """The live weights may not hold the version committed last (e.g. an attestation read other bytes
        than were sent): every stream's next refit goes whole, not a delta patched onto them."""
        for s in self.streams:
            s.distrust_base()

    @property
    def buffer_bytes(self) -> tuple[int, int]:
        """``(on the live tensors' device, in host memory)`` bytes this rank's streams hold beside the live
        tensors, a ring its eager streams share counted once (see :attr:`StreamReceiver.buffer_bytes`)."""
        device: dict[int, int] = {}
        for s in self.streams:
            device.update(s.device_buffers())
        return sum(device.values()), sum(s.buffer_bytes[1] for s in self.streams)

    def verify_live(self) -> bool:
        """True when the live bytes have the checksums the sender wrote for the last refit."""
        return bool(self.streams) and all(s.verify_live() for s in self.streams)

    def live_crc32(self) -> int:
        """``zlib.crc32`` of the live stream: the sender's ``stream_crc32`` when the bytes arrived intact."""
        return self._one().live_crc32()

    # -- the refit ------------------------------------------------------------------------------------------
    def handshake(self) -> None:
        """Agree the plan and the version with every rank (see :meth:`RefitSender.handshake`)."""
        if self.multicast:
            self.streams[0].handshake()
        else:
            # the world's highest version is the trainers' to start from; this rank keeps its live one
            newest = agree_global(self.world, self.global_digest, self.version, self.checks)
            pair_handshakes(self.world, self.streams, self.peers, newest, "trainer")
        self._handshaken = True

    def receive(self) -> ReceiveStats:
        """Receive one refit; the live tensors take the new version only if every rank voted yes.

        A two-phase commit: every stream is received and validated without committing, every rank (the senders
        too) votes in one all_gather over the world, and every stream commits on a unanimous yes or rolls
        back. A rank that dies makes the others' vote fail: they roll back. Returns
        :class:`~mxport.refit.results.ReceiveStats`.

        Raises:
            RefitError: a dead peer or timeout (re-create the group), a bad trailer, a checksum, an abort, a
                stale version, a changed live tensor, drifted replicas, here or on another rank
                (``PEER_REJECTED``). The live weights keep the previous version, unless a refresh hook fails
                after a unanimous yes (``COMMIT_FAILED``).
        """
        if not self._handshaken:
            self.handshake()
        t0 = time.perf_counter()
        staged, pair_stats = self._stage_all()
        first = next((i for i, s in enumerate(staged) if not s.ok), None)
        wv = self._vote(staged, first)
        if self.multicast:
            part = self.streams[0].settle(staged[0], wv.vote)
            return ReceiveStats.total(self.world.rank, part.version, [part], pair_stats, part.seconds)
        return self._settle_all(staged, pair_stats, wv, first, t0)

    def _vote(self, staged: list[Staged], first: int | None) -> WorldVote:
        """This rank's row in the world vote; a failing vote rolls every stream back and raises."""
        row = ReceiverResult(self.world.rank, Status.OK, -1, -1, self.version)
        if first is not None:
            own = self.streams[first].verdict(staged[first])
            row = ReceiverResult(self.world.rank, own.status, own.bucket, own.entry, self.version)
        peer = -1 if first is None or self.multicast else self.peers[first]
        try:
            return world_vote(self.world, row, peer, self.senders, self.checks)
        except BaseException as exc:  # a dead peer / timeout (RuntimeError from gloo), or Ctrl-C
            if self.multicast:
                err = self.streams[0].vote_failed(staged[0], exc)  # rolled back
                if not isinstance(exc, Exception):
                    raise
                raise err from exc
            self._discard(staged)
            if not isinstance(exc, Exception):
                raise
            raise RefitError(f"sharded refit not committed on engine rank {self.world.rank}: every pair was "
                             f"received, but the world vote failed ({type(exc).__name__}: {exc}): a rank "
                             f"died or timed out; live weights kept at version {self.version}",
                             kept_version=self.version) from exc

    def _stage_all(self) -> tuple[list[Staged], list[StreamStats]]:
        staged: list[Staged] = []
        stats: list[StreamStats] = []
        for r in self.streams:  # before any stream writes into live tensors it may share with another
            r.prepare()
        for (t, engines), r in zip(self.ends, self.streams, strict=True):
            t0 = time.perf_counter()
            try:
                staged.append(r.stage())
            except BaseException as exc:  # a transport failure or Ctrl-C: this stream rolled back already
                self._discard(staged)
                if not isinstance(exc, RefitError):
                    raise
                if not self.multicast:
                    exc.add_note(f"(sharded refit on engine rank {self.world.rank}: the pair stream from "
                                 f"trainer rank {t}; no pair committed, live weights kept at version "
                                 f"{self.version})")
                raise
            stats.append(StreamStats(t, engines, r.plan.total_bytes, r.layout.num_buckets,
                                     time.perf_counter() - t0))
        return staged, stats

    def _discard(self, staged: Sequence[Staged]) -> None:
        for r, s in zip(self.streams, staged, strict=False):
            r.discard(s)

    def _settle_all(self, staged: list[Staged], stream_stats: list[StreamStats], wv: WorldVote,
                    first: int | None, t0: float) -> ReceiveStats:
        """Settle every stream by the world vote; raise the first failure once all are settled."""
        errors: list[RefitError] = []
        parts: list[ReceiveStats] = []
        settled = []
        for r, s in zip(self.streams, staged, strict=True):
            try:
                parts.append(r.settle(s, wv.vote))
                settled.append(r)
            except RefitError as exc:
                errors.append(exc)
        if not wv.vote.commit:
            raise self._rejection(staged, wv, first)
        for r in settled:  # not a stream whose refresh hook failed: its rollback copy is the old version
            r.note_live()
        self.version = remember(self.global_digest, wv.vote.version)
        if errors:  # a refresh hook failed after a unanimous yes (see StreamReceiver.settle)
            raise errors[0]
        seconds = time.perf_counter() - t0
        return ReceiveStats.total(self.world.rank, self.version, parts, stream_stats, seconds)

    def _rejection(self, staged: list[Staged], wv: WorldVote, first: int | None) -> RefitError:
        """The RefitError of a sharded refit some rank rejected: this rank's reason, then the others'."""
        me = self.world.rank
        others = wv.rejections(skip=me)
        bucket, names, status, why = None, list(wv.drifted), Status.PEER_REJECTED, f"rejected by {others}"
        if first is not None:
            p, r = staged[first].problem, self.streams[first]
            bucket, status = p.bucket, p.status
            names = r.layout.tensor_names(bucket) if bucket is not None else []
            where = f" at bucket {bucket} (tensors: {', '.join(dict.fromkeys(names))})" if names else ""
            why = (f"the pair stream from trainer rank {self.peers[first]} was rejected{where}: {p.why}"
                   + (f" (also rejected by {others})" if others else ""))
        return RefitError(f"sharded refit v{wv.vote.version} not committed on engine rank {me}: {why}; no "
                          f"pair committed, live weights kept at version {self.version}", bucket=bucket,
                          tensors=names, kept_version=self.version, status=status, receivers=wv.vote.results)


def _shared_ring(streams: Sequence[tuple], kwargs: dict) -> list[torch.Tensor]:
    """Eager streams of one rank are received one after another: one ring of ``inflight + 1`` buffers (fewer
    when no stream has that many buckets) of the largest bucket serves them all (none for a single stream or
    staging)."""
    if not kwargs.get("eager") or len(streams) < 2:
        return []
    from .buckets import DEFAULT_BUCKET_BYTES

    bucket = kwargs.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
    size = max(min(bucket, plan.total_bytes) for _, plan, *_ in streams)
    targets = next((ts for _, _, ts, *_ in streams if ts), None)
    if size <= 0 or targets is None:
        return []
    most = max(-(-plan.total_bytes // bucket) for _, plan, *_ in streams)  # buckets in the longest stream
    n = min(max(1, kwargs.get("inflight", 4)) + 1, max(1, most))
    return [torch.empty(size, dtype=torch.uint8, device=targets[0].device) for _ in range(n)]


def _with_hooks(kwargs: dict, extra: list) -> dict:
    """``kwargs`` with a pair's own refresh hooks (``extra``: empty, or ``[hooks]``) after the shared ones."""
    if not extra:
        return kwargs
    return {**kwargs, "refresh_hooks": [*kwargs.get("refresh_hooks", ()), *extra[0]]}

