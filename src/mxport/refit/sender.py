"""RefitSender: packs the plan's tensors into fixed-size byte buckets and broadcasts them, packing bucket b+1
while bucket b is on the wire (two wire buffers, asynchronous broadcast)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from .buckets import (
    HEADER_BYTES,
    STATUS_ABORT,
    BucketLayout,
    byte_view,
    checksum,
    pack_bucket,
    write_header,
)
from .handshake import exchange_plans
from .plan import RefitPlan
from .transport import Transport


class RefitSender:
    """The trainer side of refit.

    Args:
        transport: a :class:`~mxport.refit.transport.Transport` endpoint whose rank is the sender (``src``).
        plan: the :class:`RefitPlan` (built once; reused for every refit).
        use_checksum: write a per-bucket checksum (CRC-32 on CPU) into every bucket header.
        device: where the wire buffers live ("cpu" for gloo, the GPU for NCCL).
        inflight: wire buffers (buckets packed ahead of the one on the wire), >= 1.

    Wire buffers (``inflight`` × (64 + bucket_bytes) bytes) are allocated once.
    """

    def __init__(self, transport: Transport, plan: RefitPlan, *, use_checksum: bool = True,
                 device: str | torch.device = "cpu", inflight: int = 2):
        if not isinstance(plan, RefitPlan):
            raise TypeError(f"plan must be a RefitPlan, got {type(plan).__name__}")
        if not transport.is_sender:
            raise ValueError(f"transport rank {transport.rank} is not the sender (src={transport.src})")
        if inflight < 1:
            raise ValueError(f"inflight must be >= 1, got {inflight}")
        self.transport, self.plan, self.use_checksum = transport, plan, use_checksum
        self.layout = BucketLayout(plan)
        self.version = 0
        self._wire = [torch.zeros(self.layout.max_wire_bytes, dtype=torch.uint8, device=device)
                      for _ in range(min(inflight, plan.num_buckets))]
        self._handshaken = False
        # number of entries that must be available before packing bucket b (entries starting before its end)
        ends = [min((b + 1) * plan.bucket_bytes, plan.total_bytes) for b in range(plan.num_buckets)]
        self._need = [sum(1 for e in plan.entries if e.offset < end) for end in ends]
        self._need[-1] = len(plan)
        #: test hook: ``corrupt(bucket, wire)`` called after the checksum is written, before the broadcast
        self._corrupt = None

    def handshake(self) -> None:
        """Exchange plan digests with every receiver (raises RefitPlanMismatch on all sides on a mismatch)."""
        self.version = exchange_plans(self.transport, self.plan, self.version)
        self._handshaken = True

    def send(self, tensors: Iterable[torch.Tensor]) -> dict:
        """Send one refit: ``tensors`` yields exactly one contiguous tensor per plan entry, in plan order (a list,
        or a generator such as a lazy quantizer: it is consumed bucket by bucket, so producing the next tensors
        overlaps the broadcast of the current bucket).

        Each tensor's dtype and shape are checked against the plan. On any error (wrong dtype/shape, too few or too
        many tensors) the remaining buckets are sent marked "abort" (receivers keep their weights and stay in step)
        and the error is raised here.

        Returns:
            dict: ``version``, ``bytes`` (payload bytes), ``wire_bytes``, ``buckets``, ``seconds`` (whole send),
            ``produce_s`` (time inside ``tensors``, e.g. quantize), ``pack_s``, ``checksum_s``, ``wait_s``
            (waiting for the wire), ``gbps`` (payload bytes / seconds / 1e9).
        """
        if not self._handshaken:
            self.handshake()
        plan, layout = self.plan, self.layout
        self.version += 1
        version = self.version
        it = iter(tensors)
        sources: list[torch.Tensor | None] = []
        handles: list = [None] * len(self._wire)
        t_produce = t_pack = t_crc = t_wait = 0.0
        t0 = time.perf_counter()
        error: BaseException | None = None
        abort_entry = -1
        b = 0
        try:
            for b in range(plan.num_buckets):
                slot = b % len(self._wire)
                wire = self._wire[slot]
                t1 = time.perf_counter()
                while len(sources) < self._need[b]:
                    i = len(sources)
                    abort_entry = i
                    try:
                        t = next(it)
                    except StopIteration:
                        raise ValueError(f"refit v{version}: got {i} tensors, the plan has {len(plan)} "
                                         f"(first missing: {plan.entries[i].name!r})") from None
                    plan.check_tensor(i, t)
                    sources.append(byte_view(t, argname=plan.entries[i].name))
                if b == plan.num_buckets - 1:
                    extra = next(it, None)
                    if extra is not None:
                        abort_entry = -1
                        raise ValueError(f"refit v{version}: more tensors than the {len(plan)} of the plan")
                t2 = time.perf_counter()
                if handles[slot] is not None:
                    handles[slot].wait()
                    handles[slot] = None
                t3 = time.perf_counter()
                size = plan.bucket_size(b)
                payload = wire[HEADER_BYTES:HEADER_BYTES + size]
                pack_bucket(layout, b, sources, payload)
                t4 = time.perf_counter()
                crc = checksum(payload) if self.use_checksum else 0
                write_header(wire, version, b, crc)
                t5 = time.perf_counter()
                if self._corrupt is not None:
                    self._corrupt(b, wire)
                handles[slot] = self.transport.broadcast(wire[:HEADER_BYTES + size], async_op=True)
                # release finished sources (a generator's tensors can be freed as soon as they are packed)
                bucket_end = b * plan.bucket_bytes + size
                for i in range(len(sources)):
                    if sources[i] is not None and plan.entries[i].offset + plan.entries[i].nbytes <= bucket_end:
                        sources[i] = None
                t_produce += t2 - t1
                t_wait += t3 - t2
                t_pack += t4 - t3
                t_crc += t5 - t4
            t6 = time.perf_counter()
            for h in handles:
                if h is not None:
                    h.wait()
            t_wait += time.perf_counter() - t6
        except (ValueError, TypeError, StopIteration) as exc:
            error = exc
        if error is not None:
            self._abort(b, handles, abort_entry)
            raise error
        seconds = time.perf_counter() - t0
        return {"version": version, "bytes": plan.total_bytes,
                "wire_bytes": sum(layout.wire_sizes), "buckets": plan.num_buckets, "seconds": seconds,
                "produce_s": t_produce, "pack_s": t_pack, "checksum_s": t_crc, "wait_s": t_wait,
                "gbps": plan.total_bytes / seconds / 1e9 if seconds > 0 else 0.0}

    def _abort(self, first: int, handles: list, entry: int) -> None:
        """Send buckets ``first..`` with an abort header so receivers drain the same number of bytes."""
        for h in handles:
            if h is not None:
                h.wait()
        wire = self._wire[0]
        for b in range(first, self.plan.num_buckets):
            write_header(wire, self.version, b, 0, STATUS_ABORT, entry)
            self.transport.broadcast(wire[:self.layout.wire_sizes[b]])
