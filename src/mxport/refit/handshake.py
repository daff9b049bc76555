"""The plan handshake: before any payload moves, every endpoint shares its plan digest (and refit version); on a
mismatch every endpoint shares its canonical plan and raises :class:`RefitPlanMismatch` with the first differences."""

from __future__ import annotations

from .plan import RefitPlan, RefitPlanMismatch, diff_canonical
from .transport import Transport


def exchange_plans(transport: Transport, plan: RefitPlan, version: int = 0) -> int:
    """Compare ``plan`` with every other endpoint's; return the highest refit version among them.

    Raises:
        RefitPlanMismatch: on every endpoint when any receiver's digest differs from the sender's. The sender lists
            its differences with each mismatching receiver; a receiver lists its own differences with the sender's
            plan (or, if it agrees with the sender, names the receivers that do not).
    """
    gathered = transport.all_gather_object((plan.digest, int(version)))
    digests = [d for d, _ in gathered]
    top_version = max(v for _, v in gathered)
    src = transport.src
    if all(d == digests[src] for d in digests):
        return top_version
    canon = transport.all_gather_object(plan.canonical())
    me = transport.rank
    if transport.is_sender:
        diffs = []
        for r, d in enumerate(digests):
            if r != src and d != plan.digest:
                diffs += [f"receiver {r}: {x}" for x in diff_canonical(plan.canonical(), canon[r])]
    elif digests[me] != digests[src]:
        diffs = diff_canonical(plan.canonical(), canon[src])
    else:
        bad = [r for r, d in enumerate(digests) if d != digests[src]]
        diffs = [f"receiver(s) {bad} disagree with the sender's plan"]
    raise RefitPlanMismatch(diffs or ["digests differ"], local_digest=plan.digest, remote_digest=digests[src])
