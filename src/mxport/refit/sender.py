"""RefitSender: the trainer side of a refit, one coordinator for every layout: ``RefitSender(transport,
plan)`` (a world of ONE multicast stream to R engine ranks) or ``RefitSender.from_mesh(world, mesh)`` (one of
T trainer ranks, one stream per route). It agrees the plan and the version, runs this rank's streams, holds
one vote for the whole world and concludes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from .mesh import MeshPlan, Replica, find_replicas, local_part, route_tensors
from .plan import RefitPlan
from .results import ReceiverResult, RefitError, SendStats, Status, StreamStats
from .stream import PendingSend, StreamSender
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
    replica_digests,
    stream_transport,
    world_vote,
)


class RefitSender(WorldSide):
    """The trainer side of a refit (see the module doc for the ways to build one).

    Args:
        transport: a :class:`~mxport.refit.transport.Transport` endpoint whose rank is the sender (``src``).
        plan: the :class:`RefitPlan` (built once; reused for every refit).
        stream_kwargs: :class:`~mxport.refit.stream.StreamSender`'s (``bucket_bytes``, ``use_checksum``,
            ``device``, ``inflight``, ``stream_crc32``).
    """

    def __init__(self, transport: Transport, plan: RefitPlan, **stream_kwargs):
        receivers = tuple(r for r in range(transport.world_size) if r != transport.src)
        stream = StreamSender(transport, plan, **stream_kwargs)
        self._start(transport, [stream], [receivers], (transport.src,))
        self.engines, self.routes = [-1], []  # each stream's key; the mesh routes (from_mesh)

    @classmethod
    def for_pairs(cls, world: Transport, pairs: Sequence[tuple[int, RefitPlan]], *, global_digest: str,
                  trainers: Sequence[int], tag: int = PAIR_TAG, replicas: Sequence[Replica] = (),
                  version: int = 0, **stream_kwargs) -> RefitSender:
        """A trainer rank of a sharded refit.

        Args:
            world: this rank's :class:`TorchDistTransport` over the world group (it carries the pair streams
                too).
            pairs: ``(engine world rank, its RefitPlan)`` for every pair of this trainer with bytes to move,
                in :func:`~mxport.refit.world.pair_order` (may be empty: the rank still votes).
            global_digest, trainers: the whole plan's hex sha256 and the trainers' world ranks, the same on
                every rank (checked).
            tag, version: the pair streams' message tag; the last version this rank knows of.
            replicas: boxes several trainer ranks hold (:func:`~mxport.refit.mesh.find_replicas`, checked):
                copies that differ refuse the refit (:meth:`send` needs ``local``).
            stream_kwargs: passed to each pair's stream.
        """
        return cls._of_streams(world, [((int(e),), plan) for e, plan in pairs], global_digest, trainers, tag,
                               replicas, version, stream_kwargs)

    @classmethod
    def from_mesh(cls, world: Transport, mesh: MeshPlan, **kwargs) -> RefitSender:
        """This trainer rank's sender of an agreed :class:`~mxport.refit.mesh.MeshPlan`: one stream per route,
        the routes to replicas of one engine merged into one multicast stream; send with :meth:`send_local`.
        ``kwargs``: :meth:`for_pairs`'."""
        streams = ordered_streams(mesh, world.rank)
        kw = {k: kwargs.pop(k) for k in ("tag", "version") if k in kwargs}
        self = cls._of_streams(world, [(engines, r.plan()) for r, engines in streams], mesh.digest,
                               range(mesh.num_trainers), kw.get("tag", PAIR_TAG), find_replicas(mesh),
                               kw.get("version", 0), kwargs)
        self.routes = [r for r, _ in streams]
        return self

    @classmethod
    def _of_streams(cls, world: Transport, streams: Sequence[tuple[tuple[int, ...], RefitPlan]],
                    global_digest: str, trainers: Sequence[int], tag: int, replicas: Sequence[Replica],
                    version: int, stream_kwargs: dict) -> RefitSender:
        check_digest(global_digest)
        trainers = check_trainers(world, trainers, True)
        engines = [e for ends, _ in streams for e in ends]
        if len(set(engines)) != len(engines) or any(e in trainers for e in engines):
            raise ValueError(f"pairs: each engine rank once, none a trainer rank, got {engines}")
        senders = [StreamSender(stream_transport(world, world.rank, ends, tag), plan, **stream_kwargs)
                   for ends, plan in streams]
        self = cls.__new__(cls)
        self._start(world, senders, [ends for ends, _ in streams], trainers, global_digest, replicas, version)
        self.engines, self.routes = [ends[0] for ends, _ in streams], []
        return self

    # -- the refit ------------------------------------------------------------------------------------------
    def handshake(self) -> None:
        """Agree the plan and the version with every rank (a world of one stream: its plan handshake; sharded:
        global digest and versions, each stream's plan, their outcomes), or raise on every rank."""
        if self.multicast:
            s = self.streams[0]
            s.version = self.version
            s.handshake()
            self.version = s.version
        else:
            self.version = agree_global(self.world, self.global_digest, self.version, self.checks)
            self.version = pair_handshakes(self.world, self.streams, self.ends, self.version, "engine")
            remember(self.global_digest, self.version)
        self._handshaken = True

    def send_local(self, local: Mapping) -> SendStats:
        """:meth:`send` of this rank's ``local`` bytes along its routes, its replicas digested from them."""
        return self.send({r.engine: route_tensors(r, local) for r in self.routes}, local=local)

    def send(self, tensors: Iterable[torch.Tensor] | Mapping[int, Iterable[torch.Tensor]], *,
             checksums: Callable[[int, int], int] | None = None, local: Mapping | None = None
             ) -> SendStats:
        """Send one refit, vote once over the world, conclude.

        ``tensors``: one contiguous tensor per plan entry in plan order (a list or a generator, consumed
        bucket by bucket); sharded: ``{engine rank: its stream's tensors}``, with ``local`` (``{name: (box,
        tensor)}``) to digest the replicas. ``checksums(start, size)``: each bucket's checksum when the
        producer knows it (one stream only). On any failure the remaining buckets and an abort trailer still
        go out, so receivers fail at once and stay in step, and the error is raised after the vote. Returns
        :class:`~mxport.refit.results.SendStats`.

        Raises:
            RefitError: some rank voted no, naming each, why and where (``receivers``: every receiver's
                result); or the transport failed (re-create the group).
        """
        if not self._handshaken:
            self.handshake()
        streams, failed = self._streams_of(tensors, checksums)
        self.version = self.version + 1 if self.multicast else remember(self.global_digest, self.version + 1)
        t0 = time.perf_counter()
        digests, digest_failed = self._digests(local)
        pendings, stream_stats, failed = self._transmit_all(streams, failed or digest_failed, checksums)
        aborted = next((i for i, p in enumerate(pendings) if p.aborted), None)
        ok = aborted is None and failed is None
        row = ReceiverResult(self.world.rank, Status.OK if ok else Status.ABORTED, -1, -1, self.version)
        wv = self._vote(row, aborted, digests, pendings)
        if failed is not None:
            raise failed  # the producer's error, or why this rank could not send
        return self._conclude(pendings, stream_stats, wv, time.perf_counter() - t0)

    def _vote(self, row: ReceiverResult, aborted: int | None, digests: list[int],
              pendings: list[PendingSend]) -> WorldVote:
        peer = -1 if aborted is None else self.engines[aborted]
        if self.multicast:
            with pendings[0].stopwatch.phase("wait"):
                try:
                    return world_vote(self.world, row, peer, self.senders)
                except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError
                    err = self.streams[0].vote_failed(pendings[0], exc)
                    raise err from (None if err is pendings[0].error else exc)
        try:
            return world_vote(self.world, row, peer, self.senders, self.checks, digests)
        except Exception as exc:  # noqa: BLE001 - a dead peer / timeout surfaces as RuntimeError from gloo
            raise RefitError(f"sharded refit v{self.version} failed: the world vote failed "
                             f"({type(exc).__name__}: {exc}); a rank died or timed out, so engine ranks that "
                             "had every row may have committed it, the others keep their previous weights: "
                             "re-create the group and refit again", kept_version=self.version - 1) from exc

    def _streams_of(self, tensors, checksums) -> tuple[Mapping, BaseException | None]:
        """``{peer: tensors}``, or (nothing, why not): what a sharded refit cannot take is refused through the
        vote, so that no rank waits for this one."""
        if self.multicast:
            return {-1: tensors}, None
        if checksums is not None:
            return {}, ValueError("checksums= gives the buckets of a world of one stream (the producer's own "
                                  "plan); a sharded refit's streams carry route plans: send without it")
        if isinstance(tensors, Mapping):
            return tensors, None
        return {}, TypeError(f"a sharded refit sends {{engine rank: tensors}} (one stream per pair), got "
                             f"{type(tensors).__name__}")

    def _digests(self, local: Mapping | None) -> tuple[list[int], BaseException | None]:
        """This rank's digest of every replica it holds, or the error that kept it from them."""
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

    def _transmit_all(self, streams: Mapping[int, Iterable[torch.Tensor]], failed: BaseException | None,
                      checksums: Callable[[int, int], int] | None):
        """Transmit every stream in order, aborts after a failure; the pending sends, stats and failure."""
        unknown = sorted(set(streams) - set(self.engines))
        if unknown and failed is None:
            failed = ValueError(f"streams for engine ranks {unknown}, which have no pair with trainer rank "
                                f"{self.world.rank} (pairs: {self.engines})")
        pendings: list[PendingSend] = []
        stats: list[StreamStats] = []
        for e, ends, s in zip(self.engines, self.ends, self.streams, strict=True):
            if failed is None and e not in streams:
                failed = ValueError(f"no stream for engine rank {e} (trainer rank {self.world.rank})")
            s.version = self.version - 1  # every stream carries the refit's version
            t0 = time.perf_counter()
            try:
                p = s.transmit(streams[e] if failed is None else _refusing(failed, e), checksums=checksums)
            except RefitError as exc:
                if not self.multicast:
                    exc.add_note(f"(sharded refit v{self.version}: the pair stream from trainer rank "
                                 f"{self.world.rank} to engine rank {e})")
                raise
            pendings.append(p)
            stats.append(StreamStats(self.world.rank, ends, s.plan.total_bytes, s.layout.num_buckets,
                                     time.perf_counter() - t0))
            if p.aborted and failed is None:
                failed = p.error
        return pendings, stats, failed

    def _conclude(self, pendings, stream_stats, wv: WorldVote, seconds: float) -> SendStats:
        vote = wv.vote
        if not vote.commit and not self.multicast:
            bad = vote.no
            kept = min((r.version for r in vote.results), default=self.version - 1)
            raise RefitError(f"sharded refit v{self.version} was rejected by {len(bad)} rank(s): "
                             f"{wv.rejections()}; no engine rank committed it (every one keeps its previous "
                             "weights)", kept_version=kept, status=bad[0].status,
                             bucket=bad[0].bucket if bad[0].bucket >= 0 else None, receivers=vote.results,
                             tensors=wv.drifted)
        parts = [s.conclude(p, vote) for s, p in zip(self.streams, pendings, strict=True)]
        if self.multicast:  # a world of one stream: its own clock (up to the vote)
            seconds = parts[0].seconds
        return SendStats.total(self.world.rank, self.version, parts, stream_stats, seconds, vote.results)


def _refusing(error: BaseException, engine: int) -> Iterator[torch.Tensor]:
    """A producer that fails at once: a stream sent as an abort because this rank's refit failed."""
    raise RuntimeError(f"not sent to engine rank {engine}: this trainer rank's refit failed "
                       f"({type(error).__name__}: {error})")
    yield  # pragma: no cover - makes this a generator
