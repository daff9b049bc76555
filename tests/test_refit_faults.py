"""Refit under faults, between real processes over gloo on loopback (spawned; every wait bounded).

A producer that yields a bad item (None, a numpy array, a meta tensor, a wrong shape or dtype), a sender that
posts a bucket larger than planned, receivers that reject a refit (stale version), a peer that sends a pickle
during the handshake. In every case: no process dies, every receiver fails within seconds (far below the group
timeout) and keeps its weights byte for byte, the sender learns each receiver's outcome, and the next refit
succeeds. One receiver of two killed mid-refit (after bucket 0, or after the trailer: only the vote stops the
other): the survivor commits nothing, keeps its weights byte for byte and raises within about the group
timeout, the sender raises, and the next refit over a new group succeeds.
"""

from __future__ import annotations

import os
import queue
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from mxport.refit.buckets import BucketLayout

BUCKET = 256
PG_TIMEOUT_S = 20.0  # a fault must surface far sooner than this
PROMPT_S = PG_TIMEOUT_S / 4  # "within seconds": each failure must show up before this
WAIT_S = 120.0



def _buckets(plan) -> int:
    """How many buckets a stream of ``plan`` cut into ``BUCKET`` bytes has."""
    return BucketLayout(plan, BUCKET).num_buckets


def items():
    """(name, role, dtype, shape): a bucket-spanning MXFP8 weight and its scales, kept tensors; last bucket
    short."""
    return [("w.weight", "values", torch.float8_e4m3fn, (16, 64)),
            ("w.weight_scale", "scales", torch.uint8, (16, 2)),
            ("norm.weight", "kept", torch.float32, (40,)), ("emb", "kept", torch.bfloat16, (9, 8))]


def _plan():
    from mxport.refit import RefitPlan

    return RefitPlan(items())


def payload(version: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    out = []
    for _, _, dtype, shape in items():
        if dtype == torch.uint8:
            out.append(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))
        else:
            out.append(torch.randn(shape, generator=g).to(dtype))
    return out


def _stream(tensors) -> torch.Tensor:
    from mxport.refit.buckets import byte_view

    plan = _plan()
    out = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    for e, t in zip(plan.entries, tensors, strict=True):
        out[e.offset:e.offset + e.nbytes] = byte_view(t)
    return out


def _live(targets) -> torch.Tensor:
    return _stream(targets)


def _transport(rank, world, init, timeout_s=PG_TIMEOUT_S):
    from mxport.refit import TorchDistTransport

    torch.set_num_threads(1)
    return TorchDistTransport.init(rank=rank, world_size=world, init_method=init, timeout_s=timeout_s)


def _bad_items():
    """(label, the item replacing tensor 2 of the refit, the exception type send() must raise)."""
    shape = items()[2][3]
    return [("none", None, TypeError), ("numpy", np.zeros(shape, dtype=np.float32), TypeError),
            ("meta", torch.empty(shape, device="meta"), ValueError), ("shape", torch.zeros(41), ValueError),
            ("dtype", torch.zeros(shape, dtype=torch.float16), ValueError)]


# ---- process bodies ----------------------------------------------------------------------------------------
def _faults_sender(world, init):
    """v1 ok; each bad item aborts; a stale version is rejected by every receiver; a bucket larger than
    planned is refused before it is posted; then a good refit."""
    from mxport.refit import RefitError, RefitSender

    sender = RefitSender(_transport(0, world, init), _plan(), bucket_bytes=BUCKET)
    out = {"v1": sender.send(payload(1))["receivers"]}
    for label, bad, _ in _bad_items():
        tensors = payload(2)
        tensors[2] = bad
        try:
            sender.send(iter(tensors))
            out[label] = None
        except Exception as exc:  # noqa: BLE001 - the test looks at what send raised
            out[label] = f"{type(exc).__name__}: {exc}"
    sender.version = 0  # a trainer that restarted from scratch: its version 1 is stale for the receivers
    try:
        sender.send(payload(3))
        out["stale"] = None
    except RefitError as exc:
        out["stale"] = {"msg": str(exc), "statuses": sorted(r.to_dict()["status"] for r in exc.receivers)}
    sender.version = 10
    last = sender.layout.sizes[-1]
    sender.layout.sizes[-1] = last + 16  # a sender bug: the last (short) bucket grows past the plan
    try:
        sender.send(payload(4))
        out["oversize"] = None
    except RuntimeError as exc:
        out["oversize"] = str(exc)
    sender.layout.sizes[-1] = last
    out["next"] = sender.send(payload(5))
    sender.transport.close()
    return out


def _faults_receiver(rank, world, init, direct):
    from mxport.refit import RefitError, RefitReceiver, allocate_targets

    plan = _plan()
    targets = allocate_targets(plan) if direct else [torch.zeros(s, dtype=d) for _, _, d, s in items()]
    receiver = RefitReceiver(_transport(rank, world, init), plan, targets, bucket_bytes=BUCKET)
    res = {"direct": receiver.direct, "failures": {}}
    receiver.receive()
    res["v1"] = torch.equal(_live(targets), _stream(payload(1)))
    for label in [b[0] for b in _bad_items()] + ["stale", "oversize"]:
        kept = _live(targets)
        t0 = time.perf_counter()
        try:
            receiver.receive()
            res["failures"][label] = None
        except RefitError as exc:
            res["failures"][label] = {"msg": str(exc), "seconds": time.perf_counter() - t0,
                                      "kept": torch.equal(_live(targets), kept), "version": receiver.version}
    res["next"] = receiver.receive()["version"]
    res["next_equal"] = torch.equal(_live(targets), _stream(payload(5)))
    receiver.transport.close()
    return res


class _Evil:
    """Unpickling this writes ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _pickling_peer(rank, init, init2, marker):
    """Calls ``all_gather_object`` with a payload whose unpickling writes ``marker``; then, on a new group,
    acts as an honest peer for one refit."""
    import torch.distributed as dist

    from mxport.refit import RefitReceiver, RefitSender, TorchDistTransport

    TorchDistTransport.init(rank=rank, world_size=2, init_method=init, timeout_s=5.0)
    try:
        dist.all_gather_object([None, None], _Evil(marker))
    except Exception:  # noqa: BLE001, S110 - the honest peer hangs up: the attacker's problem
        pass
    dist.destroy_process_group()
    tr = _transport(rank, 2, init2)
    if rank == 0:
        RefitSender(tr, _plan(), bucket_bytes=BUCKET).send(payload(1))
    else:
        targets = [torch.zeros(s, dtype=d) for _, _, d, s in items()]
        RefitReceiver(tr, _plan(), targets, bucket_bytes=BUCKET).receive()
    tr.close()
    return {}


def _honest_peer(rank, init, init2, marker):
    from mxport.refit import RefitError, RefitReceiver, RefitSender

    plan = _plan()
    targets = [torch.full(s, 7, dtype=d) for _, _, d, s in items()]
    tr = _transport(rank, 2, init)
    end = (RefitSender(tr, plan, bucket_bytes=BUCKET) if rank == 0
           else RefitReceiver(tr, plan, targets, bucket_bytes=BUCKET))
    before = _live(targets)
    res = {}
    t0 = time.perf_counter()
    try:
        end.handshake()
        res["error"] = None
    except RefitError as exc:
        res["error"] = str(exc)
    res["seconds"] = time.perf_counter() - t0
    res["marker_after_handshake"] = os.path.exists(marker)
    res["kept"] = torch.equal(_live(targets), before)
    tr.close()
    end.transport = _transport(rank, 2, init2)  # a new group, with an honest peer this time
    end.handshake()
    if rank == 0:
        res["next"] = end.send(payload(1))["version"]
    else:
        res["next"] = end.receive()["version"]
        res["next_equal"] = torch.equal(_live(targets), _stream(payload(1)))
    end.transport.close()
    return res


KILL_PG_TIMEOUT_S = 10.0  # the group timeout of the receiver-killed scenario


def _vote_sender(init, init2):
    """v1 to two receivers; v2 while one of them dies; then v3 to the survivor over a new group."""
    from mxport.refit import RefitError, RefitSender

    sender = RefitSender(_transport(0, 3, init, KILL_PG_TIMEOUT_S), _plan(), bucket_bytes=BUCKET)
    out = {"v1": [r["status"] for r in sender.send(payload(1))["receivers"]]}
    try:
        sender.send(payload(2))
        out["v2"] = None
    except Exception as exc:  # noqa: BLE001 - the test looks at what send raised
        out["v2"] = f"{'RefitError' if isinstance(exc, RefitError) else type(exc).__name__}: {exc}"
    sender.transport.close()
    sender.transport = _transport(0, 2, init2, KILL_PG_TIMEOUT_S)
    sender.handshake()
    stats = sender.send(payload(3))
    out["v3"] = {"version": stats["version"], "statuses": [r["status"] for r in stats["receivers"]]}
    sender.transport.close()
    return out


def _vote_survivor(init, init2, direct):
    """Receiver 1: v1; v2 (its peer dies meanwhile) must raise with v1 kept byte for byte; v3 on a new
    group."""
    from mxport.refit import RefitError, RefitReceiver, allocate_targets

    plan = _plan()
    targets = allocate_targets(plan) if direct else [torch.zeros(s, dtype=d) for _, _, d, s in items()]
    receiver = RefitReceiver(_transport(1, 3, init, KILL_PG_TIMEOUT_S), plan, targets, bucket_bytes=BUCKET)
    res = {"direct": receiver.direct}
    receiver.receive()
    res["v1"] = torch.equal(_live(targets), _stream(payload(1)))
    t0 = time.perf_counter()
    try:
        receiver.receive()
        res["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test looks at what receive raised
        res["error"] = f"{'RefitError' if isinstance(exc, RefitError) else type(exc).__name__}: {exc}"
        res["failed_at"], res["seconds"] = time.time(), time.perf_counter() - t0
    res["kept"] = torch.equal(_live(targets), _stream(payload(1)))
    res["version"] = receiver.version
    receiver.transport.close()
    receiver.transport = _transport(1, 2, init2, KILL_PG_TIMEOUT_S)
    receiver.handshake()
    res["v3"] = receiver.receive()["version"]
    res["v3_equal"] = torch.equal(_live(targets), _stream(payload(3)))
    receiver.transport.close()
    return res


def _vote_dying(init, at, marker):
    """Receiver 2: v1; then dies in refit v2 right after bucket ``at`` landed (``num_buckets``: the
    trailer), writing when it died to ``marker``."""
    from pathlib import Path

    from mxport.refit import RefitReceiver
    from mxport.testing import FaultyReceiverTransport

    plan = _plan()

    def die(refit, bucket, buf):
        if refit == 2 and bucket == at:
            Path(marker).write_text(repr(time.time()))
            os._exit(17)

    tr = FaultyReceiverTransport(_transport(2, 3, init, KILL_PG_TIMEOUT_S), _buckets(plan), die)
    targets = [torch.zeros(s, dtype=d) for _, _, d, s in items()]
    receiver = RefitReceiver(tr, plan, targets, bucket_bytes=BUCKET)
    receiver.receive()
    receiver.receive()
    return {}


def _entry(fn, args, q, tag):
    from mxport.testing import child_entry

    child_entry(fn, args, q, tag, WAIT_S)  # a watchdog: a stuck child never outlives the test


def _run(jobs, dying=()):
    """Spawn ``jobs`` = [(tag, fn, args)]; return their results and exit codes (every wait bounded by
    WAIT_S); the jobs tagged in ``dying`` are expected to exit without a result."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {tag: ctx.Process(target=_entry, args=(fn, args, q, tag), daemon=True) for tag, fn, args in jobs}
    for p in procs.values():
        p.start()
    results = {}
    try:
        while len(results) < len(procs) - len(dying):
            try:
                tag, status, val = q.get(timeout=WAIT_S)
            except queue.Empty:
                codes = {t: p.exitcode for t, p in procs.items()}
                pytest.fail(f"timed out waiting for {set(procs) - set(results)} (exit codes {codes})")
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


# ---- tests -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bad_items_stale_version_and_oversize_bucket_fail_fast_and_keep_weights(tmp_path):
    plan = _plan()
    assert 0 < BucketLayout(plan, BUCKET).sizes[-1] < BUCKET  # the last bucket is short: it can grow
    init = f"file://{tmp_path}/store"
    res, codes = _run([("send", _faults_sender, (3, init)),
                       ("staging", _faults_receiver, (1, 3, init, False)),
                       ("direct", _faults_receiver, (2, 3, init, True))])
    assert codes == {"send": 0, "staging": 0, "direct": 0}  # nobody died
    send = res["send"]
    assert [r["status"] for r in send["v1"]] == ["ok", "ok"]
    for label, _, exc_type in _bad_items():
        assert send[label] is not None and send[label].startswith(exc_type.__name__)
        assert "'norm.weight'" in send[label]
    assert "torch.Tensor, got NoneType" in send["none"] and "got ndarray" in send["numpy"]
    assert "meta device" in send["meta"]
    assert send["stale"]["statuses"] == ["stale", "stale"] and "rejected by 2 of 2" in send["stale"]["msg"]
    assert "is 96 bytes but the plan gives it 80: not sent" in send["oversize"]
    assert send["next"]["version"] == 12 and [r["status"] for r in send["next"]["receivers"]] == ["ok", "ok"]
    for tag in ("staging", "direct"):
        r = res[tag]
        assert r["direct"] is (tag == "direct") and r["v1"] is True
        for label, f in r["failures"].items():
            assert f is not None, label
            assert f["kept"] is True and f["version"] == 1, (tag, label)  # bytes equal the previous ones
            assert f["seconds"] < PROMPT_S, (tag, label, f["seconds"])  # not the group timeout
            print(f"{tag:8s} {label:9s} failed after {f['seconds']:.3f} s")
        for label, _, _ in _bad_items():
            msg = r["failures"][label]["msg"]
            assert "the sender aborted refit v" in msg and "'norm.weight'" in msg and "does not match" in msg
        assert "stale refit version 1" in r["failures"]["stale"]["msg"]
        assert "the sender aborted" in r["failures"]["oversize"]["msg"]
        assert "the sender failed" in r["failures"]["oversize"]["msg"]
        assert r["next"] == 12 and r["next_equal"] is True


@pytest.mark.slow
@pytest.mark.parametrize("attacker", [0, 1], ids=["sender", "receiver"])
def test_a_pickle_in_the_handshake_is_never_unpickled(tmp_path, attacker):
    init, init2 = f"file://{tmp_path}/store1", f"file://{tmp_path}/store2"
    marker = str(tmp_path / "pwned")
    honest = 1 - attacker
    res, codes = _run([("evil", _pickling_peer, (attacker, init, init2, marker)),
                       ("honest", _honest_peer, (honest, init, init2, marker))])
    r = res["honest"]
    assert not os.path.exists(marker) and r["marker_after_handshake"] is False
    assert codes["honest"] == 0
    assert r["error"] is not None
    assert f"rank {attacker} does not speak the mxport refit handshake" in r["error"]
    assert r["seconds"] < PROMPT_S and r["kept"] is True
    print(f"honest {'receiver' if honest else 'sender'} failed after {r['seconds']:.3f} s")
    assert r["next"] == 1
    if honest == 1:
        assert r["next_equal"] is True


@pytest.mark.slow
@pytest.mark.parametrize(("at", "direct"), [("bucket0", False), ("bucket0", True), ("trailer", False),
                                            ("trailer", True)],
                         ids=["bucket0-staging", "bucket0-direct", "trailer-staging", "trailer-direct"])
def test_a_receiver_killed_mid_refit_makes_the_survivor_keep_its_weights(tmp_path, at, direct):
    """1 sender + 2 receivers over gloo; receiver 2 dies in refit v2 (os._exit) right after bucket 0 landed,
    or right after the trailer (so the survivor has received and validated all of v2: only the vote stops
    it). The survivor keeps v1 byte for byte and raises within about the group timeout, the sender raises;
    v3 over a new group succeeds."""
    init, init2 = f"file://{tmp_path}/store1", f"file://{tmp_path}/store2"
    marker = str(tmp_path / "died_at")
    kill_at = 0 if at == "bucket0" else _buckets(_plan())
    res, codes = _run([("send", _vote_sender, (init, init2)),
                       ("survivor", _vote_survivor, (init, init2, direct)),
                       ("dying", _vote_dying, (init, kill_at, marker))], dying=("dying",))
    assert codes == {"send": 0, "survivor": 0, "dying": 17}
    send, r = res["send"], res["survivor"]
    assert send["v1"] == ["ok", "ok"] and r["v1"] is True and r["direct"] is direct
    assert r["kept"] is True and r["version"] == 1  # v1 byte for byte: v2 was committed by no one
    assert r["error"] is not None and r["error"].startswith("RefitError: ")
    assert "live weights kept at version 1" in r["error"]
    assert send["v2"] is not None
    assert send["v2"].startswith("RefitError: refit v2 failed: the transport failed")
    if at == "trailer":
        assert "received and validated, but the vote failed" in r["error"]
    after_death = r["failed_at"] - float(open(marker).read())
    print(f"survivor ({at}, {'direct' if direct else 'staging'}) failed {after_death:.2f} s after the death, "
          f"{r['seconds']:.2f} s after receive() began")
    assert after_death < 2 * KILL_PG_TIMEOUT_S  # about the group timeout, not the default 30 min
    assert send["v3"] == {"version": 3, "statuses": ["ok"]}
    assert r["v3"] == 3 and r["v3_equal"] is True
