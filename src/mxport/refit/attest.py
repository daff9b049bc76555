"""Attestation: after a refit, every engine rank's checksums of the bytes it now holds (read back from its
live weights, in checkpoint layout) against the trainer ranks' checksums of the bytes they sent, per route.

One all-gather of one int64 row per world rank: slot ``p`` of rank ``q``'s row is the digest of route
``(q, p)``'s pieces as ``q`` sees them (:func:`route_digest`; a trainer: the bytes it sent to engine ``p``; an
engine: the bytes its live weights hold of what trainer ``p`` sent). Every rank learns every mismatch.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from .buckets import checksum
from .mesh import Box, MeshPlan, gather_checked

#: ``part(name, box)``: the bytes of ``box`` of tensor ``name`` as this rank holds them, in checkpoint layout
Part = Callable[[str, Box], torch.Tensor]


_MASK = (1 << 63) - 1


def bytes_digest(t: torch.Tensor) -> int:
    """Digest of the bytes of ``t``: the refit's word-sum :func:`~mxport.refit.buckets.checksum` of its whole
    int64 words (several times faster than CRC-32), CRC-32 of the bytes after them, and their count."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    n = b.numel() // 8 * 8
    words = b[:n] if b.storage_offset() % 8 == 0 else b[:n].clone()
    c = checksum(words) if n else 0
    tail = zlib.crc32(b[n:].numpy().tobytes()) if n < b.numel() else 0
    return ((c & _MASK) ^ (tail << 31) ^ b.numel()) & _MASK


def fold(digests) -> int:
    """One digest of several, in order."""
    h = 0
    for d in digests:
        h = ((h * 0x100000001B3) ^ d) & _MASK
    return h


class PieceDigests:
    """``digest(name, box)``: :func:`bytes_digest` of ``part(name, box)``, each piece read once (attestation
    and a worker's per-tensor record share the reads)."""

    def __init__(self, part: Part):
        self.part, self.done = part, {}

    def __call__(self, name: str, box: Box) -> int:
        key = (name, box)
        if key not in self.done:
            self.done[key] = bytes_digest(self.part(name, box))
        return self.done[key]


def route_digest(pieces, digest: Callable[[str, Box], int]) -> int:
    """Digest of the bytes of ``pieces`` (a route's, in route order): :func:`fold` of each piece's."""
    return fold(digest(p.tensor.name, p.box) for p in pieces)


def attest_round(world, mesh: MeshPlan, part: Part) -> list[tuple[int, int]]:
    """Exchange this rank's route digests (``part``: its bytes, or a :class:`PieceDigests`) with every rank;
    returns the ``(trainer, engine)`` routes whose
    two ends disagree (empty: every engine rank holds exactly what was sent). Collective over ``world``.

    Raises:
        RefitError: the group failed."""
    row = torch.full((world.world_size,), -1, dtype=torch.int64)
    for r in mesh.routes_of(world.rank):
        other = r.engine if world.rank == r.trainer else r.trainer
        row[other] = route_digest(r.pieces, part if isinstance(part, PieceDigests) else PieceDigests(part))
    rows = torch.stack(gather_checked(world, row, "attestation"))
    trainers = mesh.num_trainers
    return [(t, e) for t in range(trainers) for e in range(trainers, len(rows))
            if int(rows[t, e]) != int(rows[e, t])]
