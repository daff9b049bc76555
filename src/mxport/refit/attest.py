"""Attestation: after a refit, each engine rank's digests of what its live weights hold (checkpoint layout)
against each trainer rank's of what it sent, per route, in one all-gather of one int64 row per rank: slot
``p`` of rank ``q``'s row is route ``(q, p)``'s digest as ``q`` sees it. Every rank learns every mismatch."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from .buckets import checksum
from .mesh import Box, MeshPlan, gather_checked

_MASK = (1 << 63) - 1


def bytes_digest(t: torch.Tensor) -> int:
    """Digest of the bytes of ``t``: :func:`~mxport.refit.buckets.checksum` of its whole int64 words (several
    times faster than CRC-32), CRC-32 of the bytes after them, and their count."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    n = b.numel() // 8 * 8
    words = b[:n] if b.storage_offset() % 8 == 0 else b[:n].clone()
    tail = zlib.crc32(b[n:].numpy().tobytes()) if n < b.numel() else 0
    return (((checksum(words) if n else 0) & _MASK) ^ (tail << 31) ^ b.numel()) & _MASK


def fold(digests) -> int:
    """One digest of several, in order."""
    h = 0
    for d in digests:
        h = ((h * 0x100000001B3) ^ d) & _MASK
    return h


class PieceDigests(dict):
    """``digest(name, box)``: :func:`bytes_digest` of ``part(name, box)`` (a rank's bytes of that box), each
    piece read once (attestation and an engine's per-tensor record share the reads)."""

    def __init__(self, part: Callable[[str, Box], torch.Tensor]):
        super().__init__()
        self.part = part

    def __call__(self, name: str, box: Box) -> int:
        if (name, box) not in self:
            self[name, box] = bytes_digest(self.part(name, box))
        return self[name, box]


def attest_round(world, mesh: MeshPlan, digest: PieceDigests) -> list[tuple[int, int]]:
    """Exchange this rank's route digests with every rank; returns the ``(trainer, engine)`` routes whose two
    ends disagree (empty: every engine rank holds exactly what was sent). Collective; RefitError if the group
    failed."""
    row = torch.full((world.world_size,), -1, dtype=torch.int64)
    for r in mesh.routes_of(world.rank):
        row[r.engine if world.rank == r.trainer else r.trainer] = fold(digest(p.tensor.name, p.box)
                                                                      for p in r.pieces)
    rows = torch.stack(gather_checked(world, row, "attestation"))
    t = mesh.num_trainers
    return [(a, b) for a in range(t) for b in range(t, len(rows)) if int(rows[a, b]) != int(rows[b, a])]
