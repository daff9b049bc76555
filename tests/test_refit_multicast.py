"""Routes to replicas of one engine merge into one multicast stream (issue 23): T = 2 trainer ranks (0, 1),
each holding half the rows of two weights; E = 3 engine ranks: 2 and 3 are replicas (both need everything
whole, data-parallel copies of one engine), 4 needs the first half of the rows. Each trainer rank sends the
replicas' bytes once (one broadcast on a group of its own reaches both), and engine 4's on its own pair
stream; one vote for the whole world. The world group comes from ``open_group`` (the multicast groups meet
on its store).

- every engine rank lands every step bit-exact (the bytes of the full tensors cut to its boxes);
- the stats: a trainer rank's streams are ``(2, 3)`` and ``(4,)``, its bytes the replicas' once plus engine
  4's;
- a checksum failure on one replica (step 2) is refused on every rank, every engine keeps step 1, and step 3
  lands everywhere.
"""

from __future__ import annotations

import functools
import socket

import pytest
import torch

T, WORLD = 2, 5
REPLICAS, HALF = (2, 3), 4
NAMES = ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight")
CORRUPT_STEP, STEPS = 2, (1, 2, 3)


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return {n: torch.randn(64, 64, generator=g) for n in NAMES}


def trainer_items(step: int, t: int) -> list:
    return [(n, w[32 * t:32 * (t + 1)].clone(), 0, 32 * t, 64) for n, w in weights(step).items()]


def engine_items(rank: int) -> list:
    full = weights(0)
    if rank == HALF:
        return [(n, w[:32].clone(), 0, 0, 64) for n, w in full.items()]
    return list(full.items())


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@functools.cache
def _expected(step: int) -> dict:
    from mxport.refit import HeldTensorsSource

    return HeldTensorsSource(lambda: list(weights(step).items())).local()


def _step_live(live: dict) -> int | None:
    """The step whose bytes every live tensor of an engine rank holds (0: the initial zeros), or None."""
    got = set()
    for n, (box, t) in live.items():
        if not _u8(t).any():
            got.add(0)
            continue
        got.add(next((s for s in STEPS if torch.equal(_u8(t), _u8(_expected(s)[n][1][box.index()]))), None))
    return got.pop() if len(got) == 1 else None


def _world(port: int, rank: int, init: str) -> dict:  # noqa: ARG001 - the world meets on its own store
    from mxport.refit import HeldTensorsSource, RefitError, RefitReceiver, RefitSender, agree, engine_buffers
    from mxport.refit.transport import TorchDistTransport, open_group
    from mxport.testing import FaultyReceiverTransport

    torch.set_num_threads(1)
    world = TorchDistTransport.from_group(open_group("127.0.0.1", port, rank, WORLD, timeout_s=20))
    state = {"step": 1}
    if rank < T:
        source = HeldTensorsSource(lambda: trainer_items(state["step"], rank))
        mesh = agree(world, T, source.holdings)
        end = RefitSender.from_mesh(world, mesh, bucket_bytes=1024)
    else:
        live = engine_buffers(HeldTensorsSource(lambda: engine_items(rank)).holdings)
        mesh = agree(world, T, HeldTensorsSource(lambda: engine_items(rank)).holdings)
        end = RefitReceiver.from_mesh(world, mesh, live, bucket_bytes=1024)
    out: dict = {"routes": [r.nbytes for r in mesh.routes_of(rank)]}
    for step in STEPS:
        state["step"] = step
        if rank == 3 and step == CORRUPT_STEP:
            s = end.streams[0]
            s.transport = FaultyReceiverTransport(s.transport, s.layout.num_buckets,
                                                  lambda refit, b, buf: buf.view(-1)[:8].add_(1) if b == 1
                                                  else None)
        try:
            stats = end.send_local(source.local()) if rank < T else end.receive()
            out[step] = {"ok": stats.to_dict()}
        except RefitError as exc:
            out[step] = {"error": str(exc)}
        if rank >= T:
            out[step]["live"] = _step_live(live)
            if rank == 3 and step == CORRUPT_STEP:
                end.streams[0].transport = s.transport.inner
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mxport.testing import spawn_world

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return spawn_world(functools.partial(_world, port), WORLD, tmp_path_factory.mktemp("multicast"),
                       wait_s=150)


def test_replicas_get_one_multicast_stream_and_every_step_lands_bit_exact(world):
    for step in (1, 3):
        for t in range(T):  # engine 4's rows are all trainer 0's
            sent = world[t][step]["ok"]
            assert [tuple(s["engines"]) for s in sent["streams"]] == [REPLICAS, (HALF,)][:2 - t]
            assert sorted(r["rank"] for r in sent["receivers"]) == [2, 3, 4]
            # the replicas' bytes leave the trainer rank once: its routes to 2 (not 3, the same) and to 4
            routes = world[t]["routes"]
            assert len(routes) == 3 - t and routes[0] == routes[1] > 0
            assert sent["bytes"] == sum(routes) - routes[1] == sum(s["bytes"] for s in sent["streams"])
        for e in (*REPLICAS, HALF):
            got = world[e][step]["ok"]
            assert got["version"] == step and world[e][step]["live"] == step
            ends = [(s["trainer"], tuple(s["engines"])) for s in got["streams"]]
            assert ends == ([(t, REPLICAS) for t in range(T)] if e in REPLICAS else [(0, (HALF,))]), ends


def test_a_corrupt_bucket_on_one_replica_is_refused_everywhere(world):
    for r in range(WORLD):
        assert "error" in world[r][CORRUPT_STEP], (r, world[r][CORRUPT_STEP])
    assert "checksum" in world[3][CORRUPT_STEP]["error"]
    assert "engine rank 3: checksum" in world[0][CORRUPT_STEP]["error"]
    for e in (*REPLICAS, HALF):
        assert world[e][CORRUPT_STEP]["live"] == CORRUPT_STEP - 1


def _default_world(rank: int, init: str) -> dict:
    """T = 1 on torch.distributed's default group; engine 1 needs the first half of the rows, engines 2 and 3
    are replicas (one multicast stream). Engine 3 first cuts the stream into other buckets; then every rank
    re-creates its end on the same world (the multicast group's next rendezvous) and refits."""
    import datetime

    import torch.distributed as dist

    from mxport.refit import HeldTensorsSource, RefitReceiver, RefitSender, agree, engine_buffers
    from mxport.refit.transport import TorchDistTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=20))
    world = TorchDistTransport()
    full = [(n, w) for n, w in weights(1).items()]
    held = full if rank != 1 else [(n, w[:32].clone(), 0, 0, 64) for n, w in full]
    source = HeldTensorsSource(lambda: held)
    mesh = agree(world, 1, source.holdings)
    live = engine_buffers(source.holdings) if rank else None
    out = {}
    for attempt, bucket in (("mismatch", 2048 if rank == 3 else 1024), ("again", 1024)):
        end = (RefitSender.from_mesh(world, mesh, bucket_bytes=bucket) if rank == 0
               else RefitReceiver.from_mesh(world, mesh, live, bucket_bytes=bucket))
        try:
            stats = end.send_local(source.local()) if rank == 0 else end.receive()
            out[attempt] = {"ok": stats.to_dict()}
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[attempt] = {"error": f"{type(exc).__name__}: {exc}"}
        end.close()  # the multicast stream's own group; the world and the pair streams on it stay
    multicast = [s.transport for s in end.streams if s.transport.ranks and len(s.transport.ranks) > 2]
    out["closed"] = [_closed(t) for t in multicast]
    out["world_open"] = world.all_gather(torch.ones(1))[0].item() == 1.0
    if rank:
        out["live"] = all(torch.equal(_u8(t), _u8(source.local()[n][1][box.index()]))
                          for n, (box, t) in live.items())
    return out


def _closed(transport) -> bool:
    try:
        transport.all_gather(torch.zeros(1))
    except RuntimeError as exc:
        return "this refit transport is closed" in str(exc)
    return False


def test_a_replica_cutting_other_buckets_is_named_by_its_world_rank_and_the_world_refits_after(tmp_path):
    """On the default group: the multicast stream's handshake names the replica that cuts other buckets by
    its world rank (not its rank in the stream's group) and the stream by all its engines; every rank
    refuses; ends re-created on the same world then refit bit-exact; ``close()`` shuts the multicast
    stream's group down and leaves the world open."""
    from mxport.testing import spawn_world

    res = spawn_world(_default_world, 4, tmp_path, wait_s=150)
    for r in range(4):
        assert "error" in res[r]["mismatch"] and "RefitAgreementError" in res[r]["mismatch"]["error"], res[r]
        msg = res[r]["mismatch"]["error"]
        assert ("rank 0: the multicast stream to engine ranks 2, 3: RefitPlanMismatch: refit plans differ, "
                "nothing was sent: receiver 2 (world rank 3): bucket_bytes: local 1024 vs remote 2048") in msg
        assert "receiver(s) [3] cut the stream into other buckets than the sender" in msg
        assert "ok" in res[r]["again"], res[r]["again"]
        assert res[r]["again"]["ok"]["version"] == 1
    assert [tuple(s["engines"]) for s in res[0]["again"]["ok"]["streams"]] == [(1,), (2, 3)]
    for r in range(4):  # close() shut the multicast group down, the world is open
        assert res[r]["closed"] == ([] if r == 1 else [True]) and res[r]["world_open"], res[r]
    assert all(res[e]["live"] for e in (1, 2, 3))
