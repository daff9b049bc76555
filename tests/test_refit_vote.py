"""All or nothing across ranks (the receivers' two-phase commit), in one process: a sender and two receivers
on an :class:`InProcessChannel`, each receiver in its own thread. One receiver's bytes are corrupted (only
its copy, :class:`~mxport.testing.FaultyReceiverTransport`), or one receiver stops mid-refit: no receiver
commits, both keep their previous weights byte for byte, every rank learns who rejected and why, and the
next refit succeeds on both. (Over real gloo processes, a receiver killed mid-refit: test_refit_faults.py.)
"""

from __future__ import annotations

import threading

import pytest
import torch

from mxport.refit import (
    InProcessChannel,
    RefitError,
    RefitPlan,
    RefitReceiver,
    RefitSender,
    Status,
    allocate_targets,
)
from mxport.refit.buckets import BucketLayout, byte_view
from mxport.testing import FaultyReceiverTransport

BUCKET = 128
ITEMS = [("w.weight", "values", torch.float8_e4m3fn, (8, 32)),
         ("w.weight_scale", "scales", torch.uint8, (8, 1)),
         ("norm.weight", "kept", torch.float32, (40,)), ("emb", "kept", torch.bfloat16, (9, 8))]



def _buckets(plan) -> int:
    """How many buckets a stream of ``plan`` cut into ``BUCKET`` bytes has."""
    return BucketLayout(plan, BUCKET).num_buckets


def _plan() -> RefitPlan:
    return RefitPlan(ITEMS)


def _version(v: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    out = []
    for _, _, dtype, shape in ITEMS:
        if dtype == torch.uint8:
            out.append(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))
        else:
            out.append(torch.randn(shape, generator=g).to(dtype))
    return out


def _stream(plan, tensors) -> torch.Tensor:
    """The plan's byte stream of ``tensors`` (padding zero)."""
    out = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    for e, t in zip(plan.entries, tensors, strict=True):
        out[e.offset:e.offset + e.nbytes] = byte_view(t)
    return out


def _targets(plan, direct):
    return allocate_targets(plan) if direct else [torch.zeros(s, dtype=d) for _, _, d, s in ITEMS]


def _run_receivers(receivers, targets, refits):
    """Each receiver receives ``refits`` times in its own thread; after each receive (returned or raised)
    the live tensors' stream is recorded. Returns (outcomes per receiver, live streams per receiver,
    threads)."""
    plan = receivers[0].plan
    outs = [[] for _ in receivers]
    lives = [[] for _ in receivers]

    def rx(i):
        for _ in range(refits):
            try:
                outs[i].append(receivers[i].receive())
            except (RefitError, OSError) as exc:
                outs[i].append(exc)
            lives[i].append(_stream(plan, targets[i]))

    threads = [threading.Thread(target=rx, args=(i,)) for i in range(len(receivers))]
    for th in threads:
        th.start()
    return outs, lives, threads


def _send_all(sender, versions):
    sent = []
    for v in versions:
        try:
            sent.append(sender.send(_version(v)))
        except RefitError as exc:
            sent.append(exc)
    return sent


@pytest.mark.parametrize("direct", [False, True], ids=["staging", "direct"])
def test_one_receivers_corrupt_bytes_make_every_receiver_keep_its_weights(direct):
    """v1 ok; v2: only receiver 2's copy of bucket 1 is corrupted -> neither receiver commits v2 (receiver
    1's bytes stay exactly v1 although its own copy was fine), both raise naming receiver 2's checksum
    failure, the sender raises with both results; v3 ok on both."""
    plan = _plan()
    assert _buckets(plan) >= 3

    def corrupt(refit, bucket, buf):
        if refit == 2 and bucket == 1:
            buf[5] ^= 0x40  # lands in staging, or in the live arena (direct mode)

    ch = InProcessChannel(2, timeout_s=30)
    targets = [_targets(plan, direct), _targets(plan, direct)]
    eps = [ch.endpoint(1), FaultyReceiverTransport(ch.endpoint(2), _buckets(plan), corrupt)]
    receivers = [RefitReceiver(ep, plan, t, bucket_bytes=BUCKET) for ep, t in zip(eps, targets, strict=True)]
    assert [r.direct for r in receivers] == [direct, direct]
    ptrs = [r.pointers() for r in receivers]
    outs, lives, threads = _run_receivers(receivers, targets, 3)
    sent = _send_all(RefitSender(ch.endpoint(0), plan, bucket_bytes=BUCKET), [1, 2, 3])
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)

    v1, v3 = _stream(plan, _version(1)), _stream(plan, _version(3))
    for i in range(2):
        assert outs[i][0]["version"] == 1 and torch.equal(lives[i][0], v1)
        assert torch.equal(lives[i][1], v1)  # v2 committed by none: exactly the previous bytes
        assert outs[i][2]["version"] == 3 and torch.equal(lives[i][2], v3)
        assert receivers[i].pointers() == ptrs[i] and receivers[i].version == 3
    results = [{"rank": 1, "status": "peer_rejected", "bucket": -1, "entry": -1, "version": 1},
               {"rank": 2, "status": "checksum", "bucket": 1, "entry": -1, "version": 1}]
    healthy, corrupted = outs[0][1], outs[1][1]
    assert isinstance(healthy, RefitError) and healthy.status == Status.PEER_REJECTED
    assert healthy.kept_version == 1 and [r.to_dict() for r in healthy.receivers] == results
    assert "refit v2 not committed" in str(healthy)
    assert "rejected by receiver 2: checksum at bucket 1 (live version 1) (tensors: " in str(healthy)
    assert "live weights kept at version 1" in str(healthy)
    assert isinstance(corrupted, RefitError) and corrupted.status == Status.CHECKSUM
    assert corrupted.bucket == 1 and corrupted.kept_version == 1 and "checksum mismatch" in str(corrupted)
    assert [r.to_dict() for r in corrupted.receivers] == results
    if direct:
        assert "restored from the rollback copy" in str(healthy) and "restored" in str(corrupted)
    assert sent[0]["version"] == 1 and isinstance(sent[1], RefitError)
    assert "refit v2 was rejected by 1 of 2 receiver(s): receiver 2: checksum at bucket 1" in str(sent[1])
    assert sent[1].status == Status.CHECKSUM and [r.to_dict() for r in sent[1].receivers] == results
    assert [r["status"] for r in sent[2]["receivers"]] == ["ok", "ok"]
    assert [r["version"] for r in sent[2]["receivers"]] == [3, 3]


@pytest.mark.parametrize("direct", [False, True], ids=["staging", "direct"])
def test_both_receivers_rejecting_name_each_other(direct):
    """Both receivers' copies corrupted (different buckets): each raises its own checksum failure and names
    the other's; the sender counts 2 of 2."""
    plan = _plan()

    def corrupt_at(b):
        return lambda refit, bucket, buf: buf.__setitem__(0, buf[0] ^ 1) if bucket == b else None

    ch = InProcessChannel(2, timeout_s=30)
    targets = [_targets(plan, direct), _targets(plan, direct)]
    eps = [FaultyReceiverTransport(ch.endpoint(1), _buckets(plan), corrupt_at(0)),
           FaultyReceiverTransport(ch.endpoint(2), _buckets(plan), corrupt_at(2))]
    receivers = [RefitReceiver(ep, plan, t, bucket_bytes=BUCKET) for ep, t in zip(eps, targets, strict=True)]
    outs, lives, threads = _run_receivers(receivers, targets, 1)
    sent = _send_all(RefitSender(ch.endpoint(0), plan, bucket_bytes=BUCKET), [1])
    for th in threads:
        th.join(timeout=60)
    zero = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    assert all(torch.equal(lives[i][0], zero) for i in range(2))
    assert outs[0][0].bucket == 0 and "also rejected by receiver 2: checksum at bucket 2" in str(outs[0][0])
    assert outs[1][0].bucket == 2 and "also rejected by receiver 1: checksum at bucket 0" in str(outs[1][0])
    assert "rejected by 2 of 2 receiver(s)" in str(sent[0])
    assert [r.status for r in sent[0].receivers] == [Status.CHECKSUM, Status.CHECKSUM]


@pytest.mark.parametrize("direct", [False, True], ids=["staging", "direct"])
def test_a_receiver_that_stops_mid_refit_breaks_the_vote_and_nobody_commits(direct):
    """Receiver 2 stops after bucket 0 of v2 (its transport fails: it never votes). Receiver 1 receives and
    validates all of v2, but the vote cannot complete: it keeps v1 byte for byte and raises; the sender
    raises. A next refit over a new channel succeeds on both."""
    plan = _plan()

    def die(refit, bucket, buf):
        if refit == 2 and bucket == 0:
            raise ConnectionResetError("receiver 2 is gone")

    ch = InProcessChannel(2, timeout_s=2)
    targets = [_targets(plan, direct), _targets(plan, direct)]
    eps = [ch.endpoint(1), FaultyReceiverTransport(ch.endpoint(2), _buckets(plan), die)]
    receivers = [RefitReceiver(ep, plan, t, bucket_bytes=BUCKET) for ep, t in zip(eps, targets, strict=True)]
    outs, lives, threads = _run_receivers(receivers, targets, 2)
    sender = RefitSender(ch.endpoint(0), plan, bucket_bytes=BUCKET)
    sent = _send_all(sender, [1, 2])
    for th in threads:
        th.join(timeout=60)
    v1 = _stream(plan, _version(1))
    assert outs[0][0]["version"] == 1 and outs[1][0]["version"] == 1
    assert torch.equal(lives[0][1], v1) and torch.equal(lives[1][1], v1)  # the survivor did not commit v2
    survivor = outs[0][1]
    assert isinstance(survivor, RefitError) and survivor.kept_version == 1 and survivor.receivers == []
    assert "refit not committed" in str(survivor) and "the vote failed (BrokenBarrierError" in str(survivor)
    assert isinstance(outs[1][1], RefitError)
    assert "ConnectionResetError: receiver 2 is gone" in str(outs[1][1])
    assert isinstance(sent[1], RefitError) and "the transport failed during the vote" in str(sent[1])
    assert receivers[0].version == 1 and receivers[1].version == 1

    ch2 = InProcessChannel(2, timeout_s=30)  # the broken group is re-created
    for i, r in enumerate(receivers):
        r.transport = ch2.endpoint(i + 1)
    sender.transport = ch2.endpoint(0)
    got = [None, None]

    def again(i):
        receivers[i].handshake()
        got[i] = receivers[i].receive()

    threads = [threading.Thread(target=again, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    sender.handshake()
    stats = sender.send(_version(3))
    for th in threads:
        th.join(timeout=60)
    assert [r["status"] for r in stats["receivers"]] == ["ok", "ok"] and stats["version"] == 3
    v3 = _stream(plan, _version(3))
    assert [g["version"] for g in got] == [3, 3]
    assert all(torch.equal(_stream(plan, t), v3) for t in targets)


def test_a_sender_abort_is_every_receivers_own_reason_and_the_next_refit_succeeds():
    """The sender aborts v2 (a wrong dtype): both receivers reject it for that reason alone (no "also
    rejected by" for the same abort), keep v1, and v3 succeeds on both."""
    plan = _plan()
    ch = InProcessChannel(2, timeout_s=30)
    targets = [_targets(plan, False), _targets(plan, True)]
    receivers = [RefitReceiver(ch.endpoint(i + 1), plan, t, bucket_bytes=BUCKET)
                 for i, t in enumerate(targets)]
    outs, lives, threads = _run_receivers(receivers, targets, 3)
    sender = RefitSender(ch.endpoint(0), plan, bucket_bytes=BUCKET)
    bad = _version(2)
    bad[2] = bad[2].to(torch.float16)
    sent = [sender.send(_version(1))]
    with pytest.raises(ValueError, match="'norm.weight'"):
        sender.send(bad)
    sent.append(sender.send(_version(3)))
    for th in threads:
        th.join(timeout=60)
    v1 = _stream(plan, _version(1))
    for i in range(2):
        err = outs[i][1]
        assert isinstance(err, RefitError) and err.status == Status.ABORTED and torch.equal(lives[i][1], v1)
        assert "the sender aborted refit v2 at tensor 'norm.weight'" in str(err) and "also" not in str(err)
        assert [r.status for r in err.receivers] == [Status.ABORTED, Status.ABORTED]
        assert outs[i][2]["version"] == 3
    assert [r["status"] for r in sent[1]["receivers"]] == ["ok", "ok"]
