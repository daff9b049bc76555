"""The stream handshake: before any payload, every endpoint of a stream shares its plan digest, version and
bucket size; on a mismatch every endpoint raises :class:`RefitPlanMismatch` with the first differences. Only
fixed-size tensors cross the wire, nothing is unpickled:

1. ``all_gather`` of one int64 word, :data:`HELLO`; a peer that sends anything else does not speak this
   protocol: :class:`RefitError`, nothing more read from it.
2. ``all_gather`` of int64 ``[digest words 0..3, version, bucket_bytes, delta]`` (``delta``: this endpoint
   takes delta refits; the stream runs them when every endpoint does).
3. On a digest mismatch only: ``all_gather`` of each canonical plan's JSON length, then of the JSON bytes
   (zero-padded to the longest; at most :data:`MAX_PLAN_JSON`), rebuilt with
   :meth:`RefitPlan.from_canonical` to name the differences."""

from __future__ import annotations

import json
from typing import NamedTuple

import torch

from .plan import RefitPlan, RefitPlanMismatch, diff_canonical
from .results import RefitError
from .transport import Transport

#: "MXRFTHS" and the handshake protocol's version (3: the digest row carries the bucket size and the delta
#: word; an older row is shorter: a peer of another version is refused here, before rows of two sizes meet in
#: one all_gather)
HELLO = 0x4D58524654485303
#: the longest canonical plan JSON an endpoint accepts from a peer
MAX_PLAN_JSON = 64 << 20


def _hello(transport: Transport) -> None:
    words = [int(w) for w in transport.all_gather(torch.tensor([HELLO], dtype=torch.int64))]
    strangers = [r for r, w in enumerate(words) if w != HELLO]
    if strangers:
        r = strangers[0]
        raise RefitError(f"rank {r} does not speak the mxport refit handshake (it sent {words[r]:#x}, "
                         f"expected {HELLO:#x}: another program or another mxport version on this process "
                         f"group?); nothing more was read from it; re-create the transport")


class Agreement(NamedTuple):
    """What a stream's endpoints agreed: the highest version any of them knows, and whether every one takes
    delta refits."""

    version: int
    delta: bool


def exchange_plans(transport: Transport, plan: RefitPlan, version: int, bucket_bytes: int, *,
                   delta: bool = False) -> Agreement:
    """Compare ``plan`` and ``bucket_bytes`` with every other endpoint's; return the :class:`Agreement`.

    Raises:
        RefitError: a peer that does not speak this handshake, or reports a negative version.
        RefitPlanMismatch: on every endpoint when a receiver's digest or bucket size differs from the
            sender's, listing the differences each side sees.
    """
    _hello(transport)
    digest = torch.frombuffer(bytearray(bytes.fromhex(plan.digest)), dtype=torch.int64)
    mine = torch.cat([digest, torch.tensor([int(version), int(bucket_bytes), int(bool(delta))],
                                           dtype=torch.int64)])
    rows = transport.all_gather(mine)
    digests = [row[:4].numpy().tobytes().hex() for row in rows]
    versions = [int(row[4]) for row in rows]
    if min(versions) < 0:
        raise RefitError(f"rank {versions.index(min(versions))} reported a negative refit version; re-create "
                         f"the transport")
    src = transport.src
    if all(d == digests[src] for d in digests):
        _check_buckets(transport, [int(row[5]) for row in rows], plan.digest)
        return Agreement(max(versions), all(int(row[6]) == 1 for row in rows))
    remote = _exchange_canonical(transport, plan)
    if transport.is_sender:
        diffs = []
        for r, d in enumerate(digests):
            if r != src and d != plan.digest:
                diffs += [f"{_receiver(transport, r)}: {x}" for x in _diff(plan, remote[r])]
    elif digests[transport.rank] != digests[src]:
        diffs = _diff(plan, remote[src])
    else:
        bad = [r for r, d in enumerate(digests) if d != digests[src]]
        diffs = [f"receiver(s) {_world_ranks(transport, bad)} disagree with the sender's plan"]
    raise RefitPlanMismatch(diffs or ["digests differ"], local_digest=plan.digest, remote_digest=digests[src])


def _check_buckets(transport: Transport, sizes: list[int], digest: str) -> None:
    """RefitPlanMismatch on every endpoint unless every endpoint cuts the stream into the same buckets."""
    src, me = transport.src, transport.rank
    bad = [r for r, n in enumerate(sizes) if n != sizes[src]]
    if not bad:
        return
    if transport.is_sender:
        diffs = [f"{_receiver(transport, r)}: bucket_bytes: local {sizes[src]} vs remote {sizes[r]}"
                 for r in bad]
    elif me in bad:
        diffs = [f"bucket_bytes: local {sizes[me]} vs remote {sizes[src]}"]
    else:
        diffs = [f"receiver(s) {_world_ranks(transport, bad)} cut the stream into other buckets than the "
                 "sender"]
    raise RefitPlanMismatch(diffs, local_digest=digest, remote_digest=digest)


def _world_ranks(transport: Transport, ranks: list[int]) -> list[int]:
    """``ranks`` of ``transport`` as world ranks (a stream of a larger world), else as they are."""
    world = getattr(transport, "ranks", None)
    return ranks if world is None else [world[r] for r in ranks]


def _receiver(transport: Transport, r: int) -> str:
    """``receiver 2``, or on a stream of a larger world ``receiver 2 (world rank 5)``."""
    world = getattr(transport, "ranks", None)
    return f"receiver {r}" if world is None else f"receiver {r} (world rank {world[r]})"


def _diff(plan: RefitPlan, remote: RefitPlan | str) -> list[str]:
    if isinstance(remote, str):
        return [remote]
    return diff_canonical(plan.canonical(), remote.canonical())


def _exchange_canonical(transport: Transport, plan: RefitPlan) -> list[RefitPlan | str]:
    """Every endpoint's plan rebuilt from its canonical JSON, or a string saying why it could not be."""
    text = json.dumps(plan.canonical(), sort_keys=True, separators=(",", ":")).encode()
    lengths = [int(n) for n in transport.all_gather(torch.tensor([len(text)], dtype=torch.int64))]
    longest = max(lengths)
    if min(lengths) < 0 or longest > MAX_PLAN_JSON:
        raise RefitPlanMismatch([f"a plan too large to compare ({longest} bytes of JSON, at most "
                                 f"{MAX_PLAN_JSON})"])
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    out: list[RefitPlan | str] = []
    for r, got in enumerate(transport.all_gather(buf)):
        try:
            out.append(RefitPlan.from_canonical(json.loads(got[:lengths[r]].numpy().tobytes())))
        except (ValueError, TypeError, RecursionError) as exc:
            out.append(f"rank {r} sent a plan that is not valid: {exc}")
    return out


def share_plan(transport: Transport, plan: RefitPlan | None = None) -> RefitPlan:
    """The sender's plan on every endpoint, for a receiver with no model to derive one from: the sender
    broadcasts its canonical JSON (an int64 length, then the bytes); ValueError beyond :data:`MAX_PLAN_JSON`
    bytes or for an invalid plan."""
    if transport.is_sender:
        if not isinstance(plan, RefitPlan):
            raise TypeError(f"the sender must pass its RefitPlan, got {type(plan).__name__}")
        text = json.dumps(plan.canonical(), sort_keys=True, separators=(",", ":")).encode()
        transport.broadcast(torch.tensor([len(text)], dtype=torch.int64, device=transport.device))
        transport.broadcast(torch.frombuffer(bytearray(text), dtype=torch.uint8).to(transport.device))
        return plan
    n = torch.zeros(1, dtype=torch.int64, device=transport.device)
    transport.broadcast(n)
    if not 0 < int(n) <= MAX_PLAN_JSON:
        raise ValueError(f"the sender's plan is {int(n)} bytes of JSON (at most {MAX_PLAN_JSON}); re-create "
                         f"the transport")
    buf = torch.zeros(int(n), dtype=torch.uint8, device=transport.device)
    transport.broadcast(buf)
    return RefitPlan.from_canonical(json.loads(buf.cpu().numpy().tobytes()))
