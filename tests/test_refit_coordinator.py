"""The coordinators (RefitSender / RefitReceiver) in one process: what a caller can get wrong or change
between refits, and what every rank then sees (found by trying to break the coordinator split)."""

from __future__ import annotations

import hashlib
import re
import threading

import pytest
import torch

from mxport.refit import InProcessChannel, RefitError, RefitPlan, RefitReceiver, RefitSender, Transport

ITEMS = [("w.weight", "values", torch.float8_e4m3fn, (8, 32)),
         ("w.weight_scale", "scales", torch.uint8, (8, 1)), ("norm.weight", "kept", torch.float32, (40,))]


def _tensors(v: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return [torch.randn(8, 32, generator=g).to(torch.float8_e4m3fn),
            torch.randint(0, 256, (8, 1), generator=g, dtype=torch.uint8), torch.randn(40, generator=g)]


class _Reversed(Transport):
    """An in-process endpoint with its ranks reversed: the sender (inner rank 0) is the last rank."""

    def __init__(self, inner):
        self.inner, self.world_size = inner, inner.world_size
        self.rank = self.world_size - 1 - inner.rank
        self.src = self.world_size - 1

    def all_gather(self, t):
        return self.inner.all_gather(t)[::-1]

    def broadcast(self, buf, async_op=False):
        return self.inner.broadcast(buf, async_op)


def _refit(sender, receivers, tensors) -> tuple:
    outs: list = [None] * len(receivers)

    def rx(i):
        try:
            outs[i] = receivers[i].receive()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outs[i] = exc

    threads = [threading.Thread(target=rx, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    try:
        sent = sender.send(tensors)
    except Exception as exc:  # noqa: BLE001
        sent = exc
    for t in threads:
        t.join(timeout=30)
    return sent, outs


def test_a_transport_reassigned_to_a_group_where_the_sender_has_another_rank():
    """After a failure the group is re-created and the transports reassigned; in the new group the sender is
    rank 2, not 0. The vote is read with the new sender (it kept the old one: the sender's results listed
    itself as a receiver, and a smaller group raised IndexError)."""
    plan = RefitPlan(ITEMS)
    ch = InProcessChannel(2, timeout_s=10)
    sender = RefitSender(ch.endpoint(0), plan, bucket_bytes=128)
    targets = [[torch.zeros(s, dtype=d) for _, _, d, s in ITEMS] for _ in range(2)]
    receivers = [RefitReceiver(ch.endpoint(i + 1), plan, targets[i], bucket_bytes=128) for i in range(2)]
    assert _refit(sender, receivers, _tensors(1))[0].version == 1
    ch2 = InProcessChannel(2, timeout_s=10)
    sender.transport = _Reversed(ch2.endpoint(0))
    for i, r in enumerate(receivers):
        r.transport = _Reversed(ch2.endpoint(i + 1))
    sent, outs = _refit(sender, receivers, _tensors(2))
    assert [(r.rank, r.status.name, r.version) for r in sent.receivers] == [(0, "OK", 2), (1, "OK", 2)]
    assert [o.version for o in outs] == [2, 2]
    assert all(torch.equal(t[2], _tensors(2)[2]) for t in targets)
    ch3 = InProcessChannel(1, timeout_s=10)  # receiver 0 lost: a smaller group, the sender rank 0 again
    sender.transport, receivers[1].transport = ch3.endpoint(0), ch3.endpoint(1)
    sent, outs = _refit(sender, receivers[1:], _tensors(3))
    assert sent.version == 3 and outs[0].version == 3


def _no_pairs(**kw):
    ch = InProcessChannel(1, timeout_s=10)
    digest = hashlib.sha256(b"coordinator without pairs").hexdigest()
    return (RefitSender.for_pairs(ch.endpoint(0), [], global_digest=digest, trainers=[0], **kw),
            RefitReceiver.for_pairs(ch.endpoint(1), [], global_digest=digest, trainers=[0]))


@pytest.mark.parametrize("streams, error", [
    ({1: []}, r"ValueError: streams for engine ranks \[1\], which have no pair with trainer rank 0"),
    ([], r"TypeError: a sharded refit sends \{engine rank: tensors\}"),
])
def test_a_bad_streams_argument_is_refused_through_the_vote(streams, error):
    """A stream for an engine rank the trainer has no pair with was accepted silently (the engines committed);
    the one-rank list form given to a sharded sender raised before the vote and left the engines waiting
    in it until the group timed out. Both now abort the refit: the trainer raises, every engine rank is told
    in the vote and keeps its weights."""
    sender, receiver = _no_pairs()
    live = receiver.version  # versions continue per plan in a process (mxport.refit.world.last_version)
    sent, (got,) = _refit(sender, [receiver], streams)
    assert isinstance(sent, (ValueError, TypeError)) and re.search(error, f"{type(sent).__name__}: {sent}")
    assert isinstance(got, RefitError) and "rejected by trainer rank 0: aborted" in str(got)
    assert receiver.version == live
    assert _refit(sender, [receiver], {})[1][0].version > live  # the next refit lands


def test_attributes_of_one_stream_on_a_sharded_coordinator_say_why_not():
    sender, receiver = _no_pairs()
    with pytest.raises(AttributeError, match="several streams"):
        receiver.direct  # noqa: B018
    with pytest.raises(AttributeError, match="several streams"):
        sender.plan  # noqa: B018
    assert receiver.verify_live() is False  # nothing received: nothing verified
