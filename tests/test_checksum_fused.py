"""Refit checksums fused into the cast: the quantize kernels add the word sums of the bytes they write, per
4 KiB cell of the stream (:class:`mxport.refit.buckets.ChunkSums`), so that the sender gets every bucket's
checksum (``TrainerSource.stream_checksum``) without reading the bucket, whatever the stream's bucket size (a
multiple of 4 KiB; any other size is summed from the send buffer). Each test compares with
:func:`mxport.refit.buckets.checksum` of the bucket's packed bytes, exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from mxport.quantize import quantize_many
from mxport.refit import (
    InProcessChannel,
    RefitError,
    RefitReceiver,
    RefitSender,
    Status,
    TrainerSource,
    allocate_targets,
)
from mxport.refit.buckets import (
    CHUNK_BYTES,
    SUM_CELL,
    BucketLayout,
    ChunkSums,
    byte_view,
    checksum,
    pack_bucket,
)
from mxport.refit.plan import RefitPlan
from mxport.testing import FaultyTransport

KERNELS = ["native", "eager"]


def _model(seed: int = 0) -> torch.nn.Module:
    """Odd byte counts (K = 577: rows straddle words; 101 rows), a kept 4.8 MB embedding (several whole
    checksum chunks) and a norm between the quantized weights, one weight of 2.05 M elements (more than one
    checksum chunk, cut between two native threads)."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.a = torch.nn.Linear(577, 101, bias=False)
    m.embed_tokens = torch.nn.Embedding(3000, 401)
    m.b = torch.nn.Linear(1000, 2050, bias=False)
    m.norm = torch.nn.LayerNorm(33)
    m.c = torch.nn.Linear(40, 3, bias=False).to(torch.bfloat16)
    return m


def _packed_checksums(src: TrainerSource, tensors: list[torch.Tensor], bucket_bytes: int = 65536
                      ) -> list[int]:
    """checksum() of every bucket packed from the yielded tensors (the sender's own way)."""
    layout, views = BucketLayout(src.plan, bucket_bytes), [byte_view(t) for t in tensors]
    out = []
    for b, n in enumerate(layout.sizes):
        payload = torch.empty(n, dtype=torch.uint8)
        pack_bucket(layout, b, views, payload)
        out.append(checksum(payload))
    return out


def _fused(src: TrainerSource, bucket_bytes: int = 65536) -> list[int]:
    """The source's checksum of every bucket of a stream cut into ``bucket_bytes``."""
    return [src.stream_checksum(b * bucket_bytes, n) for b, n in enumerate(BucketLayout(src.plan,
                                                                                          bucket_bytes).sizes)]


#: bucket sizes of whole 4 KiB cells: 1 MiB, not a multiple of 1 MiB (3 MiB + 4 KiB, 98 cells), one cell;
#: and one that is not (summed from the send buffer)
BUCKETS = [CHUNK_BYTES, 3 * CHUNK_BYTES + SUM_CELL, 98 * SUM_CELL, SUM_CELL, 400016]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_fused_bucket_checksums_equal_checksum_of_packed_buckets(kernel, bucket_bytes):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the large weight is cut between two native threads, each with its own sums
    try:
        src = TrainerSource(_model(), arena=True, kernel=kernel)
        tensors = list(src.tensors())
    finally:
        torch.set_num_threads(threads)
    want = _packed_checksums(src, tensors, bucket_bytes)
    assert len(want) > 1
    assert _fused(src, bucket_bytes) == want
    # the quantized bytes were summed by the kernel (not read again): the sums hold them without the kept ones
    assert src._sums.sums.any()


def test_fused_checksums_with_kept_tensors_copied_in():
    """Kept tensors cast to BF16 (copied into the send buffer at every call, not adopted) and summed with the
    zero padding between them in one range: still checksum() of the packed buckets."""
    src = TrainerSource(_model(2), arena=True, kept_dtype=torch.bfloat16)
    tensors = list(src.tensors())
    assert _fused(src) == _packed_checksums(src, tensors)


def test_fused_checksums_equal_on_every_kernel_and_every_call():
    sums = {}
    for kernel in ("native", "eager", "compiled"):
        src = TrainerSource(_model(1), arena=True, kernel=kernel)
        for _ in range(2):  # a second call starts from zero sums again
            tensors = list(src.tensors())
            sums[kernel] = _fused(src, 98 * SUM_CELL)
            assert sums[kernel] == _packed_checksums(src, tensors, 98 * SUM_CELL)
    assert sums["native"] == sums["eager"] == sums["compiled"]


def _stream_reference(outputs, offsets, total: int, bucket_bytes: int) -> list[int]:
    """checksum() of each bucket of a byte stream built by hand from the outputs at their offsets."""
    stream = torch.zeros(-(-total // bucket_bytes) * bucket_bytes, dtype=torch.uint8)
    for (q, e), (qo, eo) in zip(outputs, offsets, strict=True):
        stream[qo:qo + q.numel()] = byte_view(q)
        stream[eo:eo + e.numel()] = byte_view(e)
    plan_sizes = [min(bucket_bytes, total - b * bucket_bytes) for b in range(-(-total // bucket_bytes))]
    return [checksum(stream[b * bucket_bytes:b * bucket_bytes + n]) for b, n in enumerate(plan_sizes)]


@pytest.mark.parametrize("kernel", ["native", "eager"])
def test_quantize_many_sums_at_any_stream_offset(kernel):
    """Outputs in their own tensors (not a stream arena) at stream offsets of every residue mod 8: the sums
    are those of the bytes placed at those offsets, whatever the outputs' own addresses."""
    g = torch.Generator().manual_seed(3)
    shapes = [(37, 577), (300, 64), (5, 33), (1200, 1000)]
    xs = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    outs = [(torch.empty(s, dtype=torch.uint8), torch.empty(s[0], -(-s[1] // 32), dtype=torch.uint8))
            for s in shapes]
    offsets, pos = [], 3
    for s in shapes:
        q_off = pos
        e_off = q_off + s[0] * s[1] + 5
        offsets.append((q_off, e_off))
        pos = e_off + s[0] * -(-s[1] // 32) + 7
    total = (pos + 15) // 16 * 16
    bucket_bytes = 171 * SUM_CELL
    plan = RefitPlan([("s", "kept", torch.uint8, (total,))])
    sums = ChunkSums(plan)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        quantize_many(xs, outs=outs, kernel=kernel, sums=sums, offsets=offsets)
    finally:
        torch.set_num_threads(threads)
    want = _stream_reference(outs, offsets, total, bucket_bytes)
    sizes = BucketLayout(plan, bucket_bytes).sizes
    assert [sums.checksum(b * bucket_bytes, n) for b, n in enumerate(sizes)] == want


def test_quantize_many_sums_need_offsets_and_stay_inside_the_stream():
    plan = RefitPlan([("s", "kept", torch.uint8, (4096,))])
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="offsets"):
        quantize_many([x], sums=ChunkSums(plan))
    with pytest.raises(ValueError, match="outside"):
        quantize_many([x], kernel="native", sums=ChunkSums(plan), offsets=[(4000, 0)])
    with pytest.raises(ValueError, match="outside"):
        quantize_many([x], kernel="eager", sums=ChunkSums(plan), offsets=[(4000, 0)])


def test_stream_checksum_refuses_a_range_not_produced_yet():
    src = TrainerSource(_model(), arena=True)
    it = src.tensors()
    next(it)
    total = src.plan.total_bytes
    with pytest.raises(RuntimeError, match="not been produced"):
        src.stream_checksum(total - SUM_CELL, SUM_CELL)
    with pytest.raises(ValueError, match="outside"):
        src.stream_checksum(total - SUM_CELL, 2 * SUM_CELL)
    with pytest.raises(ValueError, match="arena"):
        TrainerSource(_model()).stream_checksum(0, SUM_CELL)


def test_stream_checksum_of_any_range_of_whole_words_is_the_checksum_of_its_bytes():
    """Ranges on cells and off them, straddling entries, empty ones (at a cell inside the stream too), over a
    plan with an empty tensor: each equals ``checksum`` of the send buffer's bytes there; a range off the
    8-byte words is refused by name."""
    import random

    m = _model()
    m.register_buffer("empty", torch.zeros(0))
    src = TrainerSource(m, arena=True)
    list(src.tensors())
    total, stream = src.plan.total_bytes, src._stream
    rng = random.Random(0)
    cells = [c * SUM_CELL for c in range(total // SUM_CELL + 1)]
    ranges = [(0, 0), (0, total), (total, 0), (SUM_CELL, 0), (16, SUM_CELL), (SUM_CELL, total - SUM_CELL)]
    ranges += [(s, n) for s in rng.sample(cells, 20) for n in (0, SUM_CELL, 3 * SUM_CELL, total - s)
               if s + n <= total]
    for _ in range(40):
        s = rng.randrange(total // 8) * 8
        ranges.append((s, rng.randrange((total - s) // 8 + 1) * 8))
    for s, n in ranges:
        assert src.stream_checksum(s, n) == checksum(stream[s:s + n]), (s, n)
    for s, n in ((3, 8), (8, 3), (SUM_CELL + 4, SUM_CELL)):
        with pytest.raises(ValueError, match=f"stream range {s}\\+{n} must start and end on 8-byte words"):
            src.stream_checksum(s, n)


def _refit(src: TrainerSource, fault=None, versions: int = 1):
    """In-process refits of ``src`` with its fused checksums; returns (sent, received, targets, calls)."""
    plan = src.plan
    ch = InProcessChannel(1, timeout_s=30)
    targets = allocate_targets(plan)
    receiver = RefitReceiver(ch.endpoint(1), plan, targets, bucket_bytes=65536)
    got = []

    def rx():
        for _ in range(versions):
            try:
                got.append(receiver.receive())
            except RefitError as exc:
                got.append(exc)

    th = threading.Thread(target=rx)
    th.start()
    ep = ch.endpoint(0) if fault is None else FaultyTransport(ch.endpoint(0), receiver.layout.num_buckets,
                                                             fault)
    sender = RefitSender(ep, plan, bucket_bytes=65536)
    calls = []

    def provider(start: int, size: int) -> int:
        calls.append(start // 65536)
        return src.stream_checksum(start, size)

    sent = []
    for _ in range(versions):
        try:
            sent.append(sender.send(src.tensors(), checksums=provider))
        except RefitError as exc:
            sent.append(exc)
    th.join(timeout=60)
    assert not th.is_alive()
    return sent, got, targets, calls


def test_sender_uses_the_producers_checksums_and_receivers_verify_them():
    src = TrainerSource(_model(), arena=True)
    sent, got, targets, calls = _refit(src, versions=2)
    n = BucketLayout(src.plan, 65536).num_buckets
    assert calls == list(range(n)) * 2
    assert all(not isinstance(s, Exception) for s in sent) and all(not isinstance(r, Exception) for r in got)
    live = [byte_view(t) for t in targets]
    want = [byte_view(t) for t in src.tensors()]
    assert all(torch.equal(a, b) for a, b in zip(live, want, strict=True))


def test_a_byte_corrupted_in_transit_is_still_caught():
    src = TrainerSource(_model(), arena=True)

    def corrupt(refit, b, wire):
        if refit == 2 and b == 1:
            wire[12345] ^= 0x10

    sent, got, targets, _ = _refit(src, corrupt, versions=3)
    assert not isinstance(sent[0], Exception) and not isinstance(got[0], Exception)
    assert isinstance(sent[1], RefitError) and isinstance(got[1], RefitError)
    assert got[1].status == Status.CHECKSUM and got[1].bucket == 1
    assert not isinstance(sent[2], Exception) and not isinstance(got[2], Exception)


def test_wrong_producer_checksums_fail_the_refit():
    """The sender trusts the producer's checksum only as far as the receivers verify it: an off-by-one value
    fails the refit (a fused sum that went wrong can never pass)."""
    src = TrainerSource(_model(), arena=True)
    plan = src.plan
    ch = InProcessChannel(1, timeout_s=30)
    receiver = RefitReceiver(ch.endpoint(1), plan, allocate_targets(plan))
    got = []
    th = threading.Thread(target=lambda: got.append(pytest.raises(RefitError, receiver.receive).value))
    th.start()
    with pytest.raises(RefitError):
        RefitSender(ch.endpoint(0), plan).send(src.tensors(),
                                               checksums=lambda a, n: src.stream_checksum(a, n) + 1)
    th.join(timeout=60)
    assert got and got[0].status == Status.CHECKSUM


def _bucket_of(src: TrainerSource, name: str) -> tuple[int, int]:
    """(entry index, bucket of its first byte) of plan entry ``name``."""
    i = next(j for j, e in enumerate(src.plan.entries) if e.name == name)
    return i, src.plan.entries[i].offset // 65536


def test_kept_tensors_cast_in_are_summed_as_they_are_copied():
    """A kept tensor cast into the send buffer is summed while it is copied in: stream_checksum() gives the
    sums of the bytes tensors() wrote and never reads them again, so a byte changed in the buffer afterwards
    (memory corruption) no longer matches, and the receivers reject it."""
    src = TrainerSource(_model(2), arena=True, kept_dtype=torch.bfloat16)
    tensors = list(src.tensors())
    i, b = _bucket_of(src, "embed_tokens.weight")
    assert src._summed[i]
    before = _packed_checksums(src, tensors)
    assert _fused(src)[b] == before[b]
    byte_view(tensors[i])[5] ^= 0x40
    after = _packed_checksums(src, tensors)
    assert after[b] != before[b]
    assert _fused(src)[b] == before[b]


def test_adopted_kept_tensors_are_summed_when_asked():
    """An adopted kept tensor is the trainer's own parameter (the optimizer changes it in place): its bytes
    are summed when stream_checksum() is asked, as they are then."""
    model = _model(2)
    src = TrainerSource(model, arena=True)
    tensors = list(src.tensors())
    i, b = _bucket_of(src, "embed_tokens.weight")
    assert not src._summed[i]
    with torch.no_grad():
        model.embed_tokens.weight.mul_(0.5)  # an optimizer step, after tensors() and before the send
    assert _fused(src)[b] == _packed_checksums(src, tensors)[b]


@pytest.mark.parametrize("offset", [0, 16, 1 << 20, (1 << 20) - 48, 3])
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(torch.float32, torch.bfloat16),
                                                       (torch.float32, torch.float32),
                                                       (torch.uint8, torch.uint8)])
def test_copy_in_equals_a_copy_then_its_sums(offset, src_dtype, dst_dtype):
    """ChunkSums.copy_in: the bytes of dst.copy_(src), and the sums of adding them after the copy, for a
    tensor across checksum chunks and buckets, at aligned offsets and at one not aligned to its elements
    (offset 3: copied whole, then summed)."""
    g = torch.Generator().manual_seed(offset)
    n = 700_001
    x = (torch.randn(n, generator=g) * 100).to(src_dtype)
    total = (offset + n * dst_dtype.itemsize + 15) // 16 * 16
    plan = RefitPlan([("s", "kept", torch.uint8, (total,))])
    fused, plain = ChunkSums(plan), ChunkSums(plan)
    dst, want = torch.empty(n, dtype=dst_dtype), torch.empty(n, dtype=dst_dtype)
    fused.copy_in(dst, x, offset)
    want.copy_(x)
    plain.add(want, offset)
    assert torch.equal(byte_view(dst), byte_view(want))
    assert torch.equal(fused.sums, plain.sums)
    assert fused.sums.any()
