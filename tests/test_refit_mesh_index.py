"""The indexed global plan (refit/mesh.py) gives the routes, canonical form and digest the plan gave before it
was indexed (issue 23): the digest is agreed between processes, the routes decide which bytes each pair stream
carries. Digests and route fingerprints below were recorded from the unindexed code (commit d48bcf6) for
meshes of every kind a trainer and an engine make; a randomized check compares the routes with that code's
routing, kept here as the reference."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxport.bench.mesh_plan import MoeShape, chunk, moe_mesh_holdings
from mxport.refit import RefitPlanMismatch
from mxport.refit.mesh import (
    Box,
    Holding,
    MeshPlan,
    Piece,
    Route,
    TensorInfo,
    _cover,
    holdings_canonical,
    mesh_from_json,
)


def info(name, shape, role="kept", dtype="bfloat16"):
    return TensorInfo(name, role, dtype, tuple(shape))


def along(t: TensorInfo, dim: int, parts: int, i: int) -> Holding:
    return Holding(t, Box.along(t.shape, dim, *chunk(t.shape[dim], parts, i)))


def full(t: TensorInfo) -> Holding:
    return Holding(t, Box.full(t.shape))


def reference_routes(mesh: MeshPlan) -> list[Route]:
    """The routing of commit d48bcf6: every holder of a tensor in rank order from ``(tensor index + engine
    index) mod T``, each covering what the earlier ones left; the engine's class in place of its index since
    replicas (engines that need the same boxes) take every piece from the same holder."""
    T = mesh.num_trainers
    index = {t.name: i for i, t in enumerate(mesh.tensors)}
    holders: dict[str, list] = {t.name: [] for t in mesh.tensors}
    for t, held in enumerate(mesh.trainers):
        for h in held:
            holders[h.tensor.name].append((t, h.box))
    pieces: dict = {}
    classes: dict = {}  # the engines' needs, in order of first appearance
    for e, needs in enumerate(mesh.engines):
        c = classes.setdefault(tuple((h.tensor.name, h.box.start, h.box.stop) for h in needs), len(classes))
        for h in needs:
            if h.box.numel == 0:
                continue
            first = (index[h.tensor.name] + c) % T
            ranked = sorted(holders[h.tensor.name], key=lambda tb: (tb[0] - first) % T)
            for t, box in _cover(h.box, ranked)[0]:
                pieces.setdefault((t, e), []).append(Piece(h.tensor, box))
    out = []
    for (t, e), ps in sorted(pieces.items()):
        ps.sort(key=lambda p: (index[p.tensor.name], p.box.start))
        out.append(Route(t, mesh.engine_rank(e), tuple(ps)))
    return out


def fingerprint(routes) -> str:
    h = hashlib.sha256()
    for r in routes:
        pieces = [(p.tensor.name, p.box.start, p.box.stop) for p in r.pieces]
        h.update(repr((r.trainer, r.engine, pieces)).encode())
    return h.hexdigest()


# -- the meshes ----------------------------------------------------------------------------------------------
Q, OUT = info("l.0.q.weight", (64, 96)), info("l.0.o.weight", (48, 64))
N, EMB = info("norm.weight", (96,)), info("embed.weight", (100, 32))
W13, W2 = info("l.0.experts.gate_up_proj", (6, 8, 64)), info("l.0.experts.down_proj", (6, 32, 16))
TENSORS = (Q, OUT, N, EMB)


def tp_engine(E: int) -> list[list[Holding]]:
    """q and embed column parallel, o row parallel, norm whole."""
    return [[along(Q, 0, E, e), along(OUT, 1, E, e), full(N), along(EMB, 0, E, e)] for e in range(E)]


def fsdp(T: int, tensors=TENSORS) -> list[list[Holding]]:
    return [[along(t, 0, T, r) for t in tensors] for r in range(T)]


def tp_trainer(T: int) -> list[list[Holding]]:
    """Column / row parallel trainer (q rows, o columns), norm and embed replicated."""
    return [[along(Q, 0, T, r), along(OUT, 1, T, r), full(N), full(EMB)] for r in range(T)]


def fsdp_tp_tiles(T: int) -> list[list[Holding]]:
    """2-D tiles (FSDP rows x TP columns, T = 2 x T/2), norm and embed FSDP."""
    half, out = T // 2, []
    for r in range(T):
        tiles = []
        for t in (Q, OUT):
            (r0, r1), (c0, c1) = chunk(t.shape[0], 2, r // half), chunk(t.shape[1], half, r % half)
            tiles.append(Holding(t, Box((r0, c0), (r1, c1))))
        out.append(tiles + [along(N, 0, T, r), along(EMB, 0, T, r)])
    return out


def mixed_replicas(T: int) -> list[list[Holding]]:
    """Rank 0 holds everything whole, the others FSDP shards: overlapping slabs."""
    return [[full(t) for t in TENSORS]] + fsdp(T - 1)


def two_ranges_per_rank(T: int) -> list[list[Holding]]:
    """Each rank holds two row ranges of q (rows r and r + T of 2T chunks), the rest FSDP."""
    return [[along(Q, 0, 2 * T, r), along(Q, 0, 2 * T, r + T)] + [along(t, 0, T, r) for t in TENSORS[1:]]
            for r in range(T)]


def experts(T: int, E: int) -> tuple[list, list]:
    """EP trainer (experts over dim 0, uneven) -> tp engine: gate_up as gate rows and up rows per rank."""
    tr = [[along(W13, 0, T, r), along(W2, 0, T, r)] for r in range(T)]
    n = W13.shape[1] // 2 // E
    en = [[Holding(W13, Box((0, e * n, 0), (6, (e + 1) * n, 64))),
           Holding(W13, Box((0, 4 + e * n, 0), (6, 4 + (e + 1) * n, 64))), along(W2, 2, E, e)]
          for e in range(E)]
    return tr, en


def small_moe(T: int, E: int) -> tuple[list, list]:
    return moe_mesh_holdings(T, E, MoeShape(layers=2, experts=8, hidden=256, moe_intermediate=128, heads=4,
                                            kv_heads=2, head_dim=32, vocab=512))


MESHES = {
    "fsdp3-tp2": lambda: (fsdp(3), tp_engine(2)),
    "fsdp4-tp4": lambda: (fsdp(4), tp_engine(4)),
    "fsdp7-tp3-uneven": lambda: (fsdp(7), tp_engine(3)),
    "fsdp5-whole": lambda: (fsdp(5), [[full(t) for t in TENSORS]] * 2),
    "fsdp64-tp2-empty-shards": lambda: (fsdp(64), tp_engine(2)),
    "tp2-tp4": lambda: (tp_trainer(2), tp_engine(4)),
    "tp4-tp2": lambda: (tp_trainer(4), tp_engine(2)),
    "replicated3-tp2": lambda: ([[full(t) for t in TENSORS]] * 3, tp_engine(2)),
    "tiles4-tp2": lambda: (fsdp_tp_tiles(4), tp_engine(2)),
    "tiles6-tp3": lambda: (fsdp_tp_tiles(6), tp_engine(3)),
    "mixed4-tp2": lambda: (mixed_replicas(4), tp_engine(2)),
    "two-ranges3-tp2": lambda: (two_ranges_per_rank(3), tp_engine(2)),
    "ep4-tp2": lambda: experts(4, 2),
    "ep5-tp4-uneven": lambda: experts(5, 4),
    "moe-fsdp4-tp2": lambda: small_moe(4, 2),
    "moe-fsdp16-tp4": lambda: small_moe(16, 4),
}

#: (digest, route fingerprint) of each mesh, recorded from commit d48bcf6's MeshPlan
RECORDED = {
    "ep4-tp2": ("6da203ab05b84d70b40695206695f9e85d9e82f41218edc38368d57346449959",
               "06b19f73146e5bb9743580ec3fb8b654d9d244b15dcd02e7ddd755ecab522a33"),
    "ep5-tp4-uneven": ("8b12327f942eba55142bc3f381246af502550a37d7f397d4a50dbb90a74d7153",
                      "84b6a988928c95def92f4a114e772d1346535ebb45f705c0a189089a95d54036"),
    "fsdp3-tp2": ("b902974527dc5eb8de51d2e7528baa594711ffa009ac322ac3f619b24d75bb4b",
                 "8a7b9208ba1f6239828114f229a1be1780c3ce88c41e591aafcc523aaf19bc3f"),
    "fsdp4-tp4": ("ae87469515104345dbc1c86b82cb426a1680c171e51ced62e352b128b14e8ece",
                 "20dbf898a08c262d014b05811dfacd44d723d47c258ae3933eda49fda80c8688"),
    "fsdp5-whole": ("36b425d370631e408f0ac2771da6cec151d329418afec44752d6142609d28f33",
                   "8cf2b01508820d93831ba8c64065b870854ba7d32a1bdfcccd917253daec42a4"),
    "fsdp64-tp2-empty-shards": ("767a4191495b394f76c1073a7d0b0d7b4934e00a082e2376bd8d0c5824e8619a",
                               "a0f07f39b7ecd96234a6633c61a0233f6209c524a7ecacb46dd93fd7a4fdaf18"),
    "fsdp7-tp3-uneven": ("48fe7060b71b269842dc46fef818687f8fc3af358c12f3c81d9691473bfbe87c",
                        "fd2f24e90f12dc9e659361a62d2481d57545ef9d45b2f72937496efab88ec964"),
    "mixed4-tp2": ("abc641f1fdfe45a76c59d5f0a1232e55566182c835435395b0d5254b44f7e4f2",
                  "e7c82fc88885f997de5fee98eb8ee32278d888078b79c64fb911af7ae2cf7831"),
    "moe-fsdp16-tp4": ("84c12da93d8d5f6e163a82340e3649bcbc877e8ac66c873b2c841cb51db1e909",
                      "71296b345d0da8231a5b8368c065e6204f8961ebe80affee6b8e88a2b6ff0eb8"),
    "moe-fsdp4-tp2": ("b462c7c924649c588b947bed3d28494d94a5cbcfa2a52a7e9cf4f260d89635a6",
                     "144b5cb23ec8c73de98c1b56ab7e147439bdbaa2becd366aa8547308e94a328d"),
    "replicated3-tp2": ("29a57dbaed1200ecae5003422f1e42c98e0f0c7e86398a9378542fc3f40eda34",
                       "3505bffe6c523d166e9983b98d44928fe10b177cf1ef28e1dace7a0633804c2e"),
    "tiles4-tp2": ("7d67c41bbb6393c7cac565b6aa4befb0a5d1b450b7b600079a4577c5f334105b",
                  "ea309e142b850ede8f2c6a6ec6818a21ba64fecb07984b5b63375e141be2d21b"),
    "tiles6-tp3": ("4c00da154a5fab364ed1afc18716ec7285b27d0035dd587cc8ebaee00b61e3a0",
                  "f65ce65b4c892bf149b7c735a6cb3d4eb8c421687396c65b35e7a070acf49a33"),
    "tp2-tp4": ("90e74de200839e8db53228a17e42f47248eb74ce0f9838137d36d1c8741f129a",
               "2e7808600983c8262e442349acad693a2f188e02d92ba398377ff193227063e6"),
    "tp4-tp2": ("c5b2cbd90a370b06eed70f5d4828fb76a6dbff1a1e4db48c138c26617702595c",
               "fc1b0c1a027bd6e1793134019506a2fc64dd943a75892bcf03c8b9452c1064a6"),
    "two-ranges3-tp2": ("db30af05b47666eedba193973084583796c2702d377a853854c4bc523a6373d6",
                       "9d416e63a01e868df79cd4a14053bb762d40c2705b172719498035de7c9bbdbd"),
}


@pytest.mark.parametrize("name", sorted(MESHES))
def test_digest_and_routes_are_those_of_the_unindexed_plan(name):
    mesh = MeshPlan(*MESHES[name]())
    assert (mesh.digest, fingerprint(mesh.routes)) == RECORDED[name]
    assert fingerprint(mesh.routes) == fingerprint(reference_routes(mesh))


@pytest.mark.parametrize("name", ["fsdp7-tp3-uneven", "tiles6-tp3", "ep5-tp4-uneven", "moe-fsdp4-tp2"])
def test_the_plan_from_every_rank_s_json_is_the_same_plan(name):
    """What agree builds on every rank: the holdings as JSON bytes, decoded (one description object per
    tensor, whatever rank sent it)."""
    trainers, engines = MESHES[name]()
    texts = [json.dumps(holdings_canonical(h), separators=(",", ":")).encode() for h in (*trainers, *engines)]
    mesh = mesh_from_json(texts, len(trainers))
    assert (mesh.digest, fingerprint(mesh.routes)) == RECORDED[name]
    infos = {id(h.tensor) for held in (*mesh.trainers, *mesh.engines) for h in held}
    assert len(infos) == len(mesh.tensors)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_each_rank_s_routes_are_its_part_of_all_routes(name):
    mesh, whole = MeshPlan(*MESHES[name]()), MeshPlan(*MESHES[name]())
    for rank in range(mesh.num_trainers + mesh.num_engines):  # per rank first, on a plan that built none
        assert mesh.routes_of(rank) == [r for r in whole.routes if rank in (r.trainer, r.engine)], rank
    assert mesh.routes == whole.routes
    assert mesh.engine_bytes() == [sum(r.nbytes for r in whole.routes if r.engine == mesh.engine_rank(e))
                                   for e in range(mesh.num_engines)]


@st.composite
def random_mesh(draw):
    """Trainer ranks holding random row / column ranges or whole copies of 2-D tensors (together covering
    every tensor), engine ranks needing random boxes."""
    shapes = draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=3))
    tensors = [info(f"t.{i}", s) for i, s in enumerate(shapes)]
    T = draw(st.integers(1, 5))
    trainers: list[list[Holding]] = [[] for _ in range(T)]
    for t in tensors:
        kind = draw(st.sampled_from(["rows", "cols", "whole", "mixed"]))
        for r in range(T):
            if kind == "whole" or (kind == "mixed" and r == 0):
                trainers[r].append(full(t))
            else:
                trainers[r].append(along(t, 1 if kind == "cols" else 0, T, r))
    engines = []
    for _ in range(draw(st.integers(1, 3))):
        needs = []
        for t in tensors:
            a0, a1 = sorted(draw(st.tuples(*(st.integers(0, t.shape[0]),) * 2)))
            b0, b1 = sorted(draw(st.tuples(*(st.integers(0, t.shape[1]),) * 2)))
            needs.append(Holding(t, Box((a0, b0), (a1, b1))))
        engines.append(needs)
    return trainers, engines


@settings(max_examples=200, deadline=None)
@given(random_mesh())
def test_random_meshes_route_as_the_unindexed_plan(mesh_holdings):
    mesh = MeshPlan(*mesh_holdings)
    assert fingerprint(mesh.routes) == fingerprint(reference_routes(mesh))
    for rank in range(mesh.num_trainers + mesh.num_engines):
        assert fingerprint(MeshPlan(*mesh_holdings).routes_of(rank)) == fingerprint(
            [r for r in mesh.routes if rank in (r.trainer, r.engine)])


def test_one_box_object_given_twice_by_a_rank_is_refused():
    """The same Box object twice for one tensor on one rank overlaps itself (as two equal boxes do)."""
    box = Box.full(Q.shape)
    with pytest.raises(Exception, match=r"trainer rank 0 gives .l.0.q.weight.\[0:64,0:96\] twice"):
        MeshPlan([[Holding(Q, box), Holding(Q, box)]], [[Holding(Q, box)]])


@pytest.mark.parametrize("name", sorted(MESHES))
def test_the_digest_is_that_of_the_canonical_json(name):
    """The digest's text is the canonical form's JSON, however it is written (the trainer ranks' rows of
    uniform holdings are written layout by layout)."""
    mesh = MeshPlan(*MESHES[name]())
    text = json.dumps(mesh.canonical(), sort_keys=True, separators=(",", ":"))
    assert mesh.digest == hashlib.sha256(text.encode()).hexdigest()


def _bad_rank(trainers, r: int, holding: Holding) -> list[list[Holding]]:
    """``trainers`` with rank ``r``'s holding of the same tensor replaced by ``holding``."""
    return [[holding if i == r and h.tensor.name == holding.tensor.name else h for h in held]
            for i, held in enumerate(trainers)]


@pytest.mark.parametrize(("holding", "problem"), [
    (Holding(Q, Box((32, 0), (70, 96))), r"trainer rank 2: box \[32:70,0:96\] lies outside 'l.0.q.weight' "
                                         r"\(64, 96\)$"),
    (Holding(info("l.0.q.weight", (64, 96), dtype="float32"), Box((32, 0), (48, 96))),
     r"trainer rank 2 describes 'l.0.q.weight' as kept float32 \(64, 96\), another rank as kept bfloat16 "
     r"\(64, 96\)$"),
    (Holding(Q, Box((32,), (48,))),
     r"trainer rank 2: box \[32:48\] lies outside 'l.0.q.weight' \(64, 96\)"),
])
def test_a_problem_on_one_rank_of_uniform_holdings_is_worded_as_before(holding, problem):
    """Holdings alike on every rank but one are checked one by one: the same problems in the same words."""
    trainers = _bad_rank(fsdp(4), 2, holding)
    with pytest.raises(RefitPlanMismatch, match=problem):
        MeshPlan(trainers, tp_engine(2))


def test_an_equal_description_from_another_object_is_the_same_tensor():
    """Uniform holdings compare descriptions by value, as the one-by-one check does."""
    copy = info(Q.name, Q.shape)
    trainers = _bad_rank(fsdp(4), 1, Holding(copy, along(Q, 0, 4, 1).box))
    assert MeshPlan(trainers, tp_engine(4)).digest == RECORDED["fsdp4-tp4"][0]


def test_an_invalid_description_raises_as_before():
    bad = info("l.0.q.weight", (64, 96), role="nonsense")
    with pytest.raises(ValueError, match="not a valid tensor description"):
        MeshPlan([[Holding(bad, Box.full(bad.shape))]] * 2, [[Holding(bad, Box.full(bad.shape))]])
