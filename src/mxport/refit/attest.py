"""Attestation: after a refit, each engine rank's digests of what its live weights hold (checkpoint layout)
against each trainer rank's of what it sent, per route, in one all-gather of one int64 row per rank: slot
``p`` of rank ``q``'s row is route ``(q, p)``'s digest as ``q`` sees it. Every rank learns every mismatch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .mesh import Box, MeshPlan, gather_checked

_MASK = (1 << 63) - 1
_CHUNK = 1 << 20  # words per weighted sum (bounds the position tensor)


def bytes_digest(t: torch.Tensor) -> int:
    """Order-sensitive digest of the bytes of ``t``, where they are (CPU or GPU): the wrapping sums of its
    int64 words (zero-padded) plain and weighted by position, and its byte count. On the CPU the native
    kernel's one pass (:func:`mxport.native.word_digest`) where it is built; torch ops otherwise (the same
    sums)."""
    from .. import native
    from ..quantize import NATIVE_PATH

    b = t.contiguous().reshape(-1).view(torch.uint8)
    n = b.numel()
    if n % 8 or b.data_ptr() % 8:  # the address, not the storage offset: frombuffer data may start anywhere
        b = torch.cat([b, b.new_zeros(-n % 8)])
    w = b.view(torch.int64)
    lib = NATIVE_PATH.lib_for(w)
    if lib is not None:
        sums = torch.zeros(2, dtype=torch.int64)
        native.word_digest(lib, w, 1, sums)
        plain, weighted = sums.tolist()
    else:
        plain, weighted = _word_sums_torch(w)
    return fold((plain & _MASK, weighted & _MASK, n))


def _word_sums_torch(w: torch.Tensor) -> tuple[int, int]:
    plain = weighted = 0
    for i in range(0, w.numel(), _CHUNK):
        part = w[i:i + _CHUNK]
        pos = torch.arange(i + 1, i + 1 + part.numel(), dtype=torch.int64, device=w.device)
        plain += int(part.sum())
        weighted += int((part * pos).sum())
    return plain, weighted


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


def attest_round(world, mesh: MeshPlan, digest: PieceDigests, *, failed: bool = False
                 ) -> list[tuple[int, int]]:
    """Exchange this rank's route digests with every rank; returns the ``(trainer, engine)`` routes whose two
    ends disagree (empty: every engine rank holds exactly what was sent). ``failed``: this rank could not
    apply the refit (it still takes part; its routes disagree). Collective; RefitError if the group
    failed."""
    row = torch.full((world.world_size,), -1, dtype=torch.int64)
    for r in mesh.routes_of(world.rank):
        row[r.engine if world.rank == r.trainer else r.trainer] = -2 if failed else fold(
            digest(p.tensor.name, p.box) for p in r.pieces)
    rows = torch.stack(gather_checked(world, row, "attestation"))
    t = mesh.num_trainers
    return [(a, b) for a in range(t) for b in range(t, len(rows)) if int(rows[a, b]) != int(rows[b, a])]
