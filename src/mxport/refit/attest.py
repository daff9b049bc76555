"""Attestation: after a refit, every engine rank's checksums of the bytes it now holds (read back from its
live weights, in checkpoint layout) against the trainer ranks' checksums of the bytes they sent, per route.

One all-gather of one int64 row per world rank: slot ``p`` of rank ``q``'s row is the CRC-32 of route
``(q, p)``'s pieces as ``q`` sees them (a trainer: the bytes it sent to engine ``p``; an engine: the bytes its
live weights hold of what trainer ``p`` sent). Every rank learns every mismatch.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from .mesh import Box, MeshPlan, gather_checked

#: ``part(name, box)``: the bytes of ``box`` of tensor ``name`` as this rank holds them, in checkpoint layout
Part = Callable[[str, Box], torch.Tensor]


def route_crc(pieces, part: Part) -> int:
    """CRC-32 of the bytes of ``pieces`` (a route's, in route order) as ``part`` gives them."""
    crc = 0
    for p in pieces:
        t = part(p.tensor.name, p.box).contiguous()
        crc = zlib.crc32(t.view(torch.uint8).reshape(-1).numpy().tobytes(), crc)
    return crc


def attest_round(world, mesh: MeshPlan, part: Part) -> list[tuple[int, int]]:
    """Exchange this rank's route checksums with every rank; returns the ``(trainer, engine)`` routes whose
    two ends disagree (empty: every engine rank holds exactly what was sent). Collective over ``world``.

    Raises:
        RefitError: the group failed."""
    row = torch.full((world.world_size,), -1, dtype=torch.int64)
    for r in mesh.routes_of(world.rank):
        other = r.engine if world.rank == r.trainer else r.trainer
        row[other] = route_crc(r.pieces, part)
    rows = torch.stack(gather_checked(world, row, "attestation"))
    trainers = mesh.num_trainers
    return [(t, e) for t in range(trainers) for e in range(trainers, len(rows))
            if int(rows[t, e]) != int(rows[e, t])]
