"""Delta refit's codec: what changed in a stream's buckets since the base version both ends hold.

An MXFP8 block's bytes depend only on its own 32 inputs, so the bytes that changed since the version an engine
holds are an exact, rank-local delta of the stream. The unit is the 8-byte word (the checksum's word): per
bucket either nothing (unchanged), the changed words (their indices, a byte mask each, the changed bytes only:
element granularity for FP8 values, E8M0 scales and BF16 kept tensors alike), or the whole bucket when its
delta would not be smaller. On the wire (one uint8 payload, every section padded to 8 bytes)::

    int64 [DELTA_MAGIC, num_buckets, total_bytes, payload bytes, then per bucket (mode, words, values)]
    per bucket: WORDS -> int32 word indices (increasing), uint8 byte masks, uint8 changed bytes;
                WHOLE -> the bucket's bytes; UNCHANGED -> nothing

Nothing in a received payload is trusted: :func:`parse` checks every count, size and index before
:func:`apply` writes a byte, and the receiver checks the result against the sender's checksums of the new
stream (the trailer), so a delta applied onto the wrong base is caught, never committed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

DELTA_MAGIC = 0x4D58444C5441  # "MXDLTA"
UNCHANGED, WORDS, WHOLE = 0, 1, 2
_HEAD = 4
_BIT = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


@dataclass(frozen=True)
class BucketDelta:
    """One bucket's change: ``mode`` and, for WORDS, ``index`` (int32 word indices), ``masks`` (uint8, bit k:
    byte k of the word changed) and ``values`` (the changed bytes in order); for WHOLE, ``values`` the
    bucket."""

    mode: int
    index: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def words(self) -> int:
        """Words that changed."""
        return 0 if self.index is None else int(self.index.numel())

    @property
    def nbytes(self) -> int:
        """Bytes this bucket adds to the payload."""
        if self.mode == WORDS:
            return _pad8(4 * self.words) + _pad8(self.words) + _pad8(int(self.values.numel()))
        return _pad8(int(self.values.numel())) if self.mode == WHOLE else 0


def diff_bucket(base: torch.Tensor, new: torch.Tensor, scratch: Scratch | None = None) -> BucketDelta:
    """The change from ``base`` to ``new`` (1-D uint8 tensors of one size, a multiple of 8), ``base`` brought
    up to ``new``: the changed words with their byte masks, or WHOLE (``values``: ``base``, now equal to
    ``new``) when that is not smaller. One native pass where the kernel is built (``scratch`` holds what it
    records), torch ops otherwise; the same result."""
    if base.shape != new.shape or new.numel() % 8:
        raise ValueError(f"diff_bucket: two byte ranges of one size, a multiple of 8, got {base.numel()} and "
                         f"{new.numel()}")
    lib = _lib(base, new)
    d = _diff_native(lib, base, new, scratch or Scratch()) if lib is not None else _diff_torch(base, new)
    if d.mode == WORDS and d.nbytes >= new.numel():
        return BucketDelta(WHOLE, d.index, d.masks, base)
    return d


def _lib(*ts: torch.Tensor):
    from ...quantize import NATIVE_PATH

    return NATIVE_PATH.lib_for(ts[0]) if all(t.device.type == "cpu" for t in ts) else None


class Scratch:
    """The native diff's output buffers, grown to the largest bucket and reused."""

    def __init__(self):
        self.idx = self.masks = self.vals = torch.zeros(0, dtype=torch.uint8)

    def sized(self, nbytes: int) -> Scratch:
        cap = nbytes // 5 + 1  # a word costs at least 5 bytes: more than this and WHOLE is smaller
        if self.masks.numel() < cap:
            self.idx = torch.empty(cap, dtype=torch.int32)
            self.masks = torch.empty(cap, dtype=torch.uint8)
        if self.vals.numel() < nbytes:
            self.vals = torch.empty(nbytes, dtype=torch.uint8)
        return self


def _diff_native(lib, base: torch.Tensor, new: torch.Tensor, scratch: Scratch) -> BucketDelta:
    from ... import native

    s = scratch.sized(new.numel())
    k, r, v = native.delta_diff(lib, base, new, s.idx, s.masks, s.vals)
    if k == 0:
        return BucketDelta(UNCHANGED)
    if r < k:  # the caps hold every word a bucket has (n / 8 < n / 5): not reached
        raise RuntimeError(f"delta diff recorded {r} of {k} changed words")
    return BucketDelta(WORDS, s.idx[:r].clone(), s.masks[:r].clone(), s.vals[:v].clone())


def _diff_torch(base: torch.Tensor, new: torch.Tensor) -> BucketDelta:
    b64, n64 = base.view(torch.int64), new.view(torch.int64)
    index = (b64 != n64).nonzero().squeeze(1)
    if index.numel() == 0:
        return BucketDelta(UNCHANGED)
    cells = new.view(-1, 8)[index]
    changed = cells != base.view(-1, 8)[index]
    masks = (changed.to(torch.uint8) * _BIT.to(new.device)).sum(dim=1, dtype=torch.uint8)
    b64[index] = n64[index]
    return BucketDelta(WORDS, index.to(torch.int32), masks, cells[changed])


def changed_bytes(deltas: list[tuple[int, BucketDelta]]) -> torch.Tensor:
    """The stream offsets (int64, increasing) of every byte that changed, from ``(bucket start, delta)``."""
    parts = [start + 8 * d.index.long().unsqueeze(1) + torch.arange(8) for start, d in deltas
             if d.index is not None]
    masks = [_bits(d.masks) for _, d in deltas if d.index is not None]
    return torch.cat([p[m] for p, m in zip(parts, masks, strict=True)]) if parts else \
        torch.zeros(0, dtype=torch.int64)


def _block_bytes(values, scales) -> int:
    """Value bytes per block: 32 FP8 elements (MXFP8), 16 bytes of packed E2M1 (MXFP4: 32 elements), or 8
    (NVFP4: 16 elements, its E4M3 scales tell it apart)."""
    if values.dtype != "uint8":
        return 32
    return 8 if scales is not None and scales.dtype == "float8_e4m3fn" else 16


def block_counts(plan, offsets: torch.Tensor) -> tuple[int, int]:
    """``(changed, total)`` blocks (MXFP8, MXFP4 or NVFP4) of the plan's values entries, from the changed
    stream byte ``offsets``: byte ``i`` of a values entry is in block ``i // block_bytes`` (rowwise blocks, K
    whole blocks; :func:`_block_bytes`), byte ``i`` of the (compact, rowwise) scales entry after it is block
    ``i``'s scale (an NVFP4 global scale after that is not a block)."""
    entries = plan.entries
    starts = torch.tensor([e.offset for e in entries], dtype=torch.int64)
    which = torch.searchsorted(starts, offsets, right=True) - 1
    total = hit = 0
    for i, e in enumerate(entries):
        if e.role != "values":
            continue
        scales = entries[i + 1] if i + 1 < len(entries) and entries[i + 1].role == "scales" else None
        per = _block_bytes(e, scales)
        blocks = e.nbytes // per
        got = [(offsets[which == i] - e.offset) // per]
        if i + 1 < len(entries) and entries[i + 1].role == "scales":
            got.append(offsets[which == i + 1] - entries[i + 1].offset)
        got = torch.cat(got)
        total += blocks
        hit += int(torch.unique(got[(got >= 0) & (got < blocks)]).numel())
    return hit, total


def streams_block_counts(streams) -> tuple[int, int]:
    """:func:`block_counts` summed over delta streams' last refits (``StreamSender``s)."""
    counts = [block_counts(s.plan, changed_bytes(s.last_changes)) for s in streams]
    return sum(h for h, _ in counts), sum(t for _, t in counts)


def encode(deltas: list[BucketDelta], total_bytes: int) -> torch.Tensor:
    """The wire payload of one delta refit (see the module doc)."""
    head = [DELTA_MAGIC, len(deltas), total_bytes, 0]
    for d in deltas:
        head += [d.mode, d.words if d.mode == WORDS else 0, 0 if d.values is None else int(d.values.numel())]
    size = 8 * len(head) + sum(d.nbytes for d in deltas)
    head[3] = size
    out = torch.zeros(size, dtype=torch.uint8)
    out[:8 * len(head)] = torch.tensor(head, dtype=torch.int64).view(torch.uint8)
    pos = 8 * len(head)
    for d in deltas:
        parts = [d.index.view(torch.uint8), d.masks, d.values] if d.mode == WORDS else \
            [d.values] if d.mode == WHOLE else []
        for p in parts:
            out[pos:pos + p.numel()] = p
            pos += _pad8(p.numel())
    return out


def parse(payload: torch.Tensor, sizes: list[int], total_bytes: int) -> list[BucketDelta]:
    """The bucket deltas of a received ``payload`` for a stream cut into buckets of ``sizes``; ValueError
    naming the first thing that does not fit (nothing is written before every check passed)."""
    n = payload.numel()
    head_bytes = 8 * (_HEAD + 3 * len(sizes))
    if n < head_bytes or n % 8:
        raise ValueError(f"delta payload of {n} bytes: shorter than its header or not whole words")
    head = payload[:head_bytes].view(torch.int64).tolist()
    magic, nb, total, size = head[:_HEAD]
    if magic != DELTA_MAGIC or nb != len(sizes) or total != total_bytes or size != n:
        raise ValueError(f"delta header (magic {magic:#x}, {nb} buckets, {total} stream bytes, {size} "
                         f"payload bytes) does not match this stream ({len(sizes)} buckets, {total_bytes} "
                         f"bytes, {n} received)")
    out, pos = [], head_bytes
    for b, bucket_size in enumerate(sizes):
        mode, words, nvals = head[_HEAD + 3 * b:_HEAD + 3 * b + 3]
        d, pos = _parse_bucket(payload, pos, b, bucket_size, mode, words, nvals)
        out.append(d)
    if pos != n:
        raise ValueError(f"delta payload: {n - pos} bytes after the last bucket")
    return out


def _parse_bucket(payload, pos: int, b: int, size: int, mode: int, words: int, nvals: int):
    n = payload.numel()
    if mode == UNCHANGED and words == nvals == 0:
        return BucketDelta(UNCHANGED), pos
    if mode == WHOLE and words == 0 and nvals == size and pos + _pad8(size) <= n:
        return BucketDelta(WHOLE, values=payload[pos:pos + size]), pos + _pad8(size)
    ok = mode == WORDS and 0 < words <= size // 8 and words <= nvals <= 8 * words
    end = pos + _pad8(4 * words) + _pad8(words) + _pad8(nvals) if ok else n + 1
    if end > n:
        raise ValueError(f"delta bucket {b}: mode {mode}, {words} words, {nvals} bytes do not fit a bucket "
                         f"of {size} bytes in the payload")
    index = payload[pos:pos + 4 * words].view(torch.int32)
    pos += _pad8(4 * words)
    masks = payload[pos:pos + words]
    pos += _pad8(words)
    values = payload[pos:pos + nvals]
    i64 = index.long()
    if int(i64[0]) < 0 or int(i64[-1]) >= size // 8 or (words > 1 and not bool((i64[1:] > i64[:-1]).all())):
        raise ValueError(f"delta bucket {b}: word indices not increasing within its {size // 8} words")
    bits = _bits(masks)
    if not bool(bits.any(dim=1).all()) or int(bits.sum()) != nvals:
        raise ValueError(f"delta bucket {b}: byte masks (one bit set at least, {int(bits.sum())} in all) do "
                         f"not match its {nvals} changed bytes")
    return BucketDelta(WORDS, index, masks, values), end


def _bits(masks: torch.Tensor) -> torch.Tensor:
    """``[n, 8]`` bool: byte k of word i changed."""
    return (masks.unsqueeze(1) & _BIT.to(masks.device)) != 0


def apply(d: BucketDelta, bucket: torch.Tensor) -> None:
    """Write ``d`` (parsed) into ``bucket``, the base version's bytes (1-D uint8), in place."""
    if d.mode == WHOLE:
        bucket.copy_(d.values)
    elif d.mode == WORDS and (lib := _lib(bucket, d.index)) is not None:
        from ... import native

        native.delta_apply(lib, bucket, d.index.contiguous(), d.masks.contiguous(), d.values.contiguous())
    elif d.mode == WORDS:
        cells = bucket.view(-1, 8)
        index = d.index.long().to(bucket.device)
        rows = cells[index]
        rows[_bits(d.masks.to(bucket.device))] = d.values.to(bucket.device)
        cells[index] = rows


def digest(checksums: list[int]) -> int:
    """A nonzero int63 naming a stream version by its buckets' checksums (0 means: no base)."""
    raw = torch.tensor(list(checksums), dtype=torch.int64).numpy().tobytes()
    h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
    return h or 1


def max_payload(sizes: list[int]) -> int:
    """The largest payload a stream of bucket ``sizes`` can take (every bucket whole)."""
    return 8 * (_HEAD + 3 * len(sizes)) + sum(_pad8(s) for s in sizes)


class Base:
    """A delta stream's sender side: the bytes of the version its receivers hold (``ok`` while it is
    trusted: after a committed refit; anything else makes the next refit go whole), its version and digest."""

    def __init__(self, total_bytes: int, device: torch.device):
        self.bytes = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
        self.ok, self.version, self.digest = False, -1, 0
        self.scratch = Scratch()

    def bucket(self, layout, b: int) -> torch.Tensor:
        start = b * layout.bucket_bytes
        return self.bytes[start:start + layout.sizes[b]]

    def settle(self, version: int, checksums: list[int], committed: bool) -> None:
        """After the vote: committed, the base is that version (named by its buckets' checksums)."""
        self.ok = bool(committed)
        if committed:
            self.version, self.digest = int(version), digest(checksums)


@dataclass(frozen=True)
class Decision:
    """What every endpoint of a delta stream concluded from the agreement: ``delta`` (payload of ``nbytes``)
    or every bucket whole; ``full_for`` the receivers whose base did not match the sender's."""

    delta: bool
    nbytes: int
    full_for: tuple[int, ...]


def agree(transport, nbytes: int, version: int, base_digest: int, limit: int) -> Decision:
    """The per-refit agreement of a delta stream, one ``all_gather`` of ``[nbytes, version, digest]``: the
    sender offers a delta of ``nbytes`` (-1: none) onto its base (``version``, ``base_digest``), each receiver
    says which version it holds (digest 0: none it can patch). A delta goes out only when every receiver holds
    the sender's base; every endpoint draws the same conclusion from the same rows. A sender's offer above
    ``limit`` bytes is a protocol error (RuntimeError: the stream is out of step)."""
    rows = transport.all_gather(torch.tensor([nbytes, version, base_digest], dtype=torch.int64))
    offer, v, d = (int(x) for x in rows[transport.src].tolist())
    if offer > limit:
        raise RuntimeError(f"the sender offered a delta of {offer} bytes, more than this stream's {limit}")
    full_for = tuple(r for r, row in enumerate(rows) if r != transport.src
                     and (int(row[1]) != v or int(row[2]) != d or d == 0))
    return Decision(offer >= 0 and not full_for, offer, full_for)
