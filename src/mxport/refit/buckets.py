"""Fixed-size byte buckets: packing tensors' bytes into them, unpacking, the refit trailer and checksums.

One refit on the wire is ``layout.num_buckets`` broadcasts of raw payload (bucket ``b``: the plan's byte
stream from ``b * bucket_bytes``, ``layout.sizes[b]`` bytes; the bucket size is the stream's, agreed in its
handshake), then one trailer of int64 words ``[magic, version, num_buckets, status, entry, reason, checksum_0,
..., checksum_{n-1}]`` (``status`` ok or abort; on an abort ``entry`` is the plan index of the tensor at fault
or -1, ``reason`` an :class:`~mxport.refit.results.AbortReason`). Tensors move as their raw bytes: FP8 values
and E8M0 scales are uint8 on the wire (NCCL cannot broadcast FP8 dtypes on older GPUs)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..native import StreamSums
from .arena import storage_bytes
from .plan import ALIGN, RefitPlan

MAGIC = 0x4D58524654  # "MXRFT"
#: the bucket size a stream takes when none is given (the size of each broadcast on the wire)
DEFAULT_BUCKET_BYTES = 32 << 20
TRAILER_FIXED = 6
STATUS_OK, STATUS_ABORT = 0, 1


def canonical_device(device: str | torch.device) -> torch.device:
    """``device`` with its index filled in ("cuda" -> "cuda:<current>"), comparable to a tensor's."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            return torch.device(device.type, module.current_device())
    return device


def byte_view(t: torch.Tensor, *, argname: str = "tensor") -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes (same storage; ValueError if not contiguous)."""
    if not t.is_contiguous():
        raise ValueError(f"{argname} must be contiguous to be moved as bytes")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


#: checksum chunk: the payload's int64 words are summed per 1 MiB (fits the L2 cache, so the sender can sum
#: each chunk right after packing it, while it is still hot)
CHUNK_BYTES = 1 << 20
_CHUNK_WORDS = CHUNK_BYTES // 8
_MASK = (1 << 64) - 1


def _mix(n_words: int, sums: list[int]) -> int:
    h = n_words
    for i, v in enumerate(sums):
        h = (h + (v & _MASK) * (2 * i + 1)) & _MASK
    return h - (1 << 64) if h >= 1 << 63 else h


def checksum(payload: torch.Tensor) -> int:
    """Checksum of a 1-D uint8 tensor of whole int64 words: the words summed (wrapping) per
    :data:`CHUNK_BYTES` chunk, the chunk sums mixed with odd weights and the word count (a signed 64-bit int).
    A corruption check computed where the bytes are, not a cryptographic digest."""
    return checksums([payload])[0]


def checksums(payloads: Iterable[torch.Tensor]) -> list[int]:
    """:func:`checksum` of each payload, the sums brought to the host in one transfer (one device sync)."""
    sums, counts = [], []
    for payload in payloads:
        words = payload.view(torch.int64)
        n = words.numel()
        m = n // _CHUNK_WORDS * _CHUNK_WORDS
        parts = [words[:m].view(-1, _CHUNK_WORDS).sum(dim=1)] if m else []
        parts += [words[m:].sum().view(1)] if n > m else []
        sums += parts
        counts.append((n, sum(p.numel() for p in parts)))  # chunk sums, not tensors
    flat = torch.cat([x.to(sums[0].device) for x in sums]).tolist() if sums else []  # one device sync
    out, i = [], 0
    for n, k in counts:
        out.append(_mix(n, flat[i:i + k]))
        i += k
    return out


_SHIFTS: dict[str, torch.Tensor] = {}


def _span_words(data: torch.Tensor, rho: int) -> torch.Tensor:
    """The word-sum contribution (an int64 0-d tensor) of the bytes ``data`` whose first byte sits at stream
    offset ``rho`` mod 8: byte ``i`` adds ``byte << 8 * ((rho + i) % 8)``, so a range summed on its own adds
    exactly what its bytes add to :func:`checksum`'s word sums."""
    n = data.numel()
    if rho % 8 == 0 and n % 8 == 0 and data.storage_offset() % 8 == 0:  # whole words (the common case)
        return data.view(torch.int64).sum()
    key = str(data.device)
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(0, 64, 8, dtype=torch.int64, device=data.device)
    shifts = _SHIFTS[key]
    h = min((-rho) % 8, n)  # bytes before the first word boundary
    mid = (n - h) // 8 * 8
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if h:
        total += (data[:h].long() << shifts[rho % 8:rho % 8 + h]).sum()
    if mid:
        words = data[h:h + mid]
        if words.storage_offset() % 8:  # not 8-byte aligned in memory: view a copy
            words = words.clone()
        total += words.view(torch.int64).sum()
    if n - h - mid:
        total += (data[h + mid:].long() << shifts[:n - h - mid]).sum()
    return total


#: the cell of :class:`ChunkSums`: a bucket size that is a multiple of it has its checksum chunks made of
#: whole cells (so a producer's sums serve any such bucket size)
SUM_CELL = 4096


class ChunkSums:
    """The word sums of a plan's byte stream per :data:`SUM_CELL` bytes (:attr:`sums`), added as the stream is
    produced (by the quantize kernel as it writes, :meth:`add`, :meth:`copy_in`), so :meth:`checksum` gives a
    bucket's checksum without reading it when its chunks are whole cells (:meth:`covers`)."""

    def __init__(self, plan: RefitPlan, device: str | torch.device = "cpu"):
        self.plan, self.total = plan, plan.total_bytes
        self.sums = torch.zeros(max(1, -(-self.total // SUM_CELL)), dtype=torch.int64, device=device)

    def reset(self) -> None:
        self.sums.zero_()

    def native(self, spans: list[tuple[tuple[int, int], tuple[int, int]]]):
        """The :class:`mxport.native.StreamSums` of a native batch whose outputs lie at ``spans`` (per job
        ``((values offset, bytes), (scales offset, bytes))``), adding through a view of :attr:`sums`."""
        flat = [s for pair in spans for s in pair]
        for o, n in flat:
            if o < 0 or o + n > self.total:
                raise ValueError(f"{n} bytes at stream offset {o} fall outside the plan's stream")
        lo = min((o for o, _ in flat), default=0) // SUM_CELL
        hi = -(-max((o + n for o, n in flat), default=0) // SUM_CELL)
        base = lo * SUM_CELL
        return StreamSums([(q - base, e - base) for (q, _), (e, _) in spans], SUM_CELL, SUM_CELL,
                          self.sums[lo:max(hi, lo + 1)])

    def _add(self, sums: torch.Tensor, pieces: list[tuple[torch.Tensor, int]], first: int = 0) -> None:
        """Add flat uint8 ``(data, stream offset)`` pieces to ``sums`` (cell ``first`` = ``sums[0]``)."""
        index, parts = [], []
        for data, offset in pieces:
            n, pos = data.numel(), 0
            if offset < 0 or offset + n > self.total:
                raise ValueError(f"{n} bytes at stream offset {offset} fall outside the plan's stream")
            while pos < n:
                off = offset + pos
                cell, within = divmod(off, SUM_CELL)
                full = (n - pos) // SUM_CELL
                if within == 0 and full > 1 and data[pos:].storage_offset() % 8 == 0:
                    # whole cells in one op (one parallel region, not one per cell)
                    take = full * SUM_CELL
                    index += range(cell - first, cell - first + full)
                    parts.append(data[pos:pos + take].view(torch.int64).view(full, SUM_CELL // 8).sum(dim=1))
                else:
                    take = min(n - pos, SUM_CELL - within)
                    index.append(cell - first)
                    parts.append(_span_words(data[pos:pos + take], off % 8).view(1))
                pos += take
        if parts:
            sums.index_add_(0, torch.tensor(index, device=sums.device), torch.cat(parts))

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, offset: int) -> None:
        """``dst.copy_(src)`` (``dst`` at stream ``offset``), a few cells at a time, each summed in cache."""
        d, s = dst.view(-1), src.reshape(-1)
        size = d.element_size()
        n, pos = d.numel() * size, 0
        step = 64 * SUM_CELL  # bytes per piece: a few cells, still in L2 when summed
        while pos < n:
            off = offset + pos
            take = min(n - pos, step - off % SUM_CELL)
            if take % size:  # a piece boundary inside an element (never for the plan's aligned offsets)
                dst.copy_(src)
                self.add(dst, offset)
                return
            piece = d[pos // size:(pos + take) // size]
            piece.copy_(s[pos // size:(pos + take) // size])
            self._add(self.sums, [(piece.view(torch.uint8), off)])
            pos += take

    def add(self, data: torch.Tensor, offset: int) -> None:
        """Add the bytes of ``data`` (a contiguous tensor) at stream ``offset``."""
        self._add(self.sums, [(byte_view(data, argname="data"), offset)])

    def covers(self, start: int, size: int) -> bool:
        """True when the checksum chunks of ``[start, start + size)`` are made of whole cells."""
        return start % SUM_CELL == 0 and (size % SUM_CELL == 0 or start + size == self.total)

    def checksum(self, start: int, size: int, extra: list[tuple[torch.Tensor, int]] = ()) -> int:
        """:func:`checksum` of the stream range ``[start, start + size)`` from the sums, plus the bytes of
        ``extra`` (``(tensor, stream offset)`` pieces inside it, summed now)."""
        if not self.covers(start, size):
            raise ValueError(f"stream range {start}+{size} does not start and end on cells of {SUM_CELL} "
                             "bytes")
        first, n = start // SUM_CELL, -(-size // SUM_CELL)  # no cell for an empty range
        sums = self.sums[first:first + n]
        if extra:
            sums, pieces = sums.clone(), []
            for data, offset in extra:
                data = byte_view(data, argname="data")
                if offset < start or offset + data.numel() > start + size:
                    raise ValueError(f"{data.numel()} bytes at stream offset {offset} are not inside the "
                                     f"range {start}+{size}")
                pieces.append((data, offset))
            self._add(sums, pieces, first)
        per = CHUNK_BYTES // SUM_CELL
        if n % per:
            sums = torch.cat([sums, sums.new_zeros(per - n % per)])
        return _mix(size // 8, sums.view(-1, per).sum(dim=1).tolist())


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of plan entry ``entry`` from its byte ``src`` land at byte ``dst`` of the payload."""

    entry: int
    src: int
    dst: int
    length: int


def check_bucket_bytes(bucket_bytes) -> int:
    """``bucket_bytes`` if it is a positive multiple of :data:`ALIGN` below 2**63, else ValueError."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or not 0 < bucket_bytes < 1 << 63 \
            or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN} below 2**63, got "
                         f"{bucket_bytes!r}")
    return bucket_bytes


class BucketLayout:
    """A plan's byte stream cut into buckets of ``bucket_bytes``: per bucket its size, the segments of the
    tensors in it and the gaps (alignment padding, zeroed on packing)."""

    def __init__(self, plan: RefitPlan, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.plan, self.bucket_bytes = plan, check_bucket_bytes(bucket_bytes)
        B = bucket_bytes
        self.num_buckets = max(1, -(-plan.total_bytes // B))
        self.sizes = [min(B, plan.total_bytes - b * B) for b in range(self.num_buckets)]
        self.segments: list[list[Segment]] = [[] for _ in range(self.num_buckets)]
        for i, e in enumerate(plan.entries):
            pos, end = e.offset, e.offset + e.nbytes
            while pos < end:
                b = pos // B
                take = min(end, (b + 1) * B) - pos
                self.segments[b].append(Segment(i, pos - e.offset, pos - b * B, take))
                pos += take
        # alignment padding between tensors: zeroed on packing so a bucket's bytes (and
        # checksum) are deterministic
        self.gaps: list[list[tuple[int, int]]] = []
        for b, segs in enumerate(self.segments):
            gaps, pos = [], 0
            for sg in segs:
                if sg.dst > pos:
                    gaps.append((pos, sg.dst - pos))
                pos = sg.dst + sg.length
            if pos < self.sizes[b]:
                gaps.append((pos, self.sizes[b] - pos))
            self.gaps.append(gaps)
        self._chunks: dict[int, list] = {}
        self._gap_index: dict[tuple[int, str], torch.Tensor | None] = {}

    def gap_index(self, b: int, device: torch.device) -> torch.Tensor | None:
        """Bucket ``b``'s gap byte positions as one int64 index on ``device`` (None: no gaps), cached."""
        key = (b, str(device))
        if key not in self._gap_index:
            ranges = [torch.arange(g0, g0 + n) for g0, n in self.gaps[b]]
            self._gap_index[key] = torch.cat(ranges).to(device) if ranges else None
        return self._gap_index[key]

    def chunk_pieces(self, b: int) -> list[list[tuple[int, int, int, int]]]:
        """Bucket ``b``'s pieces ``(entry, src, dst, length)`` per :data:`CHUNK_BYTES` chunk (``entry`` -1: a
        gap), cached."""
        cached = self._chunks.get(b)
        if cached is not None:
            return cached
        pieces = [(s.entry, s.src, s.dst, s.length) for s in self.segments[b]]
        pieces += [(-1, 0, start, n) for start, n in self.gaps[b]]
        pieces.sort(key=lambda p: p[2])
        size = self.sizes[b]
        n_chunks = max(1, -(-size // CHUNK_BYTES))
        chunks: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n_chunks)]
        for entry, src, dst, length in pieces:
            pos, end = dst, dst + length
            while pos < end:
                c = pos // CHUNK_BYTES
                take = min(end, (c + 1) * CHUNK_BYTES) - pos
                chunks[c].append((entry, src + (pos - dst), pos, take))
                pos += take
        self._chunks[b] = chunks
        return chunks

    def bucket_of(self, entry: int) -> int:
        """The bucket holding plan entry ``entry``'s first byte (a zero-byte entry at the stream's end: the
        last bucket)."""
        return min(self.plan.entries[entry].offset // self.bucket_bytes, self.num_buckets - 1)

    def tensor_names(self, b: int) -> list[str]:
        """Names of the tensors with bytes in bucket ``b``, in stream order."""
        return [self.plan.entries[s.entry].name for s in self.segments[b]]


@dataclass(frozen=True)
class Trailer:
    """The last broadcast of a refit (see module doc)."""

    magic: int
    version: int
    num_buckets: int
    status: int
    entry: int
    reason: int
    checksums: list[int]

    def to_tensor(self) -> torch.Tensor:
        head = [self.magic, self.version, self.num_buckets, self.status, self.entry, self.reason]
        return torch.tensor([*head, *self.checksums], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, trailer: torch.Tensor) -> Trailer:
        vals = trailer.cpu().tolist()
        return cls(*vals[:TRAILER_FIXED], vals[TRAILER_FIXED:])


def make_trailer(version: int, checksums: list[int], status: int = STATUS_OK, entry: int = -1,
                 reason: int = 0) -> torch.Tensor:
    """The int64 trailer of one refit (see module doc)."""
    return Trailer(MAGIC, version, len(checksums), status, entry, reason, list(checksums)).to_tensor()


def pack_bucket(layout: BucketLayout, b: int, sources: list[torch.Tensor], payload: torch.Tensor, *,
                with_checksum: bool = False) -> int | None:
    """Fill ``payload`` (``layout.sizes[b]`` bytes) with bucket ``b``, zeros in the gaps. ``with_checksum``:
    sum each chunk right after packing it, while it is in cache, returning ``checksum(payload)``."""
    size = layout.sizes[b]
    sums = []
    for c, pieces in enumerate(layout.chunk_pieces(b)):
        for entry, src, dst, length in pieces:
            if entry < 0:
                payload[dst:dst + length].zero_()
            else:
                payload[dst:dst + length].copy_(sources[entry][src:src + length])
        if with_checksum:
            sums.append(payload[c * CHUNK_BYTES:min(size, (c + 1) * CHUNK_BYTES)].view(torch.int64).sum())
    return _mix(size // 8, torch.stack(sums).tolist()) if with_checksum else None


def unpack_segments(segments: list[Segment], payload: torch.Tensor, targets: list[torch.Tensor]) -> None:
    """Copy each segment's bytes from ``payload`` into ``targets[entry]`` (flat uint8 views), in place."""
    for s in segments:
        targets[s.entry][s.src:s.src + s.length].copy_(payload[s.dst:s.dst + s.length])


def in_place_payload(segments: list[Segment], gap_index: torch.Tensor | None, sources: list[torch.Tensor],
                     size: int, device: torch.device) -> torch.Tensor | None:
    """A bucket's payload as a view of its sources' own memory (a bucket inside one tensor, or an arena laid
    out as the stream) when every segment sits in one storage on ``device`` where the layout puts it and the
    gaps there hold zeros; else None (pack it)."""
    if not segments:
        return None
    first = sources[segments[0].entry]
    if first.device != device:
        return None
    storage = first.untyped_storage()
    base = first.data_ptr() + segments[0].src - segments[0].dst  # address of the payload's byte 0
    for sg in segments[1:]:
        v = sources[sg.entry]
        if v.untyped_storage().data_ptr() != storage.data_ptr() or v.data_ptr() + sg.src - sg.dst != base:
            return None
    start = base - storage.data_ptr()
    if start < 0 or start + size > storage.nbytes():
        return None
    payload = storage_bytes(storage, start, size, device)
    if gap_index is not None and bool(payload[gap_index].any()):
        return None
    return payload
