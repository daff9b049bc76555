"""The global plan of a sharded refit (refit/mesh.py): boxes, routes, agreement, byte-exact reassembly."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxport.refit import InProcessChannel, RefitPlanMismatch
from mxport.refit.mesh import (
    Box,
    Holding,
    MeshPlan,
    TensorInfo,
    agree,
    holdings_from_canonical,
    local_items,
    local_part,
    natural_key,
    route_targets,
    route_tensors,
)


def info(name, shape, role="kept", dtype="bfloat16"):
    return TensorInfo(name, role, dtype, tuple(shape))


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk-style ranges."""
    step = -(-n // parts)
    return [(min(i * step, n), min((i + 1) * step, n)) for i in range(parts)]


def sharded(t: TensorInfo, dim: int | None, parts: int) -> list[Holding]:
    if dim is None:
        return [Holding(t, Box.full(t.shape)) for _ in range(parts)]
    return [Holding(t, Box.along(t.shape, dim, a, b)) for a, b in split(t.shape[dim], parts)]


def reassemble(mesh: MeshPlan, full: dict) -> list[dict]:
    """Move every route's bytes from trainer shards to fresh engine buffers; return each engine's buffers."""
    out = []
    for e, needs in enumerate(mesh.engines):
        live: dict = {}
        for h in needs:  # a name held as several boxes maps to a list of (box, tensor)
            live.setdefault(h.tensor.name, []).append((h.box, torch.zeros(h.box.shape, dtype=torch.int32)))
        live = {n: held[0] if len(held) == 1 else held for n, held in live.items()}
        for rt in mesh.routes_of(mesh.engine_rank(e)):
            local = {h.tensor.name: (h.box, full[h.tensor.name][h.box.index()])
                     for h in mesh.trainers[rt.trainer]}
            targets, scatters = route_targets(rt, live)
            for src, dst in zip(route_tensors(rt, local), targets, strict=True):
                assert src.shape == dst.shape
                dst.copy_(src)
            for f in scatters:
                f()
        out.append(live)
    return out


def test_box_algebra():
    a = Box((0, 0), (4, 8))
    b = Box.along((4, 8), 1, 2, 6)
    assert a.intersect(b) == b and b.shape == (4, 4) and a.contains(b) and not b.contains(a)
    assert Box((0,), (2,)).intersect(Box((2,), (4,))) is None
    assert str(b) == "[0:4,2:6]" and b.index(Box((0, 2), (4, 8))) == (slice(0, 4), slice(0, 4))
    with pytest.raises(ValueError):
        Box((3,), (2,))


def test_natural_order_puts_layer_10_after_9():
    names = ["layers.10.w", "layers.9.w", "layers.2.experts.11.w1", "layers.2.experts.3.w1"]
    assert sorted(names, key=natural_key) == ["layers.2.experts.3.w1", "layers.2.experts.11.w1",
                                              "layers.9.w", "layers.10.w"]


def test_fsdp2_to_tp2_routes_only_each_engine_shard():
    q, o, n = info("l.0.q.weight", (64, 96)), info("l.0.o.weight", (64, 96)), info("norm.weight", (96,))
    tr = list(zip(*(sharded(t, 0, 2) for t in (q, o, n)), strict=True))
    en = list(zip(sharded(q, 0, 2), sharded(o, 1, 2), sharded(n, None, 2), strict=True))
    mesh = MeshPlan(tr, en)
    # engine 0 needs q rows 0:32 (all on trainer 0), o columns 0:48 (rows split over both), the whole norm
    assert [(r.trainer, r.engine) for r in mesh.routes] == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert [p.name for p in mesh.routes[0].pieces] == ["l.0.o.weight[0:32,0:48]", "l.0.q.weight[0:32,0:96]",
                                                        "norm.weight[0:48]"]
    # each engine receives exactly its shard: q half, o half, the norm
    assert mesh.engine_bytes() == [(32 * 96 + 64 * 48 + 96) * 2] * 2
    full = {t.name: torch.arange(torch.Size(t.shape).numel(), dtype=torch.int32).reshape(t.shape)
            for t in mesh.tensors}
    for e, live in enumerate(reassemble(mesh, full)):
        for name, (box, t) in live.items():
            assert torch.equal(t, full[name][box.index()]), (e, name)


def test_two_boxes_of_one_tensor_on_one_engine_rank():
    """A vLLM tp rank's fused gate_up: gate rows and up rows of one [E, 2I, K] tensor, two holdings of one
    name on one rank. Coverage, routes and digest see both boxes; every byte lands in the box it is in."""
    w = info("l.0.experts.gate_up_proj", (4, 8, 6))
    gate_up = [[Holding(w, Box((0, 2 * r, 0), (4, 2 * r + 2, 6))), Holding(w, Box((0, 4 + 2 * r, 0),
                                                                               (4, 6 + 2 * r, 6)))]
               for r in range(2)]
    full = {w.name: torch.arange(4 * 8 * 6, dtype=torch.int32).reshape(4, 8, 6)}
    for trainers in ([[Holding(w, Box.full(w.shape))]], [[h] for h in sharded(w, 0, 2)]):  # one rank, EP 2
        mesh = MeshPlan(trainers, gate_up)
        assert mesh.engine_bytes() == [4 * 4 * 6 * 2] * 2
        for e, live in enumerate(reassemble(mesh, full)):
            assert [str(b) for _, b, _ in local_items(live)] == [str(h.box) for h in gate_up[e]]
            for _, box, t in local_items(live):
                assert torch.equal(t, full[w.name][box.index()]), (e, box)
        # every piece lies in one of the engine rank's boxes, never across the two
        for rt in mesh.routes:
            held = gate_up[rt.engine - mesh.num_trainers]
            assert all(sum(h.box.contains(p.box) for h in held) == 1 for p in rt.pieces)
    contiguous = [[Holding(w, Box.along(w.shape, 1, 4 * r, 4 * r + 4))] for r in range(2)]
    assert MeshPlan(trainers, contiguous).digest != mesh.digest
    assert len(mesh.canonical()["engines"][0]) == 2
    with pytest.raises(RefitPlanMismatch, match=r"needs .l.0.experts.gate_up_proj.\[0:4,4:6,0:6\]"):
        MeshPlan([[Holding(w, Box.along(w.shape, 1, 0, 4))]], gate_up)


def test_pieces_are_joined_within_one_engine_box_only():
    """Two boxes of one tensor that continue each other along dim 0 stay two pieces (one per live entry);
    joined, no entry would hold the piece."""
    w = info("w", (8, 4))
    engine = [[Holding(w, Box.along(w.shape, 0, 0, 2)), Holding(w, Box.along(w.shape, 0, 2, 4))],
              [Holding(w, Box.along(w.shape, 0, 4, 8))]]
    mesh = MeshPlan([[Holding(w, Box.full(w.shape))]], engine)
    assert [p.name for p in mesh.routes[0].pieces] == ["w[0:2,0:4]", "w[2:4,0:4]"]
    assert [p.name for p in mesh.routes[1].pieces] == ["w[4:8,0:4]"]  # one box: its cells are joined
    full = {"w": torch.arange(32, dtype=torch.int32).reshape(8, 4)}
    live = reassemble(mesh, full)[0]
    assert [torch.equal(t, full["w"][b.index()]) for _, b, t in local_items(live)] == [True, True]
    assert torch.equal(local_part(live, "w", Box.along(w.shape, 0, 2, 3)), full["w"][2:3])
    with pytest.raises(ValueError, match=r"w: this rank holds \[0:2,0:4\], \[2:4,0:4\], not the piece \[1:3"):
        local_part(live, "w", Box.along(w.shape, 0, 1, 3))


def test_replicated_tensors_are_spread_over_their_holders():
    ts = [info(f"l.{i}.norm", (8,)) for i in range(4)]
    mesh = MeshPlan([[Holding(t, Box.full(t.shape)) for t in ts]] * 2, [[Holding(t, Box.full(t.shape))
                                                                          for t in ts]])
    senders = sorted({r.trainer for r in mesh.routes})
    assert senders == [0, 1] and sum(len(r.pieces) for r in mesh.routes) == 4


def test_mismatches_are_refused_with_reasons():
    w = info("w", (8, 32))
    with pytest.raises(RefitPlanMismatch, match=r"needs .w.\[0:8,0:32\]; trainer ranks hold only \[0:4,"):
        MeshPlan([[Holding(w, Box.along(w.shape, 0, 0, 4))]], [[Holding(w, Box.full(w.shape))]])
    with pytest.raises(RefitPlanMismatch, match="needs 'x', which no trainer rank holds"):
        MeshPlan([[Holding(w, Box.full(w.shape))]], [[Holding(w, Box.full(w.shape)),
                                                      Holding(info("x", (2,)), Box((0,), (2,)))]])
    with pytest.raises(RefitPlanMismatch, match="no engine rank needs"):
        MeshPlan([[Holding(w, Box.full(w.shape)), Holding(info("x", (2,)), Box((0,), (2,)))]],
                 [[Holding(w, Box.full(w.shape))]])
    with pytest.raises(RefitPlanMismatch, match="describes 'w'"):
        MeshPlan([[Holding(w, Box.full(w.shape))]], [[Holding(info("w", (8, 32), "kept", "float32"),
                                                              Box.full(w.shape))]])
    with pytest.raises(RefitPlanMismatch, match="outside"):
        MeshPlan([[Holding(w, Box((0, 0), (9, 32)))]], [[Holding(w, Box.full(w.shape))]])


@st.composite
def layouts(draw):
    shape = (draw(st.integers(1, 24)), draw(st.integers(1, 24)))
    T, E = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    tdim, edim = draw(st.sampled_from([None, 0, 1])), draw(st.sampled_from([None, 0, 1]))
    return shape, T, E, tdim, edim


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_any_1d_sharding_reassembles_exactly(case):
    shape, T, E, tdim, edim = case
    t = info("w", shape)
    mesh = MeshPlan([[h] for h in sharded(t, tdim, T)], [[h] for h in sharded(t, edim, E)])
    full = {"w": torch.arange(shape[0] * shape[1], dtype=torch.int32).reshape(shape)}
    for live in reassemble(mesh, full):
        box, got = live["w"]
        assert torch.equal(got, full["w"][box.index()])
    # every engine byte travels once: the routes move exactly what the engines need
    assert sum(r.nbytes for r in mesh.routes) == sum(h.box.numel * 2 for hs in mesh.engines for h in hs)


def _agree_all(holdings: list, timeout_s: float = 10) -> list:
    """``agree`` on every rank (threads over one InProcessChannel): each rank's MeshPlan or exception."""
    ch = InProcessChannel(receivers=len(holdings) - 1, timeout_s=timeout_s)
    out: list = [None] * len(holdings)

    def go(r):
        try:
            out[r] = agree(ch.endpoint(r), 1, holdings[r])
        except Exception as exc:  # noqa: BLE001
            out[r] = exc
    ths = [threading.Thread(target=go, args=(r,)) for r in range(len(holdings))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(2 * timeout_s)
    return out


def test_agree_over_a_group_and_refuse_a_disagreeing_rank():
    w = info("w", (8, 64))
    run = _agree_all

    good = run([[Holding(w, Box.full(w.shape))], [Holding(w, Box.along(w.shape, 1, 0, 32))],
                [Holding(w, Box.along(w.shape, 1, 32, 64))]])
    assert all(isinstance(m, MeshPlan) for m in good) and len({m.digest for m in good}) == 1
    bad = run([[Holding(w, Box.full(w.shape))], [Holding(info("w", (8, 32)), Box((0, 0), (8, 32)))]])
    assert all(isinstance(x, RefitPlanMismatch) for x in bad), bad


def test_peer_holdings_are_checked():
    with pytest.raises(ValueError, match="rank 3"):
        holdings_from_canonical([["w", "values", "float8_e4m3fn", [4], [0], [-1]]], 3)
    with pytest.raises(ValueError, match="not a list"):
        holdings_from_canonical({"w": 1}, 1)
    with pytest.raises(ValueError, match="bad name"):
        holdings_from_canonical([["w", "weird", "uint8", [4], [0], [4]]], 1)
    with pytest.raises(ValueError, match="int64s"):
        holdings_from_canonical([["w", "kept", "uint8", [1 << 63], [0], [1]]], 1)
    with pytest.raises(ValueError, match="17 dimensions"):
        holdings_from_canonical([["w", "kept", "uint8", [1] * 17, [0] * 17, [1] * 17]], 1)
    huge = holdings_from_canonical([["w", "kept", "bfloat16", [1 << 40, 1 << 40], [0, 0], [1, 1]]], 1)
    with pytest.raises(ValueError, match="more than 9223372036854775807 bytes"):
        MeshPlan([huge], [huge])


def test_a_rank_giving_overlapping_boxes_of_one_tensor_is_refused():
    w = info("w", (8, 32))
    once, rows = Holding(w, Box.full(w.shape)), Holding(w, Box.along(w.shape, 0, 0, 4))
    with pytest.raises(RefitPlanMismatch, match=r"trainer rank 1 gives 'w'\[0:4,0:32\] twice"):
        MeshPlan([[once], [once, rows]], [[once]])
    with pytest.raises(RefitPlanMismatch, match=r"engine rank 0 gives 'w'\[0:4,0:32\] twice"):
        MeshPlan([[once]], [[once, rows]])
    disjoint = [rows, Holding(w, Box.along(w.shape, 0, 4, 8))]  # two row ranges: fine (vLLM's w13)
    assert len(MeshPlan([[once]], [disjoint]).routes[0].pieces) == 2


def test_agree_fails_on_every_rank_when_one_cannot_describe_its_holdings():
    w = info("w", (8, 64))

    def broken():
        yield Holding(w, Box.along(w.shape, 1, 0, 32))
        raise RuntimeError("the exporter broke")

    whole = [Holding(w, Box.full(w.shape))]
    out = _agree_all([whole, broken(), whole], timeout_s=3)
    assert all(isinstance(x, RefitPlanMismatch) for x in out), out
    assert all("rank 1 could not describe its holdings" in str(x) for x in out)
    assert "the exporter broke" in str(out[1]) and isinstance(out[1].__cause__, RuntimeError)


def test_a_holder_of_the_whole_need_sends_it_in_one_piece():
    """Routing cuts a need only where its holders differ, never at every other rank's boundaries (which made
    the cells a product of every cut point: minutes for a few hundred ranks)."""
    n = 40
    w = info("w", (n, n))
    diagonal = [[Holding(w, Box((i, i), (i + 1, i + 1)))] for i in range(n)]
    mesh = MeshPlan([[Holding(w, Box.full(w.shape))], *diagonal], [[Holding(w, Box.full(w.shape))]])
    assert [(r.trainer, [p.name for p in r.pieces]) for r in mesh.routes] == [(0, ["w[0:40,0:40]"])]
    # the whole need from the diagonal first, the rest from the full holder: each byte once
    mesh = MeshPlan([*diagonal, [Holding(w, Box.full(w.shape))]], [[Holding(w, Box.full(w.shape))]])
    assert sum(r.nbytes for r in mesh.routes) == n * n * 2 and len(mesh.routes) == n + 1


@st.composite
def patchworks(draw):
    shape = (draw(st.integers(1, 20)), draw(st.integers(1, 20)))
    grid = st.tuples(st.integers(1, 3), st.integers(1, 3))
    return shape, draw(grid), draw(grid), draw(st.booleans())


def _grid(t: TensorInfo, rows: int, cols: int) -> list[Holding]:
    return [Holding(t, Box((r0, c0), (r1, c1))) for r0, r1 in split(t.shape[0], rows)
            for c0, c1 in split(t.shape[1], cols)]


@settings(max_examples=150, deadline=None)
@given(patchworks())
def test_any_2d_patchwork_reassembles_exactly(case):
    shape, (tr, tc), (er, ec), replicated = case
    t = info("w", shape)
    trainers = [[h] for h in _grid(t, tr, tc)] + ([[Holding(t, Box.full(shape))]] if replicated else [])
    mesh = MeshPlan(trainers, [[h] for h in _grid(t, er, ec)])
    full = {"w": torch.arange(shape[0] * shape[1], dtype=torch.int32).reshape(shape)}
    for live in reassemble(mesh, full):
        box, got = live["w"]
        assert torch.equal(got, full["w"][box.index()])
    assert sum(r.nbytes for r in mesh.routes) == sum(h.box.numel * 2 for hs in mesh.engines for h in hs)


def test_route_bytes_come_only_from_a_box_that_holds_them():
    w = info("w", (8, 4))
    halves = [Holding(w, Box.along(w.shape, 0, 0, 4)), Holding(w, Box.along(w.shape, 0, 4, 8))]
    mesh = MeshPlan([[h] for h in halves], [[Holding(w, Box.full(w.shape))]])
    second = mesh.routes_of(1)[0]  # rows 4:8, from trainer 1
    wrong = {"w": (halves[0].box, torch.zeros(4, 4))}  # trainer 0's box: t[0:4] would wrap to t[-4:0]
    with pytest.raises(ValueError, match=r"holds \[0:4,0:4\].*not the piece \[4:8,0:4\]"):
        list(route_tensors(second, wrong))
    with pytest.raises(ValueError, match="cannot give the piece"):
        route_targets(second, {"w": (Box.full(w.shape), torch.zeros(4, 4))})  # box and tensor disagree
