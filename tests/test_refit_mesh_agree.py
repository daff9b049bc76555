"""Issue 23: a rank that fails before the sharded plan is agreed (its source raises, a malformed holding)
gives every rank a RefitError naming it and why, at once; the replicated boxes of a plan (find_replicas)."""

from __future__ import annotations

import threading

import pytest

from mxport.refit import InProcessChannel, MeshPlan, RefitError, RefitPlanMismatch
from mxport.refit.mesh import Box, Holding, TensorInfo, agree


def info(name, shape, role="kept", dtype="bfloat16"):
    return TensorInfo(name, role, dtype, tuple(shape))


def _agree_all(holdings: list, trainers: int = 1, timeout_s: float = 10) -> list:
    """``agree`` on every rank (threads over one InProcessChannel): each rank's MeshPlan or exception, and
    the seconds each took."""
    import time

    ch = InProcessChannel(receivers=len(holdings) - 1, timeout_s=timeout_s)
    out: list = [None] * len(holdings)

    def go(r):
        t0 = time.perf_counter()
        try:
            out[r] = agree(ch.endpoint(r), trainers, holdings[r])
        except Exception as exc:  # noqa: BLE001
            out[r] = exc
        out[r].seconds = time.perf_counter() - t0
    ths = [threading.Thread(target=go, args=(r,)) for r in range(len(holdings))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(3 * timeout_s)
    return out


W = info("w", (8, 64))
WHOLE = [Holding(W, Box.full(W.shape))]


def _source_that_raises():
    raise RuntimeError("the DTensor source broke while listing its shards")


def test_a_rank_whose_source_raises_before_agree_is_named_on_every_rank():
    """Rank 1's holdings come from a callable that raises, rank 2 failed earlier and passes its exception:
    every rank raises a RefitError (also a RefitPlanMismatch) naming both ranks and their reasons, well
    before the group's timeout."""
    out = _agree_all([WHOLE, _source_that_raises, ValueError("engine rank 2 has no weights loaded"), WHOLE],
                     trainers=2, timeout_s=20)
    for r, x in enumerate(out):
        assert isinstance(x, RefitError) and isinstance(x, RefitPlanMismatch), (r, x)
        msg = str(x)
        assert "rank 1 could not describe its holdings: RuntimeError: the DTensor source broke" in msg, msg
        assert "rank 2 could not describe its holdings: ValueError: engine rank 2 has no weights" in msg
        assert x.seconds < 5, x.seconds
    assert isinstance(out[1].__cause__, RuntimeError) and isinstance(out[2].__cause__, ValueError)


def test_a_malformed_holding_is_named_on_every_rank():
    out = _agree_all([WHOLE, [Holding(W, Box.full(W.shape)), "not a holding"]], timeout_s=20)
    for x in out:
        assert isinstance(x, RefitError), x
        assert "rank 1 could not describe its holdings: AttributeError" in str(x), str(x)


def test_a_rank_that_never_comes_is_a_refit_error():
    """A rank that never calls agree: the others raise RefitError (not the transport's bare error) after the
    group's timeout."""
    ch = InProcessChannel(receivers=1, timeout_s=1)
    with pytest.raises(RefitError, match="the sharded plan agreement .* failed"):
        agree(ch.endpoint(0), 1, WHOLE)


def test_replicas_are_every_box_several_trainers_hold():
    from mxport.refit.mesh import find_replicas

    n = info("norm", (64,))
    k = info("k", (4, 96))
    trainers = [
        [Holding(W, Box.along(W.shape, 0, 0, 4)), Holding(n, Box.full(n.shape)),
         Holding(k, Box.along(k.shape, 1, 0, 64))],
        [Holding(W, Box.along(W.shape, 0, 4, 8)), Holding(n, Box.full(n.shape)),
         Holding(k, Box.along(k.shape, 1, 32, 96))],
        [Holding(n, Box.full(n.shape))],
    ]
    engines = [[Holding(W, Box.full(W.shape)), Holding(n, Box.full(n.shape)), Holding(k, Box.full(k.shape))]]
    reps = find_replicas(MeshPlan(trainers, engines))
    got = [(r.tensor.name, str(r.box), r.holders) for r in reps]
    # w: row shards, disjoint -> none; k: two K ranges overlapping in [32, 64); norm: held by all three
    assert got == [("k", "[0:4,32:64]", (0, 1)), ("norm", "[0:64]", (0, 1, 2))]
    assert find_replicas(MeshPlan([trainers[0][:1], trainers[1][:1]], [engines[0][:1]])) == ()
