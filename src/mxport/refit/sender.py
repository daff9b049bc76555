"""RefitSender: broadcasts the plan's tensors in fixed-size byte buckets — buckets inside one tensor straight from
its storage, mixed buckets packed into reused buffers while earlier buckets are on the wire (asynchronous broadcast)
— then a trailer with the version and per-bucket checksums."""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Iterable

import torch

from .buckets import (
    STATUS_ABORT,
    BucketLayout,
    byte_view,
    canonical_device,
    checksum,
    in_place_payload,
    make_trailer,
    pack_bucket,
)
from .handshake import exchange_plans
from .plan import RefitPlan
from .transport import Transport


class _ProducerFailed(Exception):
    """Carries an exception raised by the ``tensors`` iterator, so that ``send`` aborts the refit (the receivers
    keep their weights and stay in step) before re-raising it."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _retire_oldest(pending, slot_busy: list) -> None:
    """Wait for the oldest in-flight broadcast and free its pack buffer slot (if it used one)."""
    handle, slot, _ = pending.popleft()
    handle.wait()
    if slot is not None:
        slot_busy[slot] = None

class RefitSender:
    """The trainer side of refit.

    Args:
        transport: a :class:`~mxport.refit.transport.Transport` endpoint whose rank is the sender (``src``).
        plan: the :class:`RefitPlan` (built once; reused for every refit).
        use_checksum: compute a per-bucket checksum (chunked int64 sum, :func:`~mxport.refit.buckets.checksum`);
            receivers verify it before committing.
        device: where the pack buffers live ("cpu" for gloo, the GPU for NCCL); tensors already there are sent
            without packing when a bucket lies inside one of them.
        inflight: broadcasts in flight at once (and pack buffers), >= 1.
        stream_crc32: also compute a CRC-32 of the whole byte stream (``zlib.crc32`` chained over the buckets,
            ~3 GB/s on CPU) and return it as ``stream_crc32``; compare with
            :meth:`RefitReceiver.live_crc32` for an end-to-end bit-exactness check.

    Pack buffers (``inflight`` x ``bucket_bytes``) are allocated once.
    """

    def __init__(self, transport: Transport, plan: RefitPlan, *, use_checksum: bool = True,
                 device: str | torch.device = "cpu", inflight: int = 2, stream_crc32: bool = False):
        if not isinstance(plan, RefitPlan):
            raise TypeError(f"plan must be a RefitPlan, got {type(plan).__name__}")
        if not transport.is_sender:
            raise ValueError(f"transport rank {transport.rank} is not the sender (src={transport.src})")
        if inflight < 1:
            raise ValueError(f"inflight must be >= 1, got {inflight}")
        self.transport, self.plan, self.use_checksum = transport, plan, use_checksum
        self.stream_crc32 = stream_crc32
        self.device = canonical_device(device)
        self.layout = BucketLayout(plan)
        self.inflight = inflight
        self.version = 0
        self._packbuf = [torch.zeros(plan.bucket_bytes, dtype=torch.uint8, device=self.device)
                         for _ in range(min(inflight, plan.num_buckets))]
        self._handshaken = False
        # number of entries that must be available before bucket b (entries starting before its end)
        ends = [min((b + 1) * plan.bucket_bytes, plan.total_bytes) for b in range(plan.num_buckets)]
        self._need = [sum(1 for e in plan.entries if e.offset < end) for end in ends]
        self._need[-1] = len(plan)
        #: test hook: ``corrupt(bucket, payload)`` called after the checksum is taken, before the broadcast
        self._corrupt = None

    def handshake(self) -> None:
        """Exchange plan digests with every receiver (raises RefitPlanMismatch on all sides on a mismatch)."""
        self.version = exchange_plans(self.transport, self.plan, self.version)
        self._handshaken = True

    def send(self, tensors: Iterable[torch.Tensor]) -> dict:
        """Send one refit: ``tensors`` yields exactly one contiguous tensor per plan entry, in plan order (a list,
        or a generator such as a lazy quantizer: it is consumed bucket by bucket, so producing the next tensors
        overlaps the broadcast of the current bucket).

        A bucket whose bytes already sit in one storage in stream order (a bucket inside one tensor; tensors that
        are views of one arena laid out as the plan's byte stream, such as :func:`~mxport.refit.allocate_targets`
        views or ``TrainerSource(arena=True)``'s tensors) is sent straight from that memory, without packing
        (:func:`~mxport.refit.buckets.in_place_payload`; alignment padding goes out as it is). The other buckets
        are packed; packing sums each checksum chunk while it is in cache, and a zero-copy bucket is summed while
        it is on the wire.

        Each tensor's dtype and shape are checked against the plan. On any error (wrong dtype/shape, too few or too
        many tensors, any exception raised by the ``tensors`` iterator itself) the remaining buckets are still sent (their content unused) followed by an "abort" trailer,
        so receivers keep their weights and stay in step; then the error is raised here.

        Returns:
            dict: ``version``, ``bytes`` (payload bytes), ``buckets``, ``zero_copy_buckets`` (sent without
            packing), ``seconds`` (whole send), ``produce_s`` (time inside ``tensors``, e.g. quantize), ``pack_s``
            (packing, with the packed buckets' checksums summed on the fly), ``checksum_s`` (checksums of the
            zero-copy buckets, and the optional ``stream_crc32``), ``wait_s`` (waiting for the wire), ``stream_crc32`` (int, or None when off), ``gbps``
            (payload bytes / seconds / 1e9).
        """
        if not self._handshaken:
            self.handshake()
        plan, layout = self.plan, self.layout
        self.version += 1
        version = self.version
        it = iter(tensors)
        sources: list[torch.Tensor | None] = []
        pending: deque = deque()  # (handle, pack slot or None, payload kept alive)
        slot_busy: list = [None] * len(self._packbuf)
        crcs: list[int] = []
        stream_crc = 0
        t_produce = t_pack = t_crc = t_wait = 0.0
        zero_copy = 0
        t0 = time.perf_counter()
        error: BaseException | None = None
        abort_entry = -1
        b = 0
        try:
            for b in range(plan.num_buckets):
                t1 = time.perf_counter()
                while len(sources) < self._need[b]:
                    i = len(sources)
                    abort_entry = i
                    try:
                        t = next(it)
                    except StopIteration:
                        raise ValueError(f"refit v{version}: got {i} tensors, the plan has {len(plan)} "
                                         f"(first missing: {plan.entries[i].name!r})") from None
                    except (ValueError, TypeError):
                        raise
                    except Exception as exc:  # noqa: BLE001 - the producer failed (OOM, a kernel error): abort below
                        raise _ProducerFailed(exc) from exc
                    plan.check_tensor(i, t)
                    sources.append(byte_view(t, argname=plan.entries[i].name))
                if b == plan.num_buckets - 1 and next(it, None) is not None:
                    abort_entry = -1
                    raise ValueError(f"refit v{version}: more tensors than the {len(plan)} of the plan")
                t2 = time.perf_counter()
                size = layout.sizes[b]
                slot = None
                payload = in_place_payload(layout.segments[b], layout.gap_index(b, self.device), sources, size,
                                           self.device)
                if payload is not None:
                    zero_copy += 1
                else:
                    slot = b % len(self._packbuf)
                    while slot_busy[slot] is not None:  # wait until this pack buffer is off the wire
                        _retire_oldest(pending, slot_busy)
                    payload = self._packbuf[slot][:size]
                t3 = time.perf_counter()
                crc = None
                if slot is not None:  # packing sums each chunk while it is in cache: checksum for one pass less
                    crc = pack_bucket(layout, b, sources, payload, with_checksum=self.use_checksum)
                t4 = time.perf_counter()
                # a zero-copy bucket is summed once its broadcast is posted, while it is on the wire (the test hook
                # that corrupts the wire needs the checksum of the bytes before it)
                late = crc is None and self.use_checksum and self._corrupt is None
                if crc is None and not late:
                    crc = checksum(payload) if self.use_checksum else 0
                if self.stream_crc32:
                    stream_crc = zlib.crc32(payload.cpu().numpy(), stream_crc)
                t5 = time.perf_counter()
                if self._corrupt is not None:
                    self._corrupt(b, payload)
                while len(pending) >= self.inflight:
                    _retire_oldest(pending, slot_busy)
                t6 = time.perf_counter()
                pending.append((self.transport.broadcast(payload, async_op=True), slot, payload))
                t6b = time.perf_counter()
                if late:
                    crc = checksum(payload)
                crcs.append(crc)
                t_crc += time.perf_counter() - t6b
                if slot is not None:
                    slot_busy[slot] = True
                # release sources that are fully handed to the wire (a generator's tensors can then be freed)
                bucket_end = b * plan.bucket_bytes + size
                for i in range(len(sources)):
                    if sources[i] is not None and plan.entries[i].offset + plan.entries[i].nbytes <= bucket_end:
                        sources[i] = None
                t_produce += t2 - t1
                t_pack += t4 - t3
                t_crc += t5 - t4
                t_wait += (t3 - t2) + (t6 - t5)
        except _ProducerFailed as exc:
            error = exc.error
        except (ValueError, TypeError) as exc:
            error = exc
        t7 = time.perf_counter()
        while pending:
            pending.popleft()[0].wait()
        t_wait += time.perf_counter() - t7
        if error is not None:
            self._abort(b, abort_entry)
            raise error
        self.transport.broadcast(make_trailer(version, crcs).to(self.device))
        seconds = time.perf_counter() - t0
        return {"version": version, "bytes": plan.total_bytes, "buckets": plan.num_buckets,
                "zero_copy_buckets": zero_copy, "seconds": seconds, "produce_s": t_produce, "pack_s": t_pack,
                "checksum_s": t_crc, "wait_s": t_wait, "stream_crc32": stream_crc if self.stream_crc32 else None,
                "gbps": plan.total_bytes / seconds / 1e9 if seconds > 0 else 0.0}

    def _abort(self, first: int, entry: int) -> None:
        """Send buckets ``first..`` (unused content) and an abort trailer so receivers drain the same bytes."""
        buf = self._packbuf[0]
        for b in range(first, self.plan.num_buckets):
            self.transport.broadcast(buf[:self.layout.sizes[b]])
        trailer = make_trailer(self.version, [0] * self.plan.num_buckets, STATUS_ABORT, entry)
        self.transport.broadcast(trailer.to(self.device))
