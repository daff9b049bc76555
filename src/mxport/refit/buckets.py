"""Fixed-size byte buckets: packing tensors' bytes into them, unpacking, the per-bucket header and checksum.

A wire bucket is ``HEADER_BYTES`` of int64 header ``[magic, version, bucket index, checksum, status]`` (padded to
64 bytes) followed by the bucket's payload: the plan's byte stream from ``b * bucket_bytes``, ``plan.bucket_size(b)``
bytes long. Every tensor is moved as its raw bytes (``tensor.view(torch.uint8)``): FP8 values and E8M0 scales are
uint8 on the wire (NCCL cannot broadcast FP8 dtypes on older GPUs); kept tensors keep their bit patterns.

Checksum: CRC-32 (``zlib.crc32``, ~3.5 GB/s here, releases the GIL) of the payload on CPU; on CUDA a cheap
device-side sum of int64 words mixed with their position (no host copy).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from .plan import RefitPlan

MAGIC = 0x4D58524654  # "MXRFT"
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
STATUS_OK, STATUS_ABORT = 0, 1


def byte_view(t: torch.Tensor, *, argname: str = "tensor") -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes (same storage; ValueError if not contiguous)."""
    if not t.is_contiguous():
        raise ValueError(f"{argname} must be contiguous to be moved as bytes")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def checksum(payload: torch.Tensor) -> int:
    """Checksum of a 1-D uint8 tensor whose length is a multiple of 8 (bucket payloads always are).

    CPU: ``zlib.crc32`` of the bytes. CUDA: ``sum(word_i * (2*i + 1))`` over int64 words (wrapping), computed on
    the device. Returned as a signed 64-bit int (fits the int64 header).
    """
    if payload.device.type == "cpu":
        return zlib.crc32(payload.numpy())
    words = payload.view(torch.int64)
    weights = torch.arange(1, 2 * words.numel() + 1, 2, device=words.device, dtype=torch.int64)
    return int((words * weights).sum().item())


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
        self.wire_sizes = [HEADER_BYTES + plan.bucket_size(b) for b in range(plan.num_buckets)]

    @property
    def max_wire_bytes(self) -> int:
        return max(self.wire_sizes)

    def tensor_names(self, b: int) -> list[str]:
        """Names of the tensors with bytes in bucket ``b``, in stream order."""
        return [self.plan.entries[s.entry].name for s in self.segments[b]]


def write_header(wire: torch.Tensor, version: int, b: int, crc: int, status: int = STATUS_OK,
                 entry: int = -1) -> None:
    """Fill the header of a wire bucket (a uint8 tensor of at least HEADER_BYTES). ``entry``: on an abort, the
    plan index of the tensor that caused it (-1 if none)."""
    h = torch.tensor([MAGIC, version, b, crc, status, entry, 0, 0], dtype=torch.int64)
    wire[:HEADER_BYTES].copy_(h.view(torch.uint8))


def read_header(wire: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """``(magic, version, bucket, checksum, status, entry)`` of a wire bucket."""
    h = wire[:HEADER_BYTES].view(torch.int64)
    vals = h.tolist() if h.device.type == "cpu" else h.cpu().tolist()
    return tuple(vals[:6])


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
