"""Refit between two real processes over gloo on loopback (spawned; every wait is bounded by a timeout).

Scenario "main": bucket edges (a tensor exactly one bucket, one larger than a bucket, 2000 tiny tensors) and
an MXFP8Linear; sentinel-filled receive buffers; a corrupted bucket checksum; the decoded cache following a
scale change 127 -> 128. Scenario "mismatch": reordered and retyped plans rejected before any payload.
Scenario "kill": a sender killed mid-transfer, then a new sender on a new group. Scenario "direct": the same
refits received straight into one arena (``allocate_targets``), the corrupted refit and the killed sender
rolled back byte for byte; "kill" runs in both modes.
"""

from __future__ import annotations

import os
import queue

import pytest
import torch
import torch.multiprocessing as mp

from mxport.refit.buckets import BucketLayout

BUCKET = 4096
N_TINY = 2000
PG_TIMEOUT_S = 30.0
WAIT_S = 150.0


# ---- the planned tensors: both processes derive them from the same code ------------------------------------

def _buckets(plan) -> int:
    """How many buckets a stream of ``plan`` cut into ``BUCKET`` bytes has."""
    return BucketLayout(plan, BUCKET).num_buckets


def items():
    """(name, role, dtype, shape): exactly one bucket first, an MXFP8 linear (spans buckets), a 3.5-bucket
    tensor, then 2000 tiny tensors."""
    out = [("edge.exact", "kept", torch.uint8, (BUCKET,)),
           ("lin.weight", "values", torch.float8_e4m3fn, (64, 96)),
           ("lin.weight_scale", "scales", torch.uint8, (64, 3)),
           ("edge.large", "kept", torch.float32, (BUCKET * 7 // 8,))]
    out += [(f"tiny.{i}", "kept", torch.bfloat16 if i % 2 else torch.uint8, (1 + i % 3,))
            for i in range(N_TINY)]
    return out


def payload(version: int) -> list[torch.Tensor]:
    """The tensors sent at ``version``; version 4 repeats version 3 with every scale byte 128 instead of
    127."""
    g = torch.Generator().manual_seed(min(version, 3))
    out = []
    for name, _, dtype, shape in items():
        if name == "lin.weight":
            out.append((torch.randn(shape, generator=g) * 100).to(dtype))
        elif name == "lin.weight_scale":
            out.append(torch.full(shape, 128 if version == 4 else 127, dtype=torch.uint8))
        elif dtype == torch.uint8:
            out.append(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))
        else:
            out.append(torch.randn(shape, generator=g).to(dtype))
    return out


def _bytes(t):
    from mxport.refit.buckets import byte_view

    return byte_view(t).clone()


def _plan(items_=None):
    from mxport.refit import RefitPlan

    return RefitPlan(items_ or items())


def _transport(rank, init):
    from mxport.refit import TorchDistTransport

    torch.set_num_threads(1)
    return TorchDistTransport.init(rank=rank, world_size=2, init_method=init, timeout_s=PG_TIMEOUT_S)


class _Counting:
    """A transport wrapper counting payload broadcasts (to prove nothing moved before a plan mismatch)."""

    def __init__(self, inner):
        self.inner, self.broadcasts = inner, 0
        self.rank, self.world_size, self.src = inner.rank, inner.world_size, inner.src

    is_sender = property(lambda self: self.rank == self.src)

    device = property(lambda self: self.inner.device)

    def all_gather(self, t):
        return self.inner.all_gather(t)

    def broadcast(self, buf, async_op=False):
        self.broadcasts += 1
        return self.inner.broadcast(buf, async_op)


# ---- process bodies ----------------------------------------------------------------------------------------
def _main_sender(init):
    from mxport.refit import RefitError, RefitSender
    from mxport.testing import FaultyTransport

    def corrupt(refit, b, wire):
        if refit == 2 and b == 1:
            wire[-1] ^= 0xFF  # flip the last byte of bucket 1 on the wire, after its checksum was taken

    sender = RefitSender(FaultyTransport(_transport(0, init), _buckets(_plan()), corrupt), _plan(),
                         bucket_bytes=BUCKET)
    out = {"buckets": _buckets(_plan())}
    for v in (1, 2, 3, 4):
        try:
            stats = sender.send(iter(payload(v)))
            assert stats["version"] == v and [r["status"] for r in stats["receivers"]] == ["ok"]
        except RefitError as exc:  # the receiver's checksum report reached the sender
            out["rejected"] = {"version": v, "msg": str(exc), "bucket": exc.bucket,
                               "receivers": [r.to_dict() for r in exc.receivers]}
    sender.transport.close()
    return out


def _main_receiver(init):
    from mxport.nn import MXFP8Linear
    from mxport.refit import RefitError, RefitReceiver

    lin = MXFP8Linear(96, 64)
    plan = _plan()
    targets = []
    for name, _, dtype, shape in items():
        if name == "lin.weight":
            targets.append(lin.weight)
        elif name == "lin.weight_scale":
            targets.append(lin.weight_scale)
        else:
            targets.append(torch.empty(shape, dtype=dtype))
    for t in targets:  # sentinel everywhere
        t.view(torch.uint8).fill_(0xA5)
    receiver = RefitReceiver(_transport(1, init), plan, targets, bucket_bytes=BUCKET)
    ptrs0 = receiver.pointers()
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(7))
    res = {"equal": {}, "pointers": [], "verify": {}, "versions": []}

    def matches(v):
        return all(torch.equal(_bytes(t), _bytes(e)) for t, e in zip(targets, payload(v), strict=True))

    s1 = receiver.receive()
    res["versions"].append(s1["version"])
    res["equal"][1] = matches(1)
    res["verify"][1] = receiver.verify_live()
    res["pointers"].append(receiver.pointers() == ptrs0)
    y1 = lin(x)
    try:
        receiver.receive()
        res["corrupt_error"] = None
    except RefitError as exc:
        res["corrupt_error"] = {"msg": str(exc), "bucket": exc.bucket, "tensors": exc.tensors}
    res["kept_v1_after_corrupt"] = matches(1) and receiver.version == 1
    res["y_after_corrupt_same"] = torch.equal(lin(x), y1)
    res["versions"].append(receiver.receive()["version"])
    res["equal"][3] = matches(3)
    res["pointers"].append(receiver.pointers() == ptrs0)
    y3 = lin(x)
    from mxport import MXFP8Components

    ref3 = torch.nn.functional.linear(x, MXFP8Components(payload(3)[1], payload(3)[2]).dequantize())
    res["y3_matches_reference"] = torch.equal(y3, ref3)
    res["y3_differs_from_y1"] = not torch.equal(y3, y1)
    res["versions"].append(receiver.receive()["version"])
    res["equal"][4] = matches(4)
    res["pointers"].append(receiver.pointers() == ptrs0)
    y4 = lin(x)
    res["y4_doubles_y3"] = torch.equal(y4, 2 * y3) and bool(y3.abs().sum() > 0)
    receiver.transport.close()
    return res


def _stream(plan, tensors):
    out = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    for e, t in zip(plan.entries, tensors, strict=True):
        out[e.offset:e.offset + e.nbytes] = _bytes(t).reshape(-1)
    return out


def _direct_receiver(init):
    """Against _main_sender (v1, corrupted v2, v3, v4), receiving straight into an arena."""
    from mxport.refit import RefitError, RefitReceiver, allocate_targets
    from mxport.refit.arena import stream_arena

    plan = _plan()
    targets = allocate_targets(plan)
    arena = stream_arena(plan, targets)
    arena.fill_(0xA5)  # sentinel everywhere, alignment padding included
    receiver = RefitReceiver(_transport(1, init), plan, targets, bucket_bytes=BUCKET)
    ptrs0 = receiver.pointers()
    res = {"direct": receiver.direct, "equal": {}, "pointers": [], "versions": [], "commit_s": []}
    for v in (1, 2, 3, 4):
        try:
            stats = receiver.receive()
            res["versions"].append(stats["version"])
            res["commit_s"].append(stats["commit_s"])
        except RefitError as exc:
            res["versions"].append("error")
            res["corrupt_error"] = {"msg": str(exc), "bucket": exc.bucket, "kept": exc.kept_version}
        want = 1 if v == 2 else v
        res["equal"][v] = torch.equal(arena, _stream(plan, payload(want)))  # byte-identical, padding too
        res["pointers"].append(receiver.pointers() == ptrs0 and arena.data_ptr() == ptrs0[0])
    receiver.transport.close()
    return res


def _mismatch_body(rank, init):
    """Round 1: the receiver's plan has two tensors swapped; round 2: one dtype changed; round 3: plans
    agree."""
    from mxport.refit import RefitPlanMismatch, RefitReceiver, RefitSender

    transport = _Counting(_transport(rank, init))
    base = items()[:12]
    swapped = [base[0], base[3], base[2], base[1]] + base[4:]  # edge.large moved before lin.weight
    retyped = list(base)
    retyped[5] = (base[5][0], "kept", torch.float16, base[5][3])
    out = {}
    for label, recv_items in (("reordered", swapped), ("dtype", retyped), ("ok", base)):
        plan = _plan(base if rank == 0 else recv_items)
        tensors = payload(1)[:12]
        try:
            if rank == 0:
                RefitSender(transport, plan, bucket_bytes=BUCKET).send(tensors)
            else:
                targets = [torch.zeros(e.shape, dtype=getattr(torch, e.dtype)) for e in plan.entries]
                r = RefitReceiver(transport, plan, targets, bucket_bytes=BUCKET)
                r.receive()
                out[f"{label}_staging_zero"] = bool((r.streams[0]._staging == 0).all())
                out[f"{label}_equal"] = all(torch.equal(_bytes(a), _bytes(b))
                                            for a, b in zip(targets, tensors, strict=True))
            out[label] = "ok"
        except RefitPlanMismatch as exc:
            out[label] = str(exc)
            if rank == 1:  # nothing arrived: staging still all zeros, targets untouched
                out[f"{label}_staging_zero"] = bool((r.streams[0]._staging == 0).all())
                out[f"{label}_targets_zero"] = all(bool((t == 0).all()) for t in targets)
        out[f"{label}_broadcasts"] = transport.broadcasts
    transport.inner.close()
    return out


def _kill_sender(init, die):
    from mxport.refit import RefitSender
    from mxport.testing import FaultyTransport

    def kill(refit, b, wire):
        if refit == 2 and b == 3:
            os._exit(17)  # the trainer dies in the middle of refit v2

    sender = RefitSender(FaultyTransport(_transport(0, init), _buckets(_plan()), kill), _plan(),
                         bucket_bytes=BUCKET)
    if not die:
        sender.version = 5  # a fresh trainer continuing from a later step
        sender.send(payload(3))
        sender.transport.close()
        return {}
    sender.send(payload(1))
    sender.send(payload(2))
    return {}


def _kill_receiver(init, init2, direct=False):
    from mxport.refit import RefitError, RefitReceiver, TorchDistTransport, allocate_targets
    from mxport.refit.arena import stream_arena

    plan = _plan()
    if direct:
        targets = allocate_targets(plan)
    else:
        targets = [torch.zeros(shape, dtype=dtype) for _, _, dtype, shape in items()]
    receiver = RefitReceiver(_transport(1, init), plan, targets, bucket_bytes=BUCKET)
    ptrs = receiver.pointers()
    res = {"direct": receiver.direct}
    receiver.receive()
    res["v1"] = all(torch.equal(_bytes(t), _bytes(e)) for t, e in zip(targets, payload(1), strict=True))
    try:
        receiver.receive()
        res["error"] = None
    except RefitError as exc:
        res["error"] = {"msg": str(exc), "bucket": exc.bucket, "tensors": exc.tensors[:3]}
    res["kept_v1"] = all(torch.equal(_bytes(t), _bytes(e)) for t, e in zip(targets, payload(1), strict=True))
    if direct:
        res["kept_v1"] = res["kept_v1"] and torch.equal(stream_arena(plan, targets),
                                                        _stream(plan, payload(1)))
    res["version_after_error"] = receiver.version
    receiver.transport.close()
    receiver.transport = TorchDistTransport.init(rank=1, world_size=2, init_method=init2,
                                                 timeout_s=PG_TIMEOUT_S)
    receiver.handshake()
    stats = receiver.receive()
    res["next_version"] = stats["version"]
    res["next_equal"] = all(torch.equal(_bytes(t), _bytes(e))
                            for t, e in zip(targets, payload(3), strict=True))
    res["pointers"] = receiver.pointers() == ptrs
    receiver.transport.close()
    return res


def _entry(fn, args, q, tag):
    from mxport.testing import child_entry

    child_entry(fn, args, q, tag)


def _run(jobs, expect_exit=None):
    """Spawn ``jobs`` = [(tag, fn, args)] and collect their results (bounded by WAIT_S)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {tag: ctx.Process(target=_entry, args=(fn, args, q, tag), daemon=True) for tag, fn, args in jobs}
    for p in procs.values():
        p.start()
    results = {}
    try:
        while len(results) < len(procs) - len(expect_exit or {}):
            try:
                tag, status, val = q.get(timeout=WAIT_S)
            except queue.Empty:
                pytest.fail(f"timed out waiting for {set(procs) - set(results)}")
            assert status == "ok", f"{tag} failed: {val}"
            results[tag] = val
        for tag, code in (expect_exit or {}).items():
            procs[tag].join(timeout=WAIT_S)
            assert procs[tag].exitcode == code
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return results


@pytest.mark.slow
def test_two_process_refits_bucket_edges_sentinel_checksum_and_cache(tmp_path):
    plan = _plan()
    assert plan.entries[0].nbytes == BUCKET and plan.entries[0].offset == 0  # exactly one bucket
    large = plan.entries[plan.index("edge.large")]
    assert large.nbytes > BUCKET and (large.offset + large.nbytes - 1) // BUCKET - large.offset // BUCKET >= 3
    init = f"file://{tmp_path}/store"
    both = _run([("send", _main_sender, (init,)), ("recv", _main_receiver, (init,))])
    res = both["recv"]
    rejected = both["send"]["rejected"]  # the sender learns the receiver's outcome
    assert rejected["version"] == 2 and rejected["bucket"] == 1 and "checksum" in rejected["msg"]
    assert rejected["receivers"] == [{"rank": 1, "status": "checksum", "bucket": 1, "entry": -1,
                                      "version": 1}]
    assert res["versions"] == [1, 3, 4]
    # sentinels fully overwritten by exactly the sent bytes
    assert res["equal"] == {1: True, 3: True, 4: True}
    assert res["verify"][1] is True
    assert res["pointers"] == [True, True, True]
    err = res["corrupt_error"]
    assert err is not None and err["bucket"] == 1 and "checksum mismatch" in err["msg"]
    assert "bucket 1" in err["msg"] and err["tensors"] and err["tensors"][0] in err["msg"]
    assert res["kept_v1_after_corrupt"] and res["y_after_corrupt_same"]
    assert res["y3_matches_reference"] and res["y3_differs_from_y1"]
    assert res["y4_doubles_y3"]  # scale byte 127 -> 128 doubles the layer's output, cache followed


@pytest.mark.slow
def test_two_process_plan_mismatch_rejected_before_payload(tmp_path):
    init = f"file://{tmp_path}/store"
    res = _run([("send", _mismatch_body, (0, init)), ("recv", _mismatch_body, (1, init))])
    for side in ("send", "recv"):
        r = res[side]
        assert "reordered" in r["reordered"] and "refit plans differ" in r["reordered"]
        assert "dtype" in r["dtype"] and "float16" in r["dtype"]
        assert r["reordered_broadcasts"] == 0 and r["dtype_broadcasts"] == 0  # no payload moved
        assert r["ok"] == "ok" and r["ok_broadcasts"] > 0
    r = res["recv"]
    assert r["reordered_staging_zero"] and r["reordered_targets_zero"] and r["dtype_staging_zero"]
    assert r["ok_equal"] is True


@pytest.mark.slow
def test_direct_mode_two_processes_sentinels_corrupt_checksum_rolls_back(tmp_path):
    init = f"file://{tmp_path}/store"
    res = _run([("send", _main_sender, (init,)), ("recv", _direct_receiver, (init,))])["recv"]
    assert res["direct"] is True
    assert res["versions"] == [1, "error", 3, 4]
    assert res["equal"] == {1: True, 2: True, 3: True, 4: True}  # v2 rolled back to v1 byte for byte
    assert res["pointers"] == [True, True, True, True]
    err = res["corrupt_error"]
    assert err["bucket"] == 1 and "checksum mismatch" in err["msg"] and err["kept"] == 1
    assert "restored from the rollback copy" in err["msg"]


@pytest.mark.slow
@pytest.mark.parametrize("direct", [False, True], ids=["staging", "direct"])
def test_sender_killed_mid_transfer_keeps_weights_then_next_refit_succeeds(tmp_path, direct):
    init, init2 = f"file://{tmp_path}/store1", f"file://{tmp_path}/store2"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    recv = ctx.Process(target=_entry, args=(_kill_receiver, (init, init2, direct), q, "recv"), daemon=True)
    dying = ctx.Process(target=_entry, args=(_kill_sender, (init, True), q, "send"), daemon=True)
    recv.start()
    dying.start()
    dying.join(timeout=WAIT_S)
    assert dying.exitcode == 17
    fresh = ctx.Process(target=_entry, args=(_kill_sender, (init2, False), q, "send2"), daemon=True)
    fresh.start()
    try:
        results = {}
        while len(results) < 2:
            tag, status, val = q.get(timeout=WAIT_S)
            assert status == "ok", f"{tag} failed: {val}"
            results[tag] = val
    finally:
        for p in (recv, fresh):
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    res = results["recv"]
    assert res["direct"] is direct
    assert res["v1"] is True
    assert res["error"] is not None and res["error"]["bucket"] is not None
    assert f"bucket {res['error']['bucket']}" in res["error"]["msg"]
    assert res["kept_v1"] is True and res["version_after_error"] == 1
    assert res["next_version"] == 6 and res["next_equal"] is True and res["pointers"] is True


def test_a_closed_transport_drops_its_group_and_says_so(tmp_path):
    """close() destroys the group and drops the transport's reference to it (a group left alive until
    interpreter exit can abort the process there); a closed transport refuses to be used, in one line."""
    code = f"""
import torch, torch.distributed as dist
from mxport.refit import TorchDistTransport
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
tr = TorchDistTransport()
assert tr.all_gather(torch.ones(1))[0].item() == 1.0
tr.close()
assert not dist.is_initialized() and tr.group is None
try:
    tr.all_gather(torch.ones(1))
except RuntimeError as exc:
    assert "transport is closed" in str(exc), exc
    print("refused")
"""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "refused", (r.returncode, r.stdout, r.stderr[-2000:])
