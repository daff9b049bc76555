"""Issue 23 in one real gloo world (mxport.testing.spawn_world): T = 2 trainer ranks (0, 1), each a
HeldTensorsSource holding half the rows of a weight and the whole of a replicated ``q_norm``; E = 2 engine
ranks (2, 3), each needing the other half of the weight's rows (crossed: each engine takes rows from the other
trainer rank than its own index) and the whole norm. Routing takes the replicated norm from trainer 0 for one
engine and from trainer 1 for the other.

- a rank that fails before the plan is agreed: every rank raises a RefitError naming it and why, at once;
- a pair whose handshake fails (engine 3 built with another bucket size): every rank raises a RefitError
  naming the pair's ranks, at once (not a gloo timeout on the ranks outside the pair);
- replica drift: without the replica check (the old behaviour) trainer 1's drifted norm reaches one engine
  and trainer 0's the other, and the refit "succeeds"; with it, every rank raises RefitError naming the
  tensor and both trainer ranks, every engine keeps its previous bytes, and the next refit lands bit-exact;
- the version stays monotonic when the group is re-created (new endpoints, no version passed).
"""

from __future__ import annotations

import datetime
import functools
import time

import pytest
import torch

T, E, WORLD = 2, 2, 4
BUCKET = 256
PG_TIMEOUT_S = 10.0
W_NAME = "model.layers.0.mlp.down_proj.weight"
NORM = "model.layers.0.self_attn.q_norm.weight"
#: the steps of the checked refits, the one where trainer 1's norm drifts, and the unchecked control step
CONTROL, STEPS, DRIFT, AGAIN = 1, (2, 3, 4), 3, 5


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {W_NAME: torch.randn(64, 64, generator=g), NORM: torch.randn(64, generator=g)}


def trainer_items(step: int, t: int) -> list:
    w = weights(step)
    norm = w[NORM].clone()
    if t == 1 and step in (CONTROL, DRIFT):  # per-rank drift of a replicated tensor
        norm[3] += 0.25
    return [(W_NAME, w[W_NAME][32 * t:32 * (t + 1)].clone(), 0, 32 * t, 64), (NORM, norm)]


def engine_items(e: int) -> list:
    """What engine ``e`` needs: rows ``[32 (1 - e), 32 (2 - e))`` of the weight (the engines differ, so
    routing spreads the replicated norm over both trainer ranks) and the whole norm."""
    w = weights(0)
    r0 = 32 * (1 - e)
    return [(W_NAME, w[W_NAME][r0:r0 + 32].clone(), 0, r0, 64), (NORM, w[NORM])]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@functools.cache
def _expected(step: int) -> dict:
    """The engine's full tensors after a refit of ``step`` (trainer 0's norm)."""
    from mxport.refit import HeldTensorsSource

    return HeldTensorsSource(lambda: list(weights(step).items())).local()


def _outcome(fn) -> dict:
    from mxport.refit import RefitError

    t0 = time.perf_counter()
    try:
        return {"ok": fn(), "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0,
                "refit_error": isinstance(exc, RefitError),
                "tensors": list(getattr(exc, "tensors", []))}


def _endpoint(world, mesh, rank: int, live: dict | None, bucket: int):
    """This rank's sharded endpoint over ``world``, its pairs built by hand (as the first API's callers do:
    no replicas checked)."""
    from mxport.refit import RefitReceiver, RefitSender
    from mxport.refit.mesh import route_targets

    routes = _routes(mesh, rank)
    if rank < T:
        pairs = [(r.engine, r.plan()) for r in routes]
        return RefitSender.for_pairs(world, pairs, global_digest=mesh.digest, trainers=range(T),
                                     bucket_bytes=bucket), routes
    pairs = []
    for r in routes:
        targets, scatters = route_targets(r, live)
        pairs.append((r.trainer, r.plan(), targets, scatters))
    return RefitReceiver.for_pairs(world, pairs, global_digest=mesh.digest, trainers=range(T),
                                   bucket_bytes=bucket), routes


def _checked(world, mesh, rank: int, live: dict | None):
    """This rank's endpoint built from the agreed plan (replicas checked)."""
    from mxport.refit import RefitReceiver, RefitSender

    if rank < T:
        return RefitSender.from_mesh(world, mesh, bucket_bytes=BUCKET)
    return RefitReceiver.from_mesh(world, mesh, live, bucket_bytes=BUCKET)


def _routes(mesh, rank: int) -> list:
    from mxport.refit.world import pair_order

    order = {p: i for i, p in enumerate(pair_order(range(T), range(T, WORLD)))}
    return sorted(mesh.routes_of(rank), key=lambda r: order[(r.trainer, r.engine)])


def _refit(ep, routes, rank: int, source, live, state: dict, step: int) -> dict:
    """One refit of ``step``; ``routes`` None: an endpoint from the plan (send_local)."""
    from mxport.refit.mesh import route_tensors

    state["step"] = step
    if rank < T:
        local = source.local()
        if routes is None:
            out = _outcome(lambda: ep.send_local(local).version)
        else:
            out = _outcome(lambda: ep.send({r.engine: route_tensors(r, local) for r in routes}).version)
    else:
        out = _outcome(lambda: ep.receive().version)
        out["live"] = {n: next((s for s in (*STEPS, AGAIN, CONTROL) if torch.equal(
            _u8(t), _u8(_expected(s)[n][1][box.index()]))), None) for n, (box, t) in live.items()}
        out["norm"] = _u8(live[NORM][1]).numpy().tobytes()
    return out


def _failing_source():
    raise RuntimeError("trainer rank 1's source broke while listing its shards")


def _world(rank: int, init: str) -> dict:
    import torch.distributed as dist

    from mxport.refit import HeldTensorsSource, TorchDistTransport, agree, engine_buffers

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timeout)
    world = TorchDistTransport.from_group(dist.group.WORLD)
    state = {"step": CONTROL}
    source, live = None, None
    if rank < T:
        source = HeldTensorsSource(lambda: trainer_items(state["step"], rank))
        holdings = source.holdings
    else:
        holdings = HeldTensorsSource(lambda: engine_items(rank - T)).holdings
        live = engine_buffers(holdings)
    out: dict = {"before": _outcome(lambda: agree(world, T, _failing_source if rank == 1 else holdings))}
    mesh = agree(world, T, holdings)
    bad, _ = _endpoint(world, mesh, rank, live, 2 * BUCKET if rank == 3 else BUCKET)
    out["pair"] = _outcome(bad.handshake)
    try:
        _refit_steps(world, mesh, rank, source, live, state, out)
    except Exception as exc:  # noqa: BLE001 - each test looks at its own step (the old code stops here)
        out["rest"] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return out


def _refit_steps(world, mesh, rank: int, source, live, state: dict, out: dict) -> None:
    """The control refit (replicas unchecked), the checked ones, one more over a re-created group."""
    import torch.distributed as dist

    from mxport.refit import TorchDistTransport

    ep, routes = _endpoint(world, mesh, rank, live, BUCKET)
    out[CONTROL] = _refit(ep, routes, rank, source, live, state, CONTROL)
    ep = _checked(world, mesh, rank, live)
    for step in STEPS:
        out[step] = _refit(ep, None, rank, source, live, state, step)
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    pg2 = dist.new_group(list(range(WORLD)), backend="gloo", timeout=timeout)  # the group re-created
    ep2 = _checked(TorchDistTransport.from_group(pg2), mesh, rank, live)
    out["again"] = _refit(ep2, None, rank, source, live, state, AGAIN)
    pg3 = dist.new_group(list(range(WORLD)), backend="gloo", timeout=timeout)  # re-created once more
    ep3 = _checked(TorchDistTransport.from_group(pg3), mesh, rank, live)
    ep3.handshake()
    if rank < T:
        ep3.version = 0  # a trainer that lost count: its next refit (v1) is older than what engines hold
    out["stale"] = _refit(ep3, None, rank, source, live, state, CONTROL)
    out["stale"]["version"] = ep3.version


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mxport.testing import spawn_world

    return spawn_world(_world, WORLD, tmp_path_factory.mktemp("vote"), wait_s=150)


def _live(got: dict) -> int | None:
    """The step whose bytes every live tensor (values, scales, norm) of an engine rank holds, or None."""
    steps = set(got["live"].values())
    assert set(got["live"]) == {W_NAME, W_NAME + "_scale", NORM}
    return steps.pop() if len(steps) == 1 else None


def test_a_rank_failing_before_agreement_is_named_on_every_rank(world):
    for r in range(WORLD):
        got = world[r]["before"]
        assert got.get("refit_error"), (r, got)
        assert "rank 1 could not describe its holdings: RuntimeError: trainer rank 1's source broke" \
            in got["error"], got["error"]
        assert got["seconds"] < PG_TIMEOUT_S / 2, got["seconds"]


def test_a_failed_pair_handshake_is_named_on_every_rank_at_once(world):
    for r in range(WORLD):
        got = world[r]["pair"]
        assert got.get("refit_error"), (r, got)
        assert got["error"].startswith("RefitAgreementError: sharded refit handshake failed"), got["error"]
        assert "rank 3: the pair with trainer rank 1: RefitPlanMismatch" in got["error"], got["error"]
        assert "rank 0: the pair with engine rank 3" in got["error"], got["error"]
        assert got["seconds"] < PG_TIMEOUT_S / 2, got["seconds"]


def test_unchecked_replicas_let_engines_diverge(world):
    """The bug, kept visible: without the replica check the drifted refit commits and the engines hold
    different norms (each from another trainer rank)."""
    assert [world[r][CONTROL].get("ok") for r in range(WORLD)] == [1, 1, 1, 1]
    assert world[2][CONTROL]["norm"] != world[3][CONTROL]["norm"]


def test_replica_drift_refuses_the_refit_on_every_rank(world):
    for r in range(WORLD):
        got = world[r][DRIFT]
        assert got.get("refit_error"), (r, got)
        assert f"replicas differ: {NORM}[0:64] differs between trainer ranks 0, 1" in got["error"], got
        assert got["tensors"] == [NORM]
    for r in range(T):
        assert "trainer rank 0: replica_drift; trainer rank 1: replica_drift" in world[r][DRIFT]["error"]
    for e in (2, 3):
        assert _live(world[e][DRIFT]) == DRIFT - 1  # the previous bytes, values, scales and norm
        assert "live weights kept at version 2" in world[e][DRIFT]["error"]


def test_agreeing_refits_land_bit_exact_around_the_refused_one(world):
    for step in STEPS:
        if step == DRIFT:
            continue
        assert [world[r][step].get("ok") for r in range(WORLD)] == [step] * WORLD, step
        for e in (2, 3):
            assert _live(world[e][step]) == step


def test_a_stale_refit_is_refused_by_re_created_engine_endpoints(world):
    """Endpoints re-created over a new group keep the live version in every pair stream: a trainer that sends
    an older version is refused as stale (it was committed, and the engines' version went back)."""
    for e in (2, 3):
        got = world[e]["stale"]
        assert "stale refit version 1 (live version is 5)" in got.get("error", ""), got
        assert _live(got) == AGAIN and got["version"] == AGAIN
    for t in range(T):
        assert "stale" in world[t]["stale"].get("error", ""), world[t]["stale"]


def test_the_version_stays_monotonic_when_the_group_is_re_created(world):
    """New endpoints over a new group, no version passed: the refit after v4 is v5 (it was v1)."""
    assert [world[r]["again"].get("ok") for r in range(WORLD)] == [AGAIN] * WORLD
    for e in (2, 3):
        assert _live(world[e]["again"]) == AGAIN


# ---- the version across re-created endpoints (in one process: ranks without pairs) -------------------------
def _in_process_refits(sender, receiver, n: int) -> tuple[list[int], list[int]]:
    import threading

    got: list = []
    th = threading.Thread(target=lambda: got.extend(receiver.receive().version for _ in range(n)))
    th.start()
    sent = [sender.send({}).version for _ in range(n)]
    th.join(timeout=30)
    return sent, got


def test_versions_continue_over_re_created_endpoints_and_restarted_ranks(monkeypatch):
    """A new group with new endpoints for the same plan (no version passed) continues after the last refit
    (it restarted at 1); a restarted trainer (nothing remembered in its process) takes the engine's version:
    the next refit is newer than any rank's."""
    import hashlib

    from mxport.refit import InProcessChannel, RefitReceiver, RefitSender, world

    monkeypatch.setattr(world, "_LAST_VERSION", {}, raising=False)
    digest = hashlib.sha256(b"versions over re-created groups").hexdigest()

    def pair(**kw):
        ch = InProcessChannel(1, timeout_s=10)
        return (RefitSender.for_pairs(ch.endpoint(0), [], global_digest=digest, trainers=[0]),
                RefitReceiver.for_pairs(ch.endpoint(1), [], global_digest=digest, trainers=[0], **kw))

    assert _in_process_refits(*pair(), 2) == ([1, 2], [1, 2])
    assert _in_process_refits(*pair(), 1) == ([3], [3])  # the group re-created
    engine_live = 3  # the engine rank remembers the version its live weights hold
    monkeypatch.setattr(world, "_LAST_VERSION", {})  # a restarted process remembers nothing
    assert _in_process_refits(*pair(version=engine_live), 1) == ([4], [4])


# ---- the replica checks without processes ------------------------------------------------------------------
def test_batched_checksums_and_replica_digests():
    from mxport.refit.buckets import checksum, checksums
    from mxport.refit.world import replica_digests

    g = torch.Generator().manual_seed(0)
    sizes = (8, 64, (1 << 20) + 24, 3 << 20, (2 << 20) + 8)  # several 1 MiB chunks, with and without a tail
    payloads = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    assert checksums(payloads) == [checksum(p) for p in payloads] and checksums([]) == []
    x = torch.randn(5, 7, generator=g).to(torch.bfloat16)  # 14 bytes a row: unaligned, odd-sized boxes
    a, b, c = replica_digests([x[1:3, 2:5], x[1:3, 2:5].clone(), x[1]])
    assert a == b and a != c
    y = x.clone()
    y[2, 3] += 1
    assert replica_digests([y[1:3, 2:5]]) != [a]


def test_replica_checks_name_the_tensor_and_every_holder():
    """Three holders of a norm, rank 2 drifts: the line names the tensor, the three ranks and who had what;
    a holder that aborted is not compared (its digests mean nothing)."""
    from mxport.refit import ReceiverResult, Status
    from mxport.refit.mesh import Box, Replica, TensorInfo
    from mxport.refit.results import Vote
    from mxport.refit.world import ReplicaChecks

    n = TensorInfo("norm", "kept", "bfloat16", (64,))
    w = TensorInfo("w", "kept", "bfloat16", (4, 96))
    checks = ReplicaChecks.of([Replica(w, Box((0, 32), (4, 64)), (0, 1)),
                               Replica(n, Box.full((64,)), (0, 1, 2))])
    assert checks.width == 2 and checks.slots == {0: {0: 0, 1: 1}, 1: {0: 0, 1: 1}, 2: {1: 0}}

    def rows(digests, status=(0, 0, 0)):
        return [torch.tensor([status[r], -1, -1, 1, -1, *d], dtype=torch.int64)
                for r, d in enumerate(digests)]

    def vote(rs):
        results = tuple(ReceiverResult.from_tensor(r, t[:4]) for r, t in enumerate(rs))
        return Vote(0, results, frozenset({0, 1, 2}))

    same = rows([[7, 5], [7, 5], [5, 0]])
    assert checks.drift(same, vote(same)) == ((), (), set())
    bad = rows([[7, 5], [7, 5], [6, 0]])
    lines, names, ranks = checks.drift(bad, vote(bad))
    assert names == ("norm",) and ranks == {0, 1, 2}
    assert lines == ("norm[0:64] differs between trainer ranks 0, 1, 2 (ranks 0, 1: digest "
                     "0x0000000000000005, rank 2: digest 0x0000000000000006)",)
    aborted = rows([[7, 5], [7, 5], [6, 0]], status=(0, 0, int(Status.ABORTED)))
    assert checks.drift(aborted, vote(aborted))[0] == ()
