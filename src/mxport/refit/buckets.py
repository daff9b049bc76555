"""Fixed-size byte buckets: packing tensors' bytes into them, unpacking, the refit trailer and checksums.

One refit on the wire is ``plan.num_buckets`` broadcasts of raw payload — bucket ``b`` is the plan's byte stream
from ``b * bucket_bytes``, ``plan.bucket_size(b)`` bytes long — then one trailer broadcast of int64 words
``[magic, version, num_buckets, status, entry, 0, checksum_0, ..., checksum_{n-1}]``. A bucket that lies inside
one tensor is broadcast straight from that tensor's storage (no packing copy); other buckets are packed into a
reused buffer. Every tensor moves as its raw bytes (``tensor.view(torch.uint8)``): FP8 values and E8M0 scales are
uint8 on the wire (NCCL cannot broadcast FP8 dtypes on older GPUs); kept tensors keep their bit patterns.

Checksum (:func:`checksum`): a chunked sum of the payload's int64 words, computed on the payload's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import RefitPlan

MAGIC = 0x4D58524654  # "MXRFT"
TRAILER_FIXED = 6
STATUS_OK, STATUS_ABORT = 0, 1


def byte_view(t: torch.Tensor, *, argname: str = "tensor") -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes (same storage; ValueError if not contiguous)."""
    if not t.is_contiguous():
        raise ValueError(f"{argname} must be contiguous to be moved as bytes")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


_CHUNKS = 64
_MASK = (1 << 64) - 1


def checksum(payload: torch.Tensor) -> int:
    """Checksum of a 1-D uint8 tensor whose length is a multiple of 8 (bucket payloads always are).

    Sum-based, computed where the bytes are (CPU or GPU, ~20 GB/s on one CPU thread, 6x faster than CRC-32 here):
    the payload's int64 words are summed (wrapping) in 64 equal chunks plus a tail; the chunk sums are mixed with
    odd weights ``2i + 1`` and the word count. Any change of a single word, and any reordering of chunks, changes
    it; it is a corruption check, not a cryptographic digest. Returned as a signed 64-bit int (the int64 header).
    """
    words = payload.view(torch.int64)
    n = words.numel()
    m = n // _CHUNKS * _CHUNKS
    sums = [words[m:].sum().view(1)]
    if m:
        sums.insert(0, words[:m].view(_CHUNKS, -1).sum(dim=1))
    h = n
    for i, v in enumerate(torch.cat(sums).tolist()):
        h = (h + (v & _MASK) * (2 * i + 1)) & _MASK
    return h - (1 << 64) if h >= 1 << 63 else h


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of entry ``entry`` starting at byte ``src`` of the tensor land at ``dst`` of the payload."""

    entry: int
    src: int
    dst: int
    length: int


class BucketLayout:
    """Where each tensor's bytes go: per bucket, the ordered segments (computed once from the plan)."""

    def __init__(self, plan: RefitPlan):
        self.plan = plan
        B = plan.bucket_bytes
        self.segments: list[list[Segment]] = [[] for _ in range(plan.num_buckets)]
        for i, e in enumerate(plan.entries):
            pos, end = e.offset, e.offset + e.nbytes
            while pos < end:
                b = pos // B
                take = min(end, (b + 1) * B) - pos
                self.segments[b].append(Segment(i, pos - e.offset, pos - b * B, take))
                pos += take
        # alignment padding between tensors: zeroed on packing so a bucket's bytes (and checksum) are deterministic
        self.gaps: list[list[tuple[int, int]]] = []
        for b, segs in enumerate(self.segments):
            gaps, pos = [], 0
            for sg in segs:
                if sg.dst > pos:
                    gaps.append((pos, sg.dst - pos))
                pos = sg.dst + sg.length
            if pos < plan.bucket_size(b):
                gaps.append((pos, plan.bucket_size(b) - pos))
            self.gaps.append(gaps)
        self.sizes = [plan.bucket_size(b) for b in range(plan.num_buckets)]
        #: per bucket, ``(entry, src)`` when the whole bucket is one slice of one tensor (sent without packing)
        self.single: list[tuple[int, int] | None] = [
            (segs[0].entry, segs[0].src) if len(segs) == 1 and segs[0].length == self.sizes[b] else None
            for b, segs in enumerate(self.segments)]

    def tensor_names(self, b: int) -> list[str]:
        """Names of the tensors with bytes in bucket ``b``, in stream order."""
        return [self.plan.entries[s.entry].name for s in self.segments[b]]


def make_trailer(version: int, checksums: list[int], status: int = STATUS_OK, entry: int = -1) -> torch.Tensor:
    """The int64 trailer of one refit (see module doc). ``entry``: on an abort, the plan index of the tensor that
    caused it (-1 if none)."""
    return torch.tensor([MAGIC, version, len(checksums), status, entry, 0, *checksums], dtype=torch.int64)


def read_trailer(trailer: torch.Tensor) -> tuple[int, int, int, int, int, list[int]]:
    """``(magic, version, num_buckets, status, entry, checksums)`` of a received trailer."""
    vals = trailer.tolist() if trailer.device.type == "cpu" else trailer.cpu().tolist()
    return vals[0], vals[1], vals[2], vals[3], vals[4], vals[TRAILER_FIXED:]


def pack_segments(segments: list[Segment], sources: list[torch.Tensor], payload: torch.Tensor) -> None:
    """Copy each segment's bytes from ``sources[entry]`` (flat uint8 views) into ``payload``."""
    for s in segments:
        payload[s.dst:s.dst + s.length].copy_(sources[s.entry][s.src:s.src + s.length])


def pack_bucket(layout: BucketLayout, b: int, sources: list[torch.Tensor], payload: torch.Tensor) -> None:
    """Fill ``payload`` (``plan.bucket_size(b)`` bytes) with bucket ``b``: its segments, and zeros in the gaps."""
    pack_segments(layout.segments[b], sources, payload)
    for start, n in layout.gaps[b]:
        payload[start:start + n].zero_()


def unpack_segments(segments: list[Segment], payload: torch.Tensor, targets: list[torch.Tensor]) -> None:
    """Copy each segment's bytes from ``payload`` into ``targets[entry]`` (flat uint8 views), in place."""
    for s in segments:
        targets[s.entry][s.src:s.src + s.length].copy_(payload[s.dst:s.dst + s.length])


def stream_arena(plan: RefitPlan, targets: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat ``uint8`` tensor over the targets' storage when the targets are laid out exactly as the plan's byte
    stream (``allocate_targets`` does that): all share one storage, each target's first byte sits at
    ``base + entry.offset``, and the storage covers ``[base, base + plan.total_bytes)``. None otherwise.

    Writing the returned tensor writes the targets (and the alignment padding between them, which belongs to the
    stream). Zero-byte entries are not checked (they own no bytes).
    """
    storage, base, device = None, None, None
    for e, t in zip(plan.entries, targets, strict=True):
        if e.nbytes == 0:
            continue
        if not t.is_contiguous():
            return None
        s = t.untyped_storage()
        if storage is None:
            storage, base, device = s, t.data_ptr() - e.offset, t.device
        elif s.data_ptr() != storage.data_ptr() or t.device != device or t.data_ptr() - e.offset != base:
            return None
    if storage is None:
        return None
    start = base - storage.data_ptr()
    if start < 0 or start + plan.total_bytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (plan.total_bytes,), (1,))
