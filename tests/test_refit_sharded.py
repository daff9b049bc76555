"""Sharded refit (issue 14): T = 2 trainer ranks (world ranks 0, 1) and E = 2 engine ranks (2, 3) in one gloo
group on loopback, real processes; each (trainer, engine) pair with its own small hand-made plan (float8,
uint8 scales, bfloat16; several buckets) and deterministic content per step; one world vote per refit.

- pair_order: every pair once, rounds are matchings (perfect when T == E), and ranks following it never wait
  in a cycle (a simulator that does find the cycle of a bad order);
- one run of four processes: a global-digest mismatch raises on every rank; three refits land exactly; one
  engine's copy of one pair's bucket corrupted -> no engine rank commits any pair (the other engine too),
  every trainer names the rejecting rank, the next refit succeeds; a trainer's producer fails -> nobody
  commits, the next refit succeeds;
- an engine rank killed in the middle of its stage: the surviving engine keeps its bytes and raises, the
  trainers raise; a new group with the killed rank restarted refits.
"""

from __future__ import annotations

import hashlib
import os
import queue
import random
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from mxport.refit import RefitPlan
from mxport.refit.buckets import BucketLayout
from mxport.refit.world import pair_order

TRAINERS, ENGINES = (0, 1), (2, 3)
WORLD = len(TRAINERS) + len(ENGINES)
BUCKET = 64
PG_TIMEOUT_S = 10.0
WAIT_S = 120.0


# ---- pair_order --------------------------------------------------------------------------------------------

def _buckets(plan) -> int:
    """How many buckets a stream of ``plan`` cut into ``BUCKET`` bytes has."""
    return BucketLayout(plan, BUCKET).num_buckets


def _rounds(trainers, engines):
    """pair_order cut into rounds (round = (e_index - t_index) mod max(T, E))."""
    m = max(len(trainers), len(engines))
    out: dict[int, list] = {}
    for t, e in pair_order(trainers, engines):
        out.setdefault((engines.index(e) - trainers.index(t)) % m, []).append((t, e))
    return out


def _per_rank(order, pairs) -> dict[int, list]:
    """Each rank's pairs of ``pairs``, in ``order``."""
    return {r: [p for p in order if p in pairs and r in p] for p in pairs for r in p}


def _runs_without_deadlock(todo: dict[int, list]) -> bool:
    """Each rank handles its pairs ``todo[rank]`` in turn; a pair runs when it is the next pair of both its
    ends. True when every pair runs."""
    todo = {r: list(ps) for r, ps in todo.items()}
    left = {p for ps in todo.values() for p in ps}
    while left:
        ready = [p for p in left if todo[p[0]][0] == p and todo[p[1]][0] == p]
        if not ready:
            return False
        for p in ready:
            left.discard(p)
            todo[p[0]].pop(0)
            todo[p[1]].pop(0)
    return True


@pytest.mark.parametrize(("T", "E"), [(1, 1), (2, 2), (3, 3), (4, 4), (1, 3), (2, 3), (2, 5), (3, 2), (4, 1),
                                      (5, 2)])
def test_pair_order_covers_every_pair_once_in_rounds_that_are_matchings(T, E):
    trainers, engines = list(range(T)), list(range(T, T + E))
    order = pair_order(trainers, engines)
    assert sorted(order) == sorted((t, e) for t in trainers for e in engines)  # every pair exactly once
    rounds = _rounds(trainers, engines)
    flat = [p for r in sorted(rounds) for p in rounds[r]]
    assert flat == order  # sorted by round first
    for pairs in rounds.values():
        assert len({t for t, _ in pairs}) == len(pairs) == len({e for _, e in pairs})  # a matching
        if T == E:
            assert len(pairs) == T  # a perfect matching: every rank busy in every round
    assert len(rounds) == max(T, E)
    rng = random.Random(T * 10 + E)
    for _ in range(20):  # any subset of pairs (the ones with bytes), each rank in this order: no cycle
        subset = {p for p in order if rng.random() < 0.6}
        assert _runs_without_deadlock(_per_rank(order, subset))


def test_pair_order_examples_and_bad_input():
    assert pair_order([0, 1], [2, 3]) == [(0, 2), (1, 3), (0, 3), (1, 2)]
    assert pair_order([0, 1, 2], [3, 4]) == [(0, 3), (1, 4), (0, 4), (2, 3), (1, 3), (2, 4)]
    assert pair_order([5], [1, 0]) == [(5, 1), (5, 0)]  # ranks are labels; the order follows the sequences
    for bad in [([], [1]), ([0], []), ([0, 1], [1, 2]), ([0, 0], [1]), ([-1], [2])]:
        with pytest.raises(ValueError):
            pair_order(*bad)


def test_the_deadlock_simulator_finds_a_cycle():
    """The check above can fail: ranks taking their pairs in other orders wait in a cycle (trainer 0 on engine
    2, which waits on trainer 1, which waits on engine 3, which waits on trainer 0)."""
    bad = {0: [(0, 2), (0, 3)], 1: [(1, 3), (1, 2)], 2: [(1, 2), (0, 2)], 3: [(0, 3), (1, 3)]}
    assert not _runs_without_deadlock(bad)
    order = pair_order([0, 1], [2, 3])
    assert _runs_without_deadlock(_per_rank(order, set(order)))


# ---- a transport failing while the trailer is on the wire -------------------------------------------------
class _FailingWait:
    def wait(self, timeout=None):  # noqa: ARG002
        raise RuntimeError("Connection reset by peer")


class _TrailerWaitFails:
    """A sender endpoint whose broadcasts all post; waiting for the trailer's fails (gloo: the peer died)."""

    rank, world_size, src, is_sender, device = 0, 2, 0, True, torch.device("cpu")

    def __init__(self, buckets: int):
        self.buckets, self.posted = buckets, 0

    def broadcast(self, buf, async_op=False):  # noqa: ARG002
        self.posted += 1
        if self.posted == self.buckets + 1:
            return _FailingWait()
        return _DoneWait()

    def all_gather(self, t):
        raise AssertionError("no vote after a failed trailer")


class _DoneWait:
    def wait(self, timeout=None):  # noqa: ARG002
        return True


def test_a_transport_failing_on_the_trailer_raises_refit_error():
    """A peer dying while the trailer is on the wire (its handle's wait raises, as gloo's does) is a
    RefitError saying the transport failed, not gloo's bare RuntimeError (found by the kill test below)."""
    from mxport.refit import RefitError, RefitSender

    plan = pair_plan(0, 2)
    sender = RefitSender(_TrailerWaitFails(_buckets(plan)), plan, bucket_bytes=BUCKET)
    sender._handshaken = True
    with pytest.raises(RefitError, match=r"v1 failed: the transport failed \(RuntimeError: Connection reset"):
        sender.send(payload(1, 0, 2))


# ---- the pairs' plans and content --------------------------------------------------------------------------
def pair_items(t: int, e: int) -> list:
    k = 32 * (2 + t + e % 2)  # every pair its own shapes
    return [(f"t{t}.w.weight", "values", torch.float8_e4m3fn, (3, k)),
            (f"t{t}.w.weight_scale", "scales", torch.uint8, (3, k // 32)),
            (f"t{t}.e{e}.norm", "kept", torch.bfloat16, (20 + 4 * e,))]


def pair_plan(t: int, e: int) -> RefitPlan:
    return RefitPlan(pair_items(t, e))


def global_digest() -> str:
    text = ";".join(f"{t},{e},{pair_plan(t, e).digest}" for t, e in pair_order(TRAINERS, ENGINES))
    return hashlib.sha256(text.encode()).hexdigest()


def payload(step: int, t: int, e: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * t + e)
    out = []
    for _, _, dtype, shape in pair_items(t, e):
        if dtype == torch.uint8:
            out.append(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))
        else:
            out.append(torch.randn(shape, generator=g).to(dtype))
    return out


def _bytes(tensors) -> torch.Tensor:
    from mxport.refit.buckets import byte_view

    return torch.cat([byte_view(t).clone() for t in tensors])


def _live_step(targets, t, e, steps) -> int | None:
    """The step whose payload the live ``targets`` hold exactly (0: still the initial zeros), or None."""
    live = _bytes(targets)
    if not live.any():
        return 0
    return next((s for s in steps if torch.equal(live, _bytes(payload(s, t, e)))), None)


def _my_pairs(rank: int) -> list[tuple[int, int]]:
    return [p for p in pair_order(TRAINERS, ENGINES) if rank in p]


def _world(rank: int, port: int, timeout_s: float = PG_TIMEOUT_S):
    from mxport.refit import TorchDistTransport
    from mxport.refit.transport import open_group

    torch.set_num_threads(1)
    return TorchDistTransport.from_group(open_group("127.0.0.1", port, rank, WORLD, timeout_s=timeout_s))


def _outcome(fn) -> dict:
    """``fn()``'s stats as a dict, or the error it raised (type, message, the results it carries)."""
    from mxport.refit import RefitError

    t0 = time.perf_counter()
    try:
        return {"ok": fn().to_dict()}
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        out = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0,
               "where": traceback.format_exc()}
        if isinstance(exc, RefitError):
            out["status"] = None if exc.status is None else exc.status.name.lower()
            out["receivers"] = [r.to_dict() for r in exc.receivers]
        return out


# ---- process bodies: refits, a corrupt copy, a trainer abort -----------------------------------------------
CORRUPT_STEP, ABORT_STEP, STEPS = 4, 6, range(1, 8)


def _producer(step: int, t: int, e: int, log: list):
    """Step ABORT_STEP: trainer 1's stream to engine 3 (its first pair) fails after one tensor."""
    log.append((t, e))
    for i, x in enumerate(payload(step, t, e)):
        if step == ABORT_STEP and (t, e) == (1, 3) and i == 1:
            raise RuntimeError("the quantizer failed")
        yield x


def _trainer(rank: int, port: int) -> dict:
    from mxport.refit import RefitPlanMismatch, RefitSender

    world = _world(rank, port)
    pairs = [(e, pair_plan(t, e)) for t, e in _my_pairs(rank)]
    out: dict = {}
    try:
        RefitSender.for_pairs(world, pairs, global_digest=global_digest(), trainers=TRAINERS,
                              bucket_bytes=BUCKET).handshake()
    except RefitPlanMismatch as exc:
        out["mismatch"] = str(exc)
    sender = RefitSender.for_pairs(world, pairs, global_digest=global_digest(), trainers=TRAINERS,
                                   bucket_bytes=BUCKET)
    for step in STEPS:
        log: list = []
        out[step] = _outcome(lambda step=step, log=log: sender.send(
            {e: _producer(step, rank, e, log) for e, _ in pairs}))
        out[step]["produced"] = log
    return out


def _engine(rank: int, port: int) -> dict:
    from mxport.refit import RefitPlanMismatch, RefitReceiver
    from mxport.testing import FaultyReceiverTransport

    world = _world(rank, port)
    mine = _my_pairs(rank)
    targets = {t: [torch.zeros(s, dtype=d) for _, _, d, s in pair_items(t, e)] for t, e in mine}
    pairs = [(t, pair_plan(t, e), targets[t]) for t, e in mine]
    out: dict = {}
    wrong = hashlib.sha256(b"another refit").hexdigest() if rank == 3 else global_digest()
    try:
        RefitReceiver.for_pairs(world, pairs, global_digest=wrong, trainers=TRAINERS,
                                bucket_bytes=BUCKET).handshake()
    except RefitPlanMismatch as exc:
        out["mismatch"] = str(exc)
    receiver = RefitReceiver.for_pairs(world, pairs, global_digest=global_digest(), trainers=TRAINERS,
                                       bucket_bytes=BUCKET)
    if rank == 3:  # this engine's copy of bucket 1 of its second pair (from trainer 0) is corrupted once
        r = receiver.streams[receiver.peers.index(0)]

        def corrupt(refit, bucket, buf):
            if refit == CORRUPT_STEP and bucket == 1:
                buf[3] ^= 0x10

        r.transport = FaultyReceiverTransport(r.transport, r.layout.num_buckets, corrupt)
    ptrs = {t: [x.data_ptr() for x in ts] for t, ts in targets.items()}
    out["order"] = receiver.peers
    for step in STEPS:
        out[step] = _outcome(receiver.receive)
        out[step]["live"] = {t: _live_step(targets[t], t, rank, STEPS) for t in targets}
        out[step]["pointers"] = all([x.data_ptr() for x in targets[t]] == ptrs[t] for t in targets)
    return out


def _entry(fn, args, q, tag):
    from mxport.testing import child_entry

    child_entry(fn, args, q, tag, WAIT_S)  # a stuck child never outlives the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(jobs, dying=(), restart=None):
    """Spawn ``jobs`` = [(tag, fn, args)]; the tags in ``dying`` exit without a result; ``restart`` =
    (tag, fn, args) is started once the dying jobs have exited. Returns results and exit codes."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {tag: ctx.Process(target=_entry, args=(fn, args, q, tag), daemon=True) for tag, fn, args in jobs}
    for p in procs.values():
        p.start()
    results: dict = {}
    deadline = time.monotonic() + WAIT_S
    try:
        while len(results) < len(procs) - len(dying):
            if restart is not None and all(procs[d].exitcode is not None for d in dying):
                tag, fn, args = restart
                procs[tag] = ctx.Process(target=_entry, args=(fn, args, q, tag), daemon=True)
                procs[tag].start()
                restart = None
            try:
                tag, status, val = q.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    pytest.fail(f"timed out waiting for {set(procs) - set(results)}")
                continue
            assert status == "ok", f"{tag} failed: {val}"
            results[tag] = val
        for p in procs.values():
            p.join(timeout=WAIT_S)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return results, {tag: p.exitcode for tag, p in procs.items()}


@pytest.fixture(scope="module")
def four_ranks():
    """One run of 2 trainer + 2 engine processes through STEPS (see the process bodies)."""
    port = _free_port()
    jobs = ([(f"t{r}", _trainer, (r, port)) for r in TRAINERS]
            + [(f"e{r}", _engine, (r, port)) for r in ENGINES])
    res, codes = _run(jobs)
    assert set(codes.values()) == {0}
    return res


def _statuses(results) -> dict:
    return {r["rank"]: r["status"] for r in results}


@pytest.mark.slow
def test_a_global_digest_mismatch_raises_on_every_rank(four_ranks):
    for tag, r in four_ranks.items():
        assert "rank 3: global plan digest" in r["mismatch"], tag
        assert r["mismatch"].startswith("refit plans differ, nothing was sent")


@pytest.mark.slow
def test_three_refits_land_exactly_on_every_engine(four_ranks):
    assert four_ranks["e2"]["order"] == [0, 1] and four_ranks["e3"]["order"] == [1, 0]  # pair_order
    for step in (1, 2, 3):
        for e in ENGINES:
            got = four_ranks[f"e{e}"][step]
            assert got["live"] == {0: step, 1: step} and got["pointers"] is True
            assert got["ok"]["version"] == step and got["ok"]["rank"] == e
            assert [(p["trainer"], *p["engines"]) for p in got["ok"]["streams"]] == _my_pairs(e)
            assert got["ok"]["bytes"] == sum(pair_plan(t, e).total_bytes for t in TRAINERS)
        for t in TRAINERS:
            sent = four_ranks[f"t{t}"][step]["ok"]
            assert sent["version"] == step and _statuses(sent["receivers"]) == {2: "ok", 3: "ok"}
            assert [(p["trainer"], *p["engines"]) for p in sent["streams"]] == _my_pairs(t)
            assert all(p["buckets"] == _buckets(pair_plan(t, p["engines"][0])) >= 3 for p in sent["streams"])


@pytest.mark.slow
def test_one_engines_corrupt_pair_makes_every_engine_keep_every_pair(four_ranks):
    """Step 4: only engine 3's copy of bucket 1 from trainer 0 is corrupted. Engine 3 does not commit its
    healthy pair from trainer 1 either, engine 2 commits neither of its (healthy) pairs: all keep step 3's
    bytes; every trainer names engine 3; step 5 lands everywhere."""
    step = CORRUPT_STEP
    for e in ENGINES:
        got = four_ranks[f"e{e}"][step]
        assert got["live"] == {0: step - 1, 1: step - 1} and got["pointers"] is True, e
        assert "live weights kept at version 3" in got["error"]
        assert _statuses(got["receivers"]) == {2: "peer_rejected", 3: "checksum"}
        nxt = four_ranks[f"e{e}"][step + 1]
        assert nxt["live"] == {0: step + 1, 1: step + 1} and nxt["ok"]["version"] == step + 1
    e3 = four_ranks["e3"][step]
    assert e3["status"] == "checksum"
    assert "the pair stream from trainer rank 0 was rejected at bucket 1 (tensors: t0.w.weight" in e3["error"]
    e2 = four_ranks["e2"][step]
    assert e2["status"] == "peer_rejected"
    assert "rejected by engine rank 3: checksum at bucket 1 of the pair with trainer rank 0" in e2["error"]
    for t in TRAINERS:
        sent = four_ranks[f"t{t}"][step]
        want = ("RefitError: sharded refit v4 was rejected by 1 rank(s): engine rank 3: checksum at bucket 1 "
                "of the pair with trainer rank 0 (live version 3)")
        assert sent["error"].startswith(want)
        assert sent["status"] == "checksum" and _statuses(sent["receivers"]) == {2: "peer_rejected",
                                                                                 3: "checksum"}
        assert four_ranks[f"t{t}"][step + 1]["ok"]["version"] == step + 1


@pytest.mark.slow
def test_a_trainer_whose_producer_fails_makes_nobody_commit(four_ranks):
    """Step 6: trainer 1's producer for engine 3 (its first pair) fails; its pair to engine 2 goes out as an
    abort without asking its producer. Both engines keep step 5, trainer 1 raises the producer's error,
    trainer 0 raises naming trainer 1; step 7 lands everywhere."""
    step = ABORT_STEP
    t1, t0 = four_ranks["t1"][step], four_ranks["t0"][step]
    assert t1["error"] == "RuntimeError: the quantizer failed" and t1["produced"] == [(1, 3)]
    assert t0["error"].startswith("RefitError: sharded refit v6 was rejected by 3 rank(s): ")
    assert "trainer rank 1: aborted in the pair with engine rank 3" in t0["error"]
    assert _statuses(t0["receivers"]) == {2: "aborted", 3: "aborted"}
    for e in ENGINES:
        got = four_ranks[f"e{e}"][step]
        assert got["live"] == {0: step - 1, 1: step - 1} and got["status"] == "aborted", e
        assert "the pair stream from trainer rank 1 was rejected" in got["error"]
        assert four_ranks[f"e{e}"][step + 1]["live"] == {0: step + 1, 1: step + 1}
    assert "the producer of the tensors failed" in four_ranks["e3"][step]["error"]
    assert four_ranks["t0"][step + 1]["ok"]["version"] == four_ranks["t1"][step + 1]["ok"]["version"] == 7


# ---- an engine rank killed mid-refit -----------------------------------------------------------------------
def _kill_trainer(rank: int, port: int, port2: int) -> dict:
    from mxport.refit import RefitSender

    pairs = [(e, pair_plan(t, e)) for t, e in _my_pairs(rank)]
    sender = RefitSender.for_pairs(_world(rank, port), pairs, global_digest=global_digest(),
                                   trainers=TRAINERS, bucket_bytes=BUCKET)
    out = {1: _outcome(lambda: sender.send({e: payload(1, rank, e) for e, _ in pairs}))}
    out[2] = _outcome(lambda: sender.send({e: payload(2, rank, e) for e, _ in pairs}))
    again = RefitSender.for_pairs(_world(rank, port2, 2 * PG_TIMEOUT_S), pairs, global_digest=global_digest(),
                          trainers=TRAINERS, bucket_bytes=BUCKET)
    again.version = sender.version  # a trainer that survived keeps its refit counter
    out[3] = _outcome(lambda: again.send({e: payload(3, rank, e) for e, _ in pairs}))
    return out


def _kill_engine(rank: int, port: int, port2: int | None, marker: str) -> dict:
    """Engine 2 survives; engine 3 dies in step 2 in the middle of staging its second pair (from trainer 0,
    after bucket 1 landed); ``port`` None: the restarted engine 3, which joins the new group only."""
    from pathlib import Path

    from mxport.refit import RefitReceiver
    from mxport.testing import FaultyReceiverTransport

    mine = _my_pairs(rank)
    targets = {t: [torch.zeros(s, dtype=d) for _, _, d, s in pair_items(t, e)] for t, e in mine}
    pairs = [(t, pair_plan(t, e), targets[t]) for t, e in mine]
    ptrs = {t: [x.data_ptr() for x in ts] for t, ts in targets.items()}
    out: dict = {}
    version = 0
    if port is not None:
        receiver = RefitReceiver.for_pairs(_world(rank, port), pairs, global_digest=global_digest(),
                                   trainers=TRAINERS, bucket_bytes=BUCKET)
        if rank == 3:
            r = receiver.streams[receiver.peers.index(0)]

            def die(refit, bucket, buf):
                if refit == 2 and bucket == 1:
                    Path(marker).write_text(repr(time.time()))
                    os._exit(17)

            r.transport = FaultyReceiverTransport(r.transport, r.layout.num_buckets, die)
        out[1] = _outcome(receiver.receive)
        out[2] = _outcome(receiver.receive)
        out[2]["failed_at"] = time.time()
        out[2]["live"] = {t: _live_step(targets[t], t, rank, (1, 2)) for t in targets}
        version = receiver.version
    again = RefitReceiver.for_pairs(_world(rank, port2, 2 * PG_TIMEOUT_S), pairs,
                                    global_digest=global_digest(), trainers=TRAINERS, bucket_bytes=BUCKET)
    again.version = version
    out[3] = _outcome(again.receive)
    out[3]["live"] = {t: _live_step(targets[t], t, rank, (3,)) for t in targets}
    out[3]["pointers"] = all([x.data_ptr() for x in targets[t]] == ptrs[t] for t in targets)
    return out


@pytest.mark.slow
def test_an_engine_killed_mid_refit_leaves_the_survivors_on_their_weights(tmp_path):
    port, port2 = _free_port(), _free_port()
    marker = str(tmp_path / "died_at")
    jobs = ([(f"t{r}", _kill_trainer, (r, port, port2)) for r in TRAINERS]
            + [(f"e{r}", _kill_engine, (r, port, port2, marker)) for r in ENGINES])
    res, codes = _run(jobs, dying=("e3",), restart=("e3 again", _kill_engine, (3, None, port2, marker)))
    assert codes == {"t0": 0, "t1": 0, "e2": 0, "e3": 17, "e3 again": 0}
    e2 = res["e2"]
    assert e2[1]["ok"]["version"] == 1
    assert e2[2]["live"] == {0: 1, 1: 1}  # step 2 committed by nobody: step 1's bytes exactly
    assert e2[2]["error"].startswith("RefitError: ") and "live weights kept at version 1" in e2[2]["error"]
    after_death = e2[2]["failed_at"] - float(open(marker).read())
    assert after_death < 2 * PG_TIMEOUT_S, after_death  # about the group timeout, not gloo's 30 min
    for t in TRAINERS:
        assert res[f"t{t}"][1]["ok"]["version"] == 1
        assert res[f"t{t}"][2]["error"].startswith("RefitError: "), res[f"t{t}"][2]["where"]
    for tag in ("t0", "t1"):
        assert res[tag][3]["ok"]["version"] == 3
        assert _statuses(res[tag][3]["ok"]["receivers"]) == {2: "ok", 3: "ok"}
    for tag in ("e2", "e3 again"):
        assert res[tag][3]["ok"]["version"] == 3 and res[tag][3]["live"] == {0: 3, 1: 3}
    assert res["e2"][3]["pointers"] is True


# ---- ranks without pairs still vote (in one process: such ranks open no pair streams) ----------------------
def test_ranks_without_pairs_still_vote_and_learn_the_outcome():
    """A trainer rank and an engine rank with no pairs: the handshake agrees, every refit is one vote (all ok:
    both learn version 1, then 2); a wrong digest format is refused before anything crosses the wire."""
    import threading

    from mxport.refit import InProcessChannel, RefitReceiver, RefitSender

    ch = InProcessChannel(1, timeout_s=10)
    digest = global_digest()
    with pytest.raises(ValueError, match="global_digest must be a hex sha256"):
        RefitSender.for_pairs(ch.endpoint(0), [], global_digest="abc", trainers=[0], bucket_bytes=BUCKET)
    with pytest.raises(ValueError, match="world rank 1 is not one of the trainer ranks"):
        RefitSender.for_pairs(ch.endpoint(1), [], global_digest=digest, trainers=[0], bucket_bytes=BUCKET)
    sender = RefitSender.for_pairs(ch.endpoint(0), [], global_digest=digest, trainers=[0])
    receiver = RefitReceiver.for_pairs(ch.endpoint(1), [], global_digest=digest, trainers=[0])
    got: list = []
    th = threading.Thread(target=lambda: got.extend(receiver.receive().to_dict() for _ in range(2)))
    th.start()
    sent = [sender.send({}).to_dict() for _ in range(2)]
    th.join(timeout=30)
    assert [s["version"] for s in sent] == [1, 2] and [g["version"] for g in got] == [1, 2]
    assert sent[1]["receivers"] == [{"rank": 1, "status": "ok", "bucket": -1, "entry": -1, "version": 2}]
    assert sent[0]["streams"] == [] and got[0]["streams"] == [] and got[0]["bytes"] == 0
    # a producer's checksums (of its own plan's stream) are refused in a sharded refit, through the vote
    th = threading.Thread(target=lambda: got.append(_raised(receiver.receive)))
    th.start()
    with pytest.raises(ValueError, match="checksums= gives the buckets of a world of one stream"):
        sender.send({}, checksums=lambda start, size: 0)
    th.join(timeout=30)
    assert "RefitError" in got[-1] and "trainer rank 0: aborted" in got[-1], got[-1]


def _raised(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return f"{type(exc).__name__}: {exc}"
    return "returned"
