"""The global plan of a sharded refit: the box of each tensor every trainer rank holds (group ranks ``0 ..
T-1``) and every engine rank needs (``T .. T+E-1``), one :class:`Holding` per box, and the routes that move
exactly those bytes: one :class:`Route` per (trainer, engine) pair, an ordinary
:class:`~mxport.refit.RefitPlan` of pieces named ``name[r0:r1,c0:c1]``. Tensors go in natural name order
(numbers compared as numbers), so layers and experts travel in global order whichever rank holds them.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, compress, groupby, islice, repeat
from operator import add, attrgetter, itemgetter, le, lt, ne

import torch

from ..formats import BLOCK_SIZE, ceil_div
from .plan import ROLES, WIRE_DTYPES, Item, RefitPlan, RefitPlanMismatch, Role, dtype_from_name
from .results import RefitError

MESH_FORMAT = "mxport-mesh-plan/1"


@dataclass(frozen=True, slots=True)
class Box:
    """A box of a tensor: per dimension the half-open range ``[start, stop)``."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    def __post_init__(self) -> None:
        start, stop = self.start, self.stop
        if len(start) != len(stop) or start and not (set(map(type, start)) == set(map(type, stop)) == {int}
                                                     and min(start) >= 0 and all(map(le, start, stop))):
            raise ValueError(f"a box needs 0 <= start <= stop per dimension, got {self.start} .. {self.stop}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @classmethod
    def along(cls, shape: Sequence[int], dim: int, start: int, stop: int) -> Box:
        """The whole tensor but ``[start, stop)`` along ``dim``."""
        lo, hi = [0] * len(shape), [int(s) for s in shape]
        lo[dim], hi[dim] = start, stop
        return cls(tuple(lo), tuple(hi))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.stop) and all(map(le, self.stop, shape))

    def contains(self, other: Box) -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.stop, other.start, other.stop,
                                                           strict=True))

    @classmethod
    def _of(cls, start: tuple[int, ...], stop: tuple[int, ...]) -> Box:
        """A box cut from checked boxes: no checks (routing makes many)."""
        box = object.__new__(cls)
        _BOX_START(box, start)  # the slots' own setters: a frozen dataclass refuses setattr
        _BOX_STOP(box, stop)
        return box

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when it is empty."""
        if len(self.start) != len(other.start):
            raise ValueError(f"boxes {self} and {other} have different dimensions")
        lo = tuple(map(max, self.start, other.start))
        hi = tuple(map(min, self.stop, other.stop))
        for a, b in zip(lo, hi, strict=True):
            if a >= b:
                return None
        return Box._of(lo, hi)

    def index(self, outer: Box | None = None) -> tuple[slice, ...]:
        """Slices that cut this box out of a tensor holding ``outer`` (the full tensor when None)."""
        base = outer.start if outer is not None else (0,) * len(self.start)
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.start, self.stop, base, strict=True))

    def __str__(self) -> str:
        return "[" + ",".join(f"{a}:{b}" for a, b in zip(self.start, self.stop, strict=True)) + "]"

    def canonical(self) -> list:
        return [list(self.start), list(self.stop)]


_BOX_START, _BOX_STOP = Box.start.__set__, Box.stop.__set__
_START, _STOP = attrgetter("start"), attrgetter("stop")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a sharded refit, whole: checkpoint name, role, dtype name and full shape."""

    name: str
    role: Role
    dtype: str
    shape: tuple[int, ...]

    def canonical(self) -> list:
        return [self.name, self.role, self.dtype, list(self.shape)]


@dataclass(frozen=True, slots=True)
class Holding:
    """What one rank holds (a trainer rank) or needs (an engine rank) of one tensor."""

    tensor: TensorInfo
    box: Box


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of one tensor that one trainer rank sends to one engine rank."""

    tensor: TensorInfo
    box: Box

    @classmethod
    def _of(cls, tensor: TensorInfo, box: Box) -> Piece:
        """A piece of a checked plan: no dataclass init (routing makes hundreds of thousands)."""
        piece = object.__new__(cls)
        _PIECE_TENSOR(piece, tensor)
        _PIECE_BOX(piece, box)
        return piece

    @property
    def name(self) -> str:
        """The pair plan's entry name: ``name[r0:r1,c0:c1]``."""
        return f"{self.tensor.name}{self.box}"

    def item(self) -> Item:
        return (self.name, self.tensor.role, self.tensor.dtype, self.box.shape)


_PIECE_TENSOR, _PIECE_BOX = Piece.tensor.__set__, Piece.box.__set__


@dataclass(frozen=True, slots=True)
class Route:
    """Every piece one trainer rank sends one engine rank in a refit (group ranks), in tensor order."""

    trainer: int
    engine: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.box.numel * dtype_from_name(p.tensor.dtype).itemsize for p in self.pieces)

    def plan(self) -> RefitPlan:
        """This pair's byte stream as an ordinary refit plan."""
        return RefitPlan([p.item() for p in self.pieces])


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a plan is built: the build allocates hundreds of thousands of
    acyclic objects, and every collection would rescan every rank's holdings for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _dumps(obj) -> str:
    """The plan's canonical JSON text: sorted keys, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), check_circular=False)


def _box_texts(boxes: Sequence[Box]) -> list[str]:
    """Each box's canonical row text after the tensor index, ``[start],[stop]]`` (loops in C)."""
    ints = ",".join(["%d"] * len(boxes[0].start)) if boxes else ""
    return list(map(f"[{ints}],[{ints}]]".__mod__, map(add, map(_START, boxes), map(_STOP, boxes))))


_NUM = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key comparing digit runs as numbers (``layers.10`` after ``layers.9``)."""
    return tuple(int(p) if p.isdigit() else p for p in _NUM.split(name))


class MeshPlan:
    """The agreed global plan of a sharded refit from ``trainers`` (per trainer rank, the :class:`Holding` s
    it holds) and ``engines`` (per engine rank, those it needs).

    Raises:
        RefitPlanMismatch: two ranks describe a tensor differently; bytes an engine needs that no trainer
            holds, or a tensor no engine needs; a box outside its tensor; overlapping boxes on one rank.
    """

    def __init__(self, trainers: Sequence[Iterable[Holding]], engines: Sequence[Iterable[Holding]]):
        self.trainers = tuple(tuple(h) for h in trainers)
        self.engines = tuple(tuple(h) for h in engines)
        if not self.trainers or not self.engines:
            raise ValueError("a sharded refit needs at least one trainer rank and one engine rank")
        with _gc_paused():
            uniform = _uniform_trainers(self.trainers)
            self.tensors = _merge_tensors(self.trainers, self.engines, uniform)
            self._held = _index_holders(self.tensors, self.trainers, uniform)
            # per trainer holding (the same tensors on every rank): its tensor's holders, for the digest
            self._layouts = None if uniform is None else [self._held[t.name] for t in uniform.tensors]
            del uniform  # before the collector rescans what the build left
            _check_coverage(self.tensors, self._held, self.engines)
        self._rank_routes: dict[int, list[Route]] = {}

    @property
    def num_trainers(self) -> int:
        return len(self.trainers)

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def engine_rank(self, e: int) -> int:
        """The group rank of engine ``e`` (engines follow the trainers)."""
        return self.num_trainers + e

    @cached_property
    def engine_classes(self) -> tuple[int, ...]:
        """Per engine index, its class: replicas (engines that need the same boxes) share one."""
        seen: dict[tuple, int] = {}
        return tuple(seen.setdefault(tuple((h.tensor.name, h.box.start, h.box.stop) for h in held), len(seen))
                     for held in self.engines)

    def replicas_of(self, engine_rank: int) -> tuple[int, ...]:
        """The group ranks of ``engine_rank``'s class (itself included), ascending."""
        c = self.engine_classes[engine_rank - self.num_trainers]
        return tuple(self.engine_rank(e) for e, k in enumerate(self.engine_classes) if k == c)

    def canonical(self) -> dict:
        """The tensors and every rank's boxes, JSON-able (boxes as ``(tensor index, start, stop)``)."""
        return self._canonical(self.trainers)

    def _canonical(self, trainers) -> dict:
        index = {t.name: i for i, t in enumerate(self.tensors)}

        def ranks(side):
            return [[(index[h.tensor.name], h.box.start, h.box.stop) for h in held] for held in side]

        return {"format": MESH_FORMAT, "tensors": [t.canonical() for t in self.tensors],
                "trainers": ranks(trainers), "engines": ranks(self.engines)}

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the canonical form as JSON text (sorted keys, no spaces)."""
        with _gc_paused():
            if self._layouts is None:
                text = _dumps(self.canonical())
            else:  # the same text, the trainer ranks' rows (the last key) written layout by layout
                text = _dumps(self._canonical(()))
                text = text.removesuffix('"trainers":[]}') + f'"trainers":{self._layout_rows()}}}'
        return hashlib.sha256(text.encode()).hexdigest()

    def _layout_rows(self) -> str:
        """The trainer ranks' canonical rows as JSON text for uniform holdings."""
        index = {t.name: i for i, t in enumerate(self.tensors)}
        heads = [f"[{index[h.tensor.name]}," for h in self.trainers[0]]
        texts = {h: _box_texts(h.boxes) for h in dict.fromkeys(self._layouts)}  # per layout, rank by rank
        columns = list(map(texts.__getitem__, self._layouts))
        rows = ("[" + ",".join(map(add, heads, map(itemgetter(r), columns))) + "]"
                for r in range(self.num_trainers))
        return "[" + ",".join(rows) + "]"

    @cached_property
    def routes(self) -> tuple[Route, ...]:
        """Every (trainer, engine) pair with bytes to move, ordered by trainer then engine (group ranks)."""
        return tuple(route(self))

    def routes_of(self, rank: int) -> list[Route]:
        """The routes group rank ``rank`` takes part in (computed for it alone unless all are)."""
        if "routes" in self.__dict__:
            return [r for r in self.routes if rank in (r.trainer, r.engine)]
        if rank not in self._rank_routes:
            if 0 <= rank < self.num_trainers:
                self._rank_routes[rank] = _routes(self, range(self.num_engines), trainer=rank)
            elif 0 <= rank - self.num_trainers < self.num_engines:
                self._rank_routes[rank] = _routes(self, [rank - self.num_trainers])
            else:
                return []
        return list(self._rank_routes[rank])

    def engine_bytes(self) -> list[int]:
        """Bytes each engine rank receives per refit."""
        return [sum(h.box.numel * dtype_from_name(h.tensor.dtype).itemsize for h in needs)
                for needs in self.engines]

    def summary(self) -> dict:
        return {"tensors": len(self.tensors), "trainer_ranks": self.num_trainers,
                "engine_ranks": self.num_engines, "routes": len(self.routes),
                "bytes": sum(r.nbytes for r in self.routes), "engine_bytes": self.engine_bytes(),
                "digest": self.digest}


def _merge_tensors(trainers, engines, uniform: _Uniform | None = None) -> tuple[TensorInfo, ...]:
    """Every tensor, in natural name order, after checking the holdings ``uniform`` has not checked."""
    seen: dict[str, TensorInfo] = {}
    agreed: dict[int, bool] = {}  # per description met (by id): valid, and equal to its name's first one
    problems: list[str] = []
    if uniform is not None:
        seen = {t.name: t for t in uniform.tensors}
        agreed = dict.fromkeys(map(id, uniform.tensors), True)
    for side, ranks in (("trainer", () if uniform else trainers), ("engine", engines)):
        for r, held in enumerate(ranks):
            first_box: dict[str, Box] = {}
            more: dict[str, list[Box]] = {}  # the boxes of a tensor this rank gives several of
            for h in held:
                t, box = h.tensor, h.box
                same = agreed.get(id(t))
                if same is None:
                    _check_info(t)
                    same = agreed[id(t)] = seen.setdefault(t.name, t) == t
                prior = first_box.get(t.name)
                if prior is None:
                    first_box[t.name] = box
                else:
                    mine = more.setdefault(t.name, [prior])
                    if any(b.intersect(box) is not None for b in mine):
                        problems.append(f"{side} rank {r} gives {t.name!r}{box} twice (boxes of one tensor "
                                        "on one rank must not overlap)")
                    mine.append(box)
                if not box.within(t.shape):
                    problems.append(f"{side} rank {r}: box {box} lies outside {t.name!r} {t.shape}")
                if not same:
                    problems.append(f"{side} rank {r} describes {t.name!r} as {t.role} {t.dtype} "
                                    f"{t.shape}, another rank as {seen[t.name].role} {seen[t.name].dtype} "
                                    f"{seen[t.name].shape}")
    if problems:
        raise RefitPlanMismatch(problems)
    return tuple(sorted(seen.values(), key=lambda t: natural_key(t.name)))


#: the most bytes one tensor may have (sizes travel as int64 words)
MAX_TENSOR_BYTES = (1 << 63) - 1

_TENSOR, _BOX, _NAME = attrgetter("tensor"), attrgetter("box"), attrgetter("name")


@dataclass(frozen=True, slots=True)
class _Uniform:
    """Trainer ranks that each hold one box of each of the same tensors, in one order (FSDP shards, whole
    copies, one tp layout), with every rank's boxes per tensor and their starts and stops per dimension."""

    tensors: list[TensorInfo]
    boxes: list[tuple[Box, ...]]
    starts: list[tuple[int, ...]]
    stops: list[tuple[int, ...]]

    def holders(self) -> dict[str, _Holders]:
        """Each tensor's :class:`_Holders`, one for the tensors of equal boxes (a model's layers)."""
        ranks, out, layouts, d = list(range(len(self.boxes[0]) if self.boxes else 0)), {}, {}, 0
        for t, boxes in zip(self.tensors, self.boxes, strict=True):
            lo, hi = self.starts[d:d + len(t.shape)], self.stops[d:d + len(t.shape)]
            d += len(t.shape)
            key = (t.shape, *lo, *hi)
            found = layouts.get(key)
            if found is None:
                found = layouts[key] = _Holders(t.shape, ranks, list(boxes), lo, hi)
            out[t.name] = found
        return out


def _uniform_trainers(trainers) -> _Uniform | None:
    """The trainer holdings as a :class:`_Uniform` (checked with loops in C) when every rank holds one box of
    each of the same tensors in one order, else None."""
    try:
        tensors = list(map(_TENSOR, trainers[0]))
        names = list(map(_NAME, tensors))
        if len(set(names)) != len(names):
            return None
        for t in tensors:
            _check_info(t)
        dims = [len(t.shape) for t in tensors]
        boxes, starts, stops = [], [], []
        for held in trainers:  # rank by rank, as the holdings lie in memory
            if list(map(_TENSOR, held)) != tensors:
                return None
            mine = list(map(_BOX, held))
            hi = list(map(_STOP, mine))
            if list(map(len, hi)) != dims:
                return None
            boxes.append(mine)
            starts.append(list(chain.from_iterable(map(_START, mine))))
            stops.append(list(chain.from_iterable(hi)))
        stops = list(zip(*stops, strict=True))
        if not all(map(le, map(max, stops), chain.from_iterable(t.shape for t in tensors))):
            return None
        return _Uniform(tensors, list(zip(*boxes, strict=True)), list(zip(*starts, strict=True)), stops)
    except Exception:  # noqa: BLE001 - whatever it is, the one-by-one checks word it (or raise it)
        return None


def _check_info(t: TensorInfo) -> None:
    if not isinstance(t, TensorInfo) or not t.name or t.role not in ROLES or t.dtype not in WIRE_DTYPES:
        raise ValueError(f"not a valid tensor description: {t!r}")
    if math.prod(t.shape) * dtype_from_name(t.dtype).itemsize > MAX_TENSOR_BYTES:
        raise ValueError(f"{t.name!r}: shape {t.shape} of {t.dtype} is more than {MAX_TENSOR_BYTES} bytes")


class _Holders:
    """The trainer ranks' boxes of one tensor, indexed to cover an engine box without visiting every holder:
    when the boxes are disjoint slabs (ranges of dim 0: FSDP shards, whole copies), by bisection."""

    def __init__(self, shape: tuple[int, ...], ranks: list[int], boxes: list[Box], lo=None, hi=None):
        self.ranks, self.boxes, self.rest = ranks, boxes, shape[1:]
        found = _slab_ranges(shape, boxes, lo, hi)
        self.slabs = found is not None
        self.starts, self.stops, order = found or ([], [], [])
        self.slab_ranks = list(map(ranks.__getitem__, order))
        self.slab_boxes = list(map(boxes.__getitem__, order))
        self.disjoint = self.slabs and all(map(le, self.stops, islice(self.starts, 1, None)))
        self.union_starts, self.union_stops = _union(self.starts, self.stops, self.disjoint)
        self._covers: dict[tuple, tuple[list[int], list[Box]]] = {}  # cover of disjoint slabs, by need

    def rotated(self, first: int) -> Iterator[tuple[int, Box]]:
        """The holders in rank order from rank ``first`` on, wrapping around."""
        i = bisect_left(self.ranks, first)
        return zip(chain(islice(self.ranks, i, None), islice(self.ranks, i)),
                   chain(islice(self.boxes, i, None), islice(self.boxes, i)), strict=True)

    def covers(self, need: Box) -> bool:
        """Whether the holders together hold every element of ``need``."""
        if not need.numel:
            return True
        if not self.slabs:
            return not _cover(need, zip(self.ranks, self.boxes, strict=True))[1]
        i = bisect_right(self.union_starts, need.start[0]) - 1
        return i >= 0 and self.union_stops[i] >= need.stop[0]

    def cover(self, need: Box, first: int, trainer: int | None = None) -> tuple[list[int], list[Box]]:
        """The greedy cover of ``need`` by the holders from rank ``first`` on (only ``trainer``'s pieces when
        given): ranks and boxes, cached for disjoint slabs."""
        if not self.disjoint:
            pieces = [p for p in _cover(need, self.rotated(first))[0] if trainer in (None, p[0])]
            return [t for t, _ in pieces], [box for _, box in pieces]
        key = (need.start, need.stop, trainer)
        found = self._covers.get(key)
        if found is None:
            found = self._covers[key] = self._cover_slabs(need, trainer)
        return found

    def _cover_slabs(self, need: Box, trainer: int | None) -> tuple[list[int], list[Box]]:
        a, b = need.start[0], need.stop[0]
        if trainer is None:
            lo, hi = bisect_right(self.stops, a), bisect_left(self.starts, b)
            ranks, boxes = self.slab_ranks[lo:hi], self.slab_boxes[lo:hi]
        else:
            mine = self.boxes[bisect_left(self.ranks, trainer):bisect_right(self.ranks, trainer)]
            boxes = [box for box in mine if box.start[0] < b and box.stop[0] > a]
            ranks = [trainer] * len(boxes)
        head, tail = need.start[1:], need.stop[1:]
        if any(head) or tail != self.rest:  # the need is part of the slabs' other dimensions
            return ranks, [Box._of((max(box.start[0], a), *head), (min(box.stop[0], b), *tail))
                           for box in boxes]
        if boxes and boxes[0].start[0] < a:  # whole slabs, but the first and last may stick out
            boxes[0] = Box._of((a, *head), (min(boxes[0].stop[0], b), *tail))
        if boxes and boxes[-1].stop[0] > b:
            boxes[-1] = Box._of((max(boxes[-1].start[0], a), *head), (b, *tail))
        return ranks, boxes


def _slab_ranges(shape: tuple[int, ...], boxes: list[Box], lo: list[tuple[int, ...]] | None = None,
                 hi: list[tuple[int, ...]] | None = None) -> tuple[list[int], list[int], list[int]] | None:
    """None unless every box is a range of dim 0; else the ranges' starts, stops and box positions."""
    n = len(boxes)
    if not n:
        return [], [], []
    lo = list(zip(*map(_START, boxes), strict=True)) if lo is None else lo
    hi = list(zip(*map(_STOP, boxes), strict=True)) if hi is None else hi
    if any(lo[d].count(0) != n or hi[d].count(shape[d]) != n for d in range(1, len(shape))):
        return None
    starts, stops = list(lo[0]), list(hi[0])
    held = list(map(lt, starts, stops))
    order = list(compress(range(len(boxes)), held))
    if len(order) < len(boxes):
        starts, stops = list(compress(starts, held)), list(compress(stops, held))
    if not all(map(le, starts, islice(starts, 1, None))):
        order = sorted(order, key=lambda i: boxes[i].start[0])
        starts, stops = [boxes[i].start[0] for i in order], [boxes[i].stop[0] for i in order]
    return starts, stops, order


def _union(starts: list[int], stops: list[int], disjoint: bool) -> tuple[list[int], list[int]]:
    """The union of the ranges ``[starts[i], stops[i])`` (sorted by start) as sorted disjoint ranges."""
    if disjoint:  # join ranges that continue each other
        gaps = list(map(ne, stops, islice(starts, 1, None)))  # map stops at the shorter
        return starts[:1] + list(compress(starts[1:], gaps)), list(compress(stops, gaps)) + stops[-1:]
    union_starts: list[int] = []
    union_stops: list[int] = []
    for lo, hi in zip(starts, stops, strict=True):
        if union_stops and lo <= union_stops[-1]:
            union_stops[-1] = max(union_stops[-1], hi)
        else:
            union_starts.append(lo)
            union_stops.append(hi)
    return union_starts, union_stops


def _index_holders(tensors, trainers, uniform: _Uniform | None = None) -> dict[str, _Holders]:
    if uniform is not None:  # a tensor only engine ranks describe has no holders
        held = uniform.holders()
        return {t.name: held.get(t.name) or _Holders(t.shape, [], []) for t in tensors}
    held: dict[str, tuple[list[int], list[Box]]] = {t.name: ([], []) for t in tensors}
    for t, held_by_rank in enumerate(trainers):
        for h in held_by_rank:
            ranks, boxes = held[h.tensor.name]
            ranks.append(t)
            boxes.append(h.box)
    return {t.name: _Holders(t.shape, *held[t.name]) for t in tensors}


def _check_coverage(tensors, held: dict[str, _Holders], engines) -> None:
    needed = {h.tensor.name for ranked in engines for h in ranked}
    problems = [f"trainer ranks hold {t.name!r}, which no engine rank needs" for t in tensors
                if t.name not in needed]
    for e, ranked in enumerate(engines):
        for h in ranked:
            holders = held[h.tensor.name]
            if not holders.boxes:
                problems.append(f"engine rank {e} needs {h.tensor.name!r}, which no trainer rank holds")
            elif not holders.covers(h.box):
                problems.append(f"engine rank {e} needs {h.tensor.name!r}{h.box}; trainer ranks hold only "
                                f"{', '.join(map(str, holders.boxes))}")
    if problems:
        raise RefitPlanMismatch(problems)


def _subtract(outer: Box, inner: Box) -> list[Box]:
    """``outer`` less ``inner`` (a box inside it) as disjoint boxes."""
    out = []
    lo, hi = list(outer.start), list(outer.stop)
    for d, (a, b) in enumerate(zip(inner.start, inner.stop, strict=True)):
        if lo[d] < a:
            out.append(Box._of(tuple(lo), (*hi[:d], a, *hi[d + 1:])))
        if b < hi[d]:
            out.append(Box._of((*lo[:d], b, *lo[d + 1:]), tuple(hi)))
        lo[d], hi[d] = a, b
    return out


def _cover(need: Box, holders: Iterable[tuple[int, Box]]) -> tuple[list[tuple[int, Box]], list[Box]]:
    """Cover ``need`` greedily: each ``(rank, box)`` holder in turn takes what it holds that no earlier one
    took. Returns the pieces and what no holder holds."""
    pieces: list[tuple[int, Box]] = []
    left = [need] if need.numel else []
    for t, b in holders:
        if not left:
            break
        rest = []
        for r in left:
            common = r.intersect(b)
            if common is None:
                rest.append(r)
            else:
                pieces.append((t, common))
                rest += _subtract(r, common)
        left = rest
    return pieces, left


def route(mesh: MeshPlan) -> list[Route]:
    """Every engine rank's boxes cut into pieces, each sent by one trainer rank that holds it; replicated
    bytes come from the holder ``(tensor index + engine class) mod T`` onwards, spreading the load."""
    return _routes(mesh, range(mesh.num_engines))


@_gc_paused()
def _routes(mesh: MeshPlan, engines: Iterable[int], trainer: int | None = None) -> list[Route]:
    """The routes to the engine indices ``engines`` (only those from ``trainer`` when given)."""
    T = mesh.num_trainers
    index = {t.name: i for i, t in enumerate(mesh.tensors)}
    routes = []
    for e in engines:
        c = mesh.engine_classes[e]  # replicas take every piece from the same holder
        needs = sorted(((index[h.tensor.name], h.box.start, h) for h in mesh.engines[e] if h.box.numel),
                       key=itemgetter(0, 1))
        ranks: list[int] = []  # every piece and its trainer rank, tensor by tensor in the needs' order
        pieces: list[Piece] = []
        for i, needs_of_tensor in groupby(needs, itemgetter(0)):
            got: list[int] = []
            boxes: list[Box] = []
            mine: list[Piece] = []
            for _, _, h in needs_of_tensor:
                more, cut = mesh._held[h.tensor.name].cover(h.box, (i + c) % T, trainer)
                got += more
                boxes += cut
                mine += map(Piece._of, repeat(h.tensor), cut)
            if len(set(got)) < len(got):  # a trainer's pieces of one tensor go in box order
                keys = list(zip(got, map(_START, boxes), strict=True))
                order = sorted(range(len(got)), key=keys.__getitem__)
                got, mine = list(map(got.__getitem__, order)), list(map(mine.__getitem__, order))
            ranks += got
            pieces += mine
        order = sorted(range(len(ranks)), key=ranks.__getitem__)  # by trainer, each in tensor order
        ranks, pieces = list(map(ranks.__getitem__, order)), list(map(pieces.__getitem__, order))
        for t in dict.fromkeys(ranks):
            mine = pieces[bisect_left(ranks, t):bisect_right(ranks, t)]
            routes.append(Route(t, mesh.engine_rank(e), tuple(mine)))
    return sorted(routes, key=lambda r: (r.trainer, r.engine))


# -- replicated bytes: boxes several trainer ranks hold (their copies must agree) ---------------------------
@dataclass(frozen=True)
class Replica:
    """A box of one tensor that several trainer ranks (``holders``) each hold whole: its copies must agree, as
    routing takes each piece from one holder."""

    tensor: TensorInfo
    box: Box
    holders: tuple[int, ...]


def _overlaps(boxes: Sequence[Box]) -> Iterator[tuple[int, int, Box]]:
    """``(i, j, common)`` for every pair of non-empty ``boxes`` that intersect (a sweep)."""
    if len(boxes) < 2:
        return
    dims = len(boxes[0].start)
    d = max(range(dims), key=lambda k: len({b.start[k] for b in boxes})) if dims else 0
    order = sorted(range(len(boxes)), key=lambda i: boxes[i].start[d] if dims else 0)
    for n, i in enumerate(order):
        for j in order[n + 1:]:
            if dims and boxes[j].start[d] >= boxes[i].stop[d]:
                break
            common = boxes[i].intersect(boxes[j])
            if common is not None:
                yield min(i, j), max(i, j), common


def find_replicas(mesh: MeshPlan) -> tuple[Replica, ...]:
    """Every replicated region of ``mesh``'s trainer holdings, in tensor order: boxes several ranks hold and
    the common parts of overlapping boxes, so comparing them compares every copy of every byte."""
    by_name: dict[str, dict[Box, list[int]]] = {t.name: {} for t in mesh.tensors}
    for t, held in enumerate(mesh.trainers):
        for h in held:
            by_name[h.tensor.name].setdefault(h.box, []).append(t)
    out: list[Replica] = []
    for info in mesh.tensors:
        boxes = {b: ranks for b, ranks in by_name[info.name].items()
                 if all(a < z for a, z in zip(b.start, b.stop, strict=True))}  # empty boxes hold nothing
        regions = {b: set(ranks) for b, ranks in boxes.items() if len(set(ranks)) > 1}
        distinct = list(boxes)
        for i, j, common in _overlaps(distinct):
            regions.setdefault(common, set()).update(boxes[distinct[i]], boxes[distinct[j]])
        out += [Replica(info, b, tuple(sorted(regions[b])))
                for b in sorted(regions, key=lambda b: (b.start, b.stop)) if len(regions[b]) > 1]
    return tuple(out)


# -- agreeing on the plan over the group -------------------------------------------------------------------
#: the longest JSON description of one rank's holdings accepted from a peer
MAX_HOLDINGS_JSON = 64 << 20
#: the most dimensions of a tensor described by a peer
MAX_DIMS = 16


def holdings_canonical(held: Iterable[Holding]) -> list:
    """One rank's holdings as JSON-able rows ``[name, role, dtype, shape, start, stop]``."""
    return [[*h.tensor.canonical(), *h.box.canonical()] for h in held]


def _int64s(v: list) -> bool:
    """Whether ``v`` holds non-negative int64s only (loops in C)."""
    return not v or (set(map(type, v)) == {int} and min(v) >= 0 and max(v) <= MAX_TENSOR_BYTES)


def holdings_from_canonical(obj, rank: int, infos: dict | None = None) -> list[Holding]:
    """A peer's holdings rebuilt from JSON, every field checked (ValueError naming the rank); ``infos`` shares
    one :class:`TensorInfo` per tensor across ranks."""
    if type(obj) is not list:
        raise ValueError(f"rank {rank} sent holdings that are not a list")
    infos = {} if infos is None else infos
    out = []
    for i, row in enumerate(obj):
        try:
            out.append(_holding_of(row, infos))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"rank {rank} sent a bad holding at {i}: {exc}") from None
    return out


def _holding_of(row, infos: dict) -> Holding:
    """One row ``[name, role, dtype, shape, start, stop]`` of a peer's holdings, checked."""
    name, role, dtype, shape, start, stop = row
    if type(name) is not str or role not in ROLES or dtype not in WIRE_DTYPES:
        raise ValueError("bad name, role or dtype")
    if not (type(shape) is type(start) is type(stop) is list and len(shape) == len(start) == len(stop)
            and _int64s(shape + start + stop)):
        raise ValueError("shape, start and stop must be lists of non-negative int64s of one length")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"{len(shape)} dimensions (at most {MAX_DIMS})")
    key = (name, role, dtype, *shape)
    info = infos.get(key) or infos.setdefault(key, TensorInfo(name, role, dtype, tuple(shape)))
    start, stop = tuple(start), tuple(stop)
    return Holding(info, Box._of(start, stop) if all(map(le, start, stop)) else Box(start, stop))


def mesh_from_json(texts: Sequence[bytes], trainers: int) -> MeshPlan:
    """The plan :func:`agree` builds from every rank's holdings JSON (ranks ``0 .. trainers-1`` the trainers),
    digest included. ValueError for bytes that are not holdings (naming the rank), or RefitPlanMismatch."""
    infos: dict = {}
    with _gc_paused():
        ranks = [holdings_from_canonical(json.loads(text), r, infos) for r, text in enumerate(texts)]
        mesh = MeshPlan(ranks[:trainers], ranks[trainers:])
        mesh.digest  # noqa: B018 - a cached property, computed while the collector is paused
    return mesh


#: "MXMESH" and the plan agreement's version (2: a status row first, a failing rank's reason to every rank)
MESH_HELLO = 0x4D584D4553480002
#: the longest reason (UTF-8 bytes) a rank that cannot describe its holdings sends the others
MAX_REASON = 4000


class RefitAgreementError(RefitPlanMismatch, RefitError):
    """The ranks did not agree on a sharded plan, or a rank failed before they did, raised on every rank
    naming each failing rank and why; both a :class:`RefitPlanMismatch` and a :class:`RefitError`."""

    def __init__(self, problems: Sequence[str], *, what: str = "sharded plan not agreed",
                 local_digest: str = ""):
        RefitPlanMismatch.__init__(self, problems, local_digest=local_digest)
        self.bucket, self.tensors, self.kept_version, self.status, self.receivers = None, [], 0, None, []
        head = "; ".join(self.differences[:8])
        more = f" (+{len(self.differences) - 8} more)" if len(self.differences) > 8 else ""
        self.args = (f"{what}, nothing was sent: {head}{more}",)


def gather_checked(transport, row, what: str) -> list:
    """``transport.all_gather(row)``; a transport failure raised as :class:`RefitError` naming ``what``."""
    try:
        return transport.all_gather(row)
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError; in-process channels TimeoutError
        raise RefitError(f"rank {transport.rank}: the {what} failed ({type(exc).__name__}: {exc}); a rank "
                         "died, timed out or never took part: nothing was sent, re-create the group") from exc


def _describe(held) -> tuple[bytes, BaseException | None]:
    """This rank's holdings as JSON bytes, or (``b""``, why it has none)."""
    try:
        if isinstance(held, BaseException):
            raise held
        text = json.dumps(holdings_canonical(held() if callable(held) else held), separators=(",", ":"))
        if len(text) > MAX_HOLDINGS_JSON:
            raise ValueError(f"{len(text)} bytes of holdings JSON (at most {MAX_HOLDINGS_JSON})")
        return text.encode(), None
    except Exception as exc:  # noqa: BLE001 - any failure here must reach every rank, not hang them
        return b"", exc


def _exchange_holdings(transport, held) -> list[list[Holding] | str]:
    """Every rank's holdings JSON; :class:`RefitAgreementError` on every rank when any rank failed."""
    text, mine = _describe(held)
    reason = b"" if mine is None else f"{type(mine).__name__}: {mine}".encode()[:MAX_REASON]
    row = torch.tensor([MESH_HELLO, int(mine is not None), len(text or reason)], dtype=torch.int64)
    rows = [r.tolist() for r in gather_checked(transport, row, "sharded plan agreement (status rows)")]
    strangers = [r for r, (hello, _, _) in enumerate(rows) if hello != MESH_HELLO]
    if strangers:
        raise RefitAgreementError([f"rank {r} does not speak the mxport plan agreement (another program or "
                                   "mxport version on this group?)" for r in strangers]) from mine
    limit = [MAX_REASON if failed else MAX_HOLDINGS_JSON for _, failed, _ in rows]
    problems = [f"rank {r} sent {n} bytes of holdings (at most {MAX_HOLDINGS_JSON})"
                for r, (_, _, n) in enumerate(rows) if not 0 <= n <= limit[r]]
    if problems:
        raise RefitAgreementError(problems) from mine
    buf = torch.zeros(max(n for _, _, n in rows), dtype=torch.uint8)
    buf[:len(text or reason)] = torch.frombuffer(bytearray(text or reason), dtype=torch.uint8)
    got = [g[:rows[r][2]].numpy().tobytes()
           for r, g in enumerate(gather_checked(transport, buf, "sharded plan agreement (holdings)"))]
    failed = [f"rank {r} could not describe its holdings: {got[r].decode(errors='replace')}"
              for r, (_, bad, _) in enumerate(rows) if bad]
    if failed:
        raise RefitAgreementError(failed) from mine
    return got


def agree(transport, trainers: int, held) -> MeshPlan:
    """The same :class:`MeshPlan` on every rank of ``transport``'s group: ranks ``0 .. trainers-1`` give what
    they hold, the others what they need (length-capped JSON, never pickle), and the digests are compared.
    ``held``: this rank's holdings, a callable returning them, or the exception it failed with (it must still
    call ``agree``, so no rank waits for it).

    Raises:
        RefitPlanMismatch: on every rank, when the holdings make no plan (:class:`RefitAgreementError`: a rank
            could not give its own) or the digests differ. RefitError: the group failed.
    """
    try:
        mesh, problem = mesh_from_json(_exchange_holdings(transport, held), trainers), ""
    except RefitError:  # a rank failed before the plan (every rank knows it), or the group failed
        raise
    except Exception as exc:  # noqa: BLE001 - every rank must still give its digest row (no rank hangs)
        mesh, problem = None, str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    digest = bytes.fromhex(mesh.digest) if mesh is not None else bytes(32)
    rows = gather_checked(transport, torch.frombuffer(bytearray(digest), dtype=torch.uint8),
                          "sharded plan agreement (digests)")
    if problem:
        raise RefitPlanMismatch([problem])
    bad = [r for r, d in enumerate(rows) if d.numpy().tobytes() != digest]
    if bad:
        raise RefitPlanMismatch([f"rank(s) {bad} built another sharded plan (or could not build one)"],
                                local_digest=mesh.digest)
    return mesh


# -- the bytes of a route, on each side -------------------------------------------------------------------
def local_items(mapping: dict) -> Iterator:
    """``(name, box, tensor)`` of a rank's ``{name: (box, tensor) or [(box, tensor), ...]}`` mapping."""
    for name, value in mapping.items():
        for box, t in ([value] if isinstance(value, tuple) else value):
            yield name, box, t


def local_part(mapping: dict, name: str, box: Box):
    """The bytes of ``box`` of tensor ``name`` in a rank's mapping: a view of the entry whose box contains it.
    KeyError: no entry of ``name``; ValueError: none contains ``box``, or a tensor not of its box's shape."""
    value = mapping[name]
    held = [value] if isinstance(value, tuple) else value
    for outer, t in held:
        if len(outer.start) == len(box.start) and outer.contains(box):
            if tuple(t.shape) != outer.shape:  # a negative slice start would wrap around: wrong bytes
                raise ValueError(f"{name}: this rank holds {outer} as a tensor of shape {tuple(t.shape)}, "
                                 f"which cannot give the piece {box} of its route")
            return t[box.index(outer)]
    raise ValueError(f"{name}: this rank holds {', '.join(str(b) for b, _ in held)}, not the piece {box} of "
                     "its route (built for another rank or plan?)")


def route_tensors(rt: Route, local: dict) -> Iterator:
    """The trainer side of route ``rt``: each piece of the rank's ``local`` bytes, contiguous, lazily."""
    for p in rt.pieces:
        yield local_part(local, p.tensor.name, p.box).contiguous()


def route_targets(rt: Route, live: dict) -> tuple[list, list]:
    """The engine side of route ``rt``: ``(targets, scatters)``: each piece in place when it is a contiguous
    part of its live tensor, else in a buffer of its own that its scatter copies in at commit."""
    targets, scatters = [], []
    for p in rt.pieces:
        view = local_part(live, p.tensor.name, p.box)
        if view.is_contiguous():
            targets.append(view)
            continue
        buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
        targets.append(buf)
        scatters.append(lambda view=view, buf=buf: view.copy_(buf))
    return targets, scatters


# -- what a rank holds: its bytes, the scales that go with a box --------------------------------------------
#: a rank's bytes by tensor name: ``(box, tensor)``, or a list of them for a tensor it holds several boxes of
Local = dict[str, "tuple[Box, torch.Tensor] | list[tuple[Box, torch.Tensor]]"]


def scales_box(values: Box, shape: Sequence[int], *, name: str = "", whole_blocks: bool = False) -> Box:
    """The box of the rowwise scales that goes with the box ``values`` of a tensor of full ``shape``: the same
    rows and every K block it overlaps; with ``whole_blocks``, ValueError for a K range that splits a
    block."""
    k0, k1, k = values.start[-1], values.stop[-1], int(shape[-1])
    if whole_blocks and k1 > k0 and (k0 % BLOCK_SIZE or (k1 % BLOCK_SIZE and k1 != k)):
        raise ValueError(f"{name}: the K range [{k0}, {k1}) of K = {k} cuts MXFP8 blocks of {BLOCK_SIZE} "
                         "(a K split must be a multiple of 32)")
    first = k0 // BLOCK_SIZE
    last = ceil_div(k1, BLOCK_SIZE) if k1 > k0 else first
    return Box((*values.start[:-1], first), (*values.stop[:-1], last))


def tensor_infos(items) -> list[TensorInfo]:
    """Plan items ``(name, role, dtype, shape)`` as :class:`TensorInfo` s."""
    return [TensorInfo(name, role, str(dtype).removeprefix("torch."), tuple(int(s) for s in shape))
            for name, role, dtype, shape in items]


def checked_local(t: torch.Tensor, h: Holding) -> torch.Tensor:
    """``t`` when it has the holding's box shape and dtype, else RuntimeError."""
    if tuple(t.shape) != h.box.shape or str(t.dtype).removeprefix("torch.") != h.tensor.dtype:
        raise RuntimeError(f"{h.tensor.name}: {tuple(t.shape)} {t.dtype} where the plan holds {h.box.shape} "
                           f"{h.tensor.dtype} (did the weight change shape, dtype or placement?)")
    return t
