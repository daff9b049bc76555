"""Sharded refit benchmark (issue 14): T trainer ranks -> E engine ranks, mxport's sharded MXFP8 refit against
the default path users have today, with the capacity model's predictions beside the measurements.

Every case starts ``T + E`` processes (spawned) on loopback gloo: one refit group of all of them
(:func:`mxport.refit.transport.open_group`; world ranks ``0 .. T-1`` the trainers, ``T .. T+E-1`` the engine
ranks), a trainer-only group (the baseline's gather) and a group of trainer rank 0 with the engine ranks (the
baseline's broadcast). The model is synthetic and linear only: ``L`` layers, each an ``up_proj``
``[F, H]`` (column parallel on the engine) and a ``down_proj`` ``[H, F]`` (row parallel), BF16, row-sharded
over the trainer ranks as FSDP2's ``fully_shard`` does (``Shard(0)``: rank ``t`` holds rows
``[t n / T, (t+1) n / T)``). Engine rank ``e`` holds what vLLM's tensor-parallel layers hold (``tp = E``:
:func:`mxport.parallel.engine_shard`).

Per refit, interleaved in every run (medians over ``--runs`` after a warm-up):

* **mxport sharded** — every trainer rank quantizes its own rows (``mxport.quantize``; rowwise blocks never
  cross rows, so the bytes are those of the full tensor's rows) lazily, bucket by bucket, and sends each
  engine rank only the pieces it holds (:class:`~mxport.refit.mesh.MeshPlan` routes,
  ``RefitSender`` / ``RefitReceiver`` over pair streams: one per (trainer, engine), checksums, one world
  vote);
* **baseline** (the default path today) — per weight, ``all_gather`` of the BF16 rows in the trainer group
  (what ``DTensor.full_tensor()`` does), a raw gloo ``broadcast`` of the full BF16 tensor from trainer
  rank 0 to the engine ranks, and each engine rank quantizes the slice it holds;
* **calibration** for the capacity model, in the same processes: the model's BF16 bytes sent point to point
  from trainer rank 0 to the first engine rank alone (one link's GB/s), then by every trainer rank at once,
  each its 1/T to engine rank ``t mod E`` (the GB/s all links share), trainer rank 0 quantizing its shard
  alone (G elements/s of one rank on a quiet machine), every trainer rank quantizing its shard at once
  (G elements/s per rank when the T ranks share the machine's cores), every engine rank quantizing its slice
  at once; the protocol's host passes, bucket by bucket over a buffer of the busiest engine rank's bytes:
  every rank copying (``copy_``) at once, every rank reading for checksums at once (the pack and checksum
  passes run while buckets are on the wire, in all T + E processes), and the engine ranks alone copying (the
  commit, after the vote).

Refit seconds run from a barrier to the last rank's end (``CLOCK_MONOTONIC``, shared by the processes).
After the runs every engine rank checks its bytes of both paths against ``quantize`` of the full tensor, cut
as it holds it (``bit_exact``).

Capacity model: :func:`mxport.capacity.predict` for the same tensors and layouts (``fsdp=T`` -> ``tp=E``),
with a :class:`~mxport.capacity.Hardware` from this run's calibration (``overlap=False``: on 2 cores the
quantize and the wire do not overlap), once with the quiet (solo) quantize rate and independent links, once
with the rate measured with all T trainer ranks quantizing at once and the shared bandwidth
(``Hardware.shared_gbps``), and once more with the protocol's host passes at the rates measured here
(``host``: ``Hardware.host_copy_gbps``, ``host_checksum_gbps``, ``host_commit_gbps``); predicted / measured
for both paths.

Behind ``mxport bench --only refit_sharded`` (:func:`run`: one row per case; ``--quick``: the ``tiny`` preset,
else ``quick``). The full report (every case's calibration and predictions, JSON) and the larger presets::

    python -m mxport.bench.refit_sharded --quick [--json out.json]   # or benchmarks/bench_refit_sharded.py
    python -m mxport.bench.refit_sharded                    # 64 MB and 256 MB, T = 2, 4; E = 1, 2
    python -m mxport.bench.refit_sharded --tiny --json -    # seconds: the test's mode
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_mod
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

BUCKET_BYTES = 8 << 20
ROW_CHUNK = 64  # weights are generated in chunks of this many rows (each seeded): any rank makes any rows


@dataclass(frozen=True)
class Size:
    """A synthetic model: ``layers`` x (``up_proj`` [ffn, hidden], ``down_proj`` [hidden, ffn]) in BF16."""

    layers: int
    hidden: int
    ffn: int

    @property
    def bf16_bytes(self) -> int:
        return self.layers * 2 * self.hidden * self.ffn * 2

    @property
    def label(self) -> str:
        return f"{self.bf16_bytes / 2**20:g} MiB BF16 ({self.layers} x [{self.ffn}x{self.hidden}] x 2)"


@dataclass(frozen=True)
class Case:
    trainers: int
    engines: int
    sizes: tuple[Size, ...]
    runs: int
    warmup: int
    bucket_bytes: int = BUCKET_BYTES
    timeout_s: float = 60.0
    ports: tuple[int, int, int] = (0, 0, 0)


@dataclass
class Timings:
    """Per-run seconds of one size in one case (filled on world rank 0)."""

    mxport: list = field(default_factory=list)
    mxport_quantize: list = field(default_factory=list)  # trainer quantize time inside the mxport refit (max)
    mxport_commit: list = field(default_factory=list)  # engine commit (staged -> live copies) time (max)
    baseline: list = field(default_factory=list)
    baseline_gather: list = field(default_factory=list)  # trainer rank 0's time in all_gather
    baseline_quantize: list = field(default_factory=list)  # engine quantize time inside the baseline (max)
    raw: list = field(default_factory=list)  # trainer rank 0 -> first engine rank alone (one link)
    raw_all: list = field(default_factory=list)  # every trainer rank -> an engine rank at once (shared)
    quant_solo: list = field(default_factory=list)
    quant_all: list = field(default_factory=list)
    engine_quant: list = field(default_factory=list)
    host_copy: list = field(default_factory=list)  # every rank copies, bucket by bucket, at once
    host_checksum: list = field(default_factory=list)  # every rank checksums, bucket by bucket, at once
    host_commit: list = field(default_factory=list)  # the engine ranks alone copy at once (the commit)


PRESETS = {  # name: (sizes, trainers, engines, runs, warmup)
    "full": ((Size(4, 1024, 4096), Size(16, 1024, 4096)), (2, 4), (1, 2), 5, 1),
    "quick": ((Size(4, 512, 2048), Size(16, 512, 2048)), (2, 4), (1, 2), 3, 1),
    "tiny": ((Size(1, 256, 512), Size(2, 256, 512)), (2,), (1,), 1, 0),
}


# -- the synthetic model ------------------------------------------------------------------------------------
def weights(size: Size) -> list[tuple[str, tuple[int, int]]]:
    """``(name, [rows, K])`` of every weight, in model order."""
    out = []
    for i in range(size.layers):
        out.append((f"model.layers.{i}.mlp.up_proj.weight", (size.ffn, size.hidden)))
        out.append((f"model.layers.{i}.mlp.down_proj.weight", (size.hidden, size.ffn)))
    return out


def weight_rows(index: int, shape: tuple[int, int], r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of weight ``index`` (BF16), the same whichever rank makes them."""
    chunks = []
    for c in range(r0 // ROW_CHUNK, -(-r1 // ROW_CHUNK)):
        g = torch.Generator().manual_seed(1_000_003 * index + c)
        rows = min(ROW_CHUNK, shape[0] - c * ROW_CHUNK)
        chunks.append(torch.randn(rows, shape[1], generator=g).to(torch.bfloat16))
    full = torch.cat(chunks)
    start = r0 - (r0 // ROW_CHUNK) * ROW_CHUNK
    return full[start:start + r1 - r0].contiguous()


def trainer_rows(shape: tuple[int, int], t: int, trainers: int) -> tuple[int, int]:
    """FSDP2 ``Shard(0)``: rows of trainer rank ``t`` (torch.chunk's split: ceil(n / T) per rank)."""
    per = -(-shape[0] // trainers)
    return min(t * per, shape[0]), min((t + 1) * per, shape[0])


def infos(name: str, shape: tuple[int, int]):
    from mxport.refit.mesh import TensorInfo

    blocks = -(-shape[1] // 32)
    return (TensorInfo(name, "values", "float8_e4m3fn", shape),
            TensorInfo(name + "_scale", "scales", "uint8", (shape[0], blocks)))


def scale_box(values, shape):
    """The compact scales that go with the values' box (mxport.refit.mesh.scales_box, whole blocks)."""
    from mxport.refit.mesh import scales_box

    return scales_box(values, shape, whole_blocks=True)


def trainer_holdings(size: Size, t: int, trainers: int) -> list:
    from mxport.refit.mesh import Box, Holding

    out = []
    for name, shape in weights(size):
        v, s = infos(name, shape)
        box = Box.along(shape, 0, *trainer_rows(shape, t, trainers))
        out += [Holding(v, box), Holding(s, scale_box(box, shape))]
    return out


def engine_box(name: str, shape: tuple[int, int], e: int, engines: int):
    """The box engine rank ``e`` of a ``tp = engines`` engine holds (vLLM's column / row parallel slicing)."""
    from mxport.parallel import Layout, engine_shard
    from mxport.refit.mesh import Box

    shard = engine_shard(name, shape, Layout(tp=engines), quantized=True)
    if shard.problem:
        raise ValueError(shard.problem)
    if shard.dim is None:
        return Box.full(shape)
    dim = shard.dim % 2
    n = shard.shape[dim]
    return Box.along(shape, dim, min(e * n, shape[dim]), min((e + 1) * n, shape[dim]))


def engine_holdings(size: Size, e: int, engines: int) -> list:
    from mxport.refit.mesh import Holding

    out = []
    for name, shape in weights(size):
        v, s = infos(name, shape)
        box = engine_box(name, shape, e, engines)
        out += [Holding(v, box), Holding(s, scale_box(box, shape))]
    return out


# -- the processes -----------------------------------------------------------------------------------------
def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class Rank:
    """One process of a case: its groups and its role."""

    def __init__(self, rank: int, case: Case):
        from mxport.refit.transport import TorchDistTransport, open_group

        self.rank, self.case = rank, case
        self.T, self.E = case.trainers, case.engines
        self.is_trainer = rank < self.T
        world_pg = open_group("127.0.0.1", case.ports[0], rank, self.T + self.E, timeout_s=case.timeout_s,
                              prefix="bench-world")
        self.world = TorchDistTransport.from_group(world_pg)
        self.trainer_pg = self.bcast_pg = None
        if self.is_trainer:
            self.trainer_pg = open_group("127.0.0.1", case.ports[1], rank, self.T, timeout_s=case.timeout_s,
                                         prefix="bench-trainers")
        if rank == 0 or not self.is_trainer:
            r = 0 if rank == 0 else rank - self.T + 1
            self.bcast_pg = open_group("127.0.0.1", case.ports[2], r, self.E + 1, timeout_s=case.timeout_s,
                                       prefix="bench-bcast")

    def barrier(self) -> None:
        self.world.all_gather(torch.zeros(1))

    def timed(self, fn) -> tuple[float, float, float]:
        """``(start, end, extra)`` of ``fn()`` on this rank after a world barrier (``extra``: what fn
        returns, a number, or 0)."""
        self.barrier()
        t0 = _now()
        extra = fn()
        return t0, _now(), float(extra or 0.0)

    def gather_rows(self, rows: list[tuple[float, float, float]]) -> list[list[tuple[float, float, float]]]:
        """Every rank's timed rows (same count on every rank), indexed [rank][row]."""
        flat = torch.tensor([v for r in rows for v in r], dtype=torch.float64)
        got = self.world.all_gather(flat)
        return [[tuple(x[i:i + 3].tolist()) for i in range(0, len(x), 3)] for x in got]

    def close(self) -> None:
        for pg in (self.bcast_pg, self.trainer_pg, self.world.group):
            if pg is not None and hasattr(pg, "shutdown"):
                try:
                    pg.shutdown()
                except RuntimeError:
                    pass


def _bcast(pg, buf: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([buf], opts).wait()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class TrainerSide:
    """A trainer rank's part of one model size: its BF16 rows, its pair streams, the baseline's buffers."""

    def __init__(self, r: Rank, size: Size):
        from mxport.refit import RefitSender
        from mxport.refit.mesh import agree
        from mxport.refit.world import pair_order

        self.r, self.size = r, size
        self.local = {}
        for i, (name, shape) in enumerate(weights(size)):
            r0, r1 = trainer_rows(shape, r.rank, r.T)
            if (r1 - r0) * r.T != shape[0]:
                raise ValueError(f"{name}: {shape[0]} rows do not split evenly over {r.T} trainer ranks")
            self.local[name] = (r0, weight_rows(i, shape, r0, r1))
        self.mesh = agree(r.world, r.T, trainer_holdings(size, r.rank, r.T))
        order = pair_order(range(r.T), range(r.T, r.T + r.E))
        routes = {rt.engine: rt for rt in self.mesh.routes_of(r.rank)}
        self.routes = [routes[e] for t, e in order if t == r.rank and e in routes]
        pairs = [(rt.engine, rt.plan()) for rt in self.routes]
        self.sender = RefitSender.for_pairs(r.world, pairs, global_digest=self.mesh.digest,
                                            trainers=range(r.T), bucket_bytes=r.case.bucket_bytes)
        self.sender.handshake()
        self.full = {shape: torch.empty(shape, dtype=torch.bfloat16) for _, shape in weights(size)}

    def mxport(self) -> float:
        """One sharded refit; returns the seconds spent quantizing (lazily, inside the send)."""
        from mxport import quantize
        from mxport.refit.mesh import Box

        done, spent = {}, [0.0]

        def held(name: str):
            base = name.removesuffix("_scale")
            if base not in done:
                r0, x = self.local[base]
                t0 = time.perf_counter()
                c = quantize(x)
                spent[0] += time.perf_counter() - t0
                vbox = Box((r0, 0), (r0 + x.shape[0], x.shape[1]))
                done[base] = (vbox, c.data), (scale_box(vbox, x.shape), c.scale_inv)
            return done[base][name != base]

        def stream(rt):
            for p in rt.pieces:
                box, t = held(p.tensor.name)
                yield t[p.box.index(box)].contiguous()

        self.sender.send({rt.engine: stream(rt) for rt in self.routes})
        return spent[0]

    def baseline(self) -> float:
        """Per weight: all_gather the BF16 rows (full_tensor()), trainer rank 0 broadcasts the full tensor.
        Returns the seconds spent gathering."""
        spent = 0.0
        for name, shape in weights(self.size):
            _, x = self.local[name]
            out = self.full[shape]
            parts = [_as_bytes(p) for p in out.chunk(self.r.T)]
            t0 = time.perf_counter()
            self.r.trainer_pg.allgather([parts], [_as_bytes(x)]).wait()
            spent += time.perf_counter() - t0
            if self.r.rank == 0:
                _bcast(self.r.bcast_pg, _as_bytes(out))
        return spent

    def quantize_all(self) -> None:
        from mxport import quantize

        for _, x in self.local.values():
            quantize(x)

    def quantize_solo(self) -> None:
        if self.r.rank == 0:
            self.quantize_all()

    def local_elements(self) -> int:
        return sum(x.numel() for _, x in self.local.values())


class EngineSide:
    """An engine rank's part of one model size: its live MXFP8 tensors (mxport path), the baseline's."""

    def __init__(self, r: Rank, size: Size):
        from mxport.refit import RefitReceiver
        from mxport.refit.mesh import agree, route_targets
        from mxport.refit.plan import dtype_from_name
        from mxport.refit.world import pair_order

        self.r, self.size, self.e = r, size, r.rank - r.T
        holdings = engine_holdings(size, self.e, r.E)
        self.mesh = agree(r.world, r.T, holdings)
        self.live = {h.tensor.name: (h.box, torch.zeros(h.box.shape, dtype=dtype_from_name(h.tensor.dtype)))
                     for h in holdings}
        order = pair_order(range(r.T), range(r.T, r.T + r.E))
        routes = {rt.trainer: rt for rt in self.mesh.routes_of(r.rank)}
        pairs, self.scatters = [], []
        for t, e in order:
            if e == r.rank and t in routes:
                targets, scatters = route_targets(routes[t], self.live)
                pairs.append((t, routes[t].plan(), targets))
                self.scatters += scatters
        self.receiver = RefitReceiver.for_pairs(r.world, pairs, global_digest=self.mesh.digest,
                                                trainers=range(r.T), bucket_bytes=r.case.bucket_bytes)
        self.receiver.handshake()
        self.slices = {}  # this rank's BF16 slice of every weight (calibration and the bit-exact check)
        for i, (name, shape) in enumerate(weights(size)):
            box = engine_box(name, shape, self.e, r.E)
            self.slices[name] = weight_rows(i, shape, 0, shape[0])[box.index()]
        self.full = {shape: torch.empty(shape, dtype=torch.bfloat16) for _, shape in weights(size)}
        self.base = {}

    def mxport(self) -> float:
        """One sharded refit; returns the seconds of its commit (staged bytes -> live tensors)."""
        stats = self.receiver.receive()
        for s in self.scatters:
            s()
        return stats.commit_s

    def baseline(self) -> float:
        """Per weight: receive the full BF16 tensor, quantize the slice this rank holds. Returns the seconds
        spent quantizing."""
        from mxport import quantize

        spent = 0.0
        for name, shape in weights(self.size):
            full = self.full[shape]
            _bcast(self.r.bcast_pg, _as_bytes(full))
            t0 = time.perf_counter()
            self.base[name] = quantize(full[engine_box(name, shape, self.e, self.r.E).index()])
            spent += time.perf_counter() - t0
        return spent

    def quantize_slices(self) -> None:
        from mxport import quantize

        for x in self.slices.values():
            quantize(x)

    def bit_exact(self) -> bool:
        """Both paths' bytes equal ``quantize`` of this rank's slice of the full tensor."""
        from mxport import quantize

        ok = True
        for name, x in self.slices.items():
            ref = quantize(x)
            for got, want in ((self.live[name][1], ref.data), (self.live[name + "_scale"][1], ref.scale_inv),
                              (self.base[name].data, ref.data), (self.base[name].scale_inv, ref.scale_inv)):
                ok &= bool(torch.equal(got.view(torch.uint8), want.view(torch.uint8)))
        return ok

    def local_elements(self) -> int:
        return sum(x.numel() for x in self.slices.values())


KINDS = ("mxport", "baseline", "raw", "raw_all", "quant_solo", "quant_all", "engine_quant", "host_copy",
         "host_checksum", "host_commit")
RAW_TAG = 7  # the calibration's point-to-point messages (the pair streams use mxport.refit's PAIR_TAG)


def _raw_one(r: Rank, buf: torch.Tensor) -> None:
    """One link alone: trainer rank 0 sends ``buf`` to the first engine rank."""
    pg = r.world.process_group
    if r.rank == 0:
        pg.send([buf], r.T, RAW_TAG).wait()
    elif r.rank == r.T:
        pg.recv([buf], 0, RAW_TAG).wait()


def _raw_all(r: Rank, buf: torch.Tensor) -> None:
    """Every link at once: trainer rank ``t`` sends its 1/T of the bytes to engine rank ``t mod E``."""
    pg, share = r.world.process_group, buf.numel() // r.T
    if r.is_trainer:
        pg.send([buf[:share]], r.T + r.rank % r.E, RAW_TAG).wait()
        return
    works = [pg.recv([buf[i * share:(i + 1) * share]], t, RAW_TAG)
             for i, t in enumerate(t for t in range(r.T) if t % r.E == r.rank - r.T)]
    for w in works:
        w.wait()


def _host_pass(src: torch.Tensor, dst: torch.Tensor, bucket: int, copy: bool) -> None:
    """One pass of the refit protocol over ``dst``'s bytes, bucket by bucket: a ``copy_`` from ``src`` (pack,
    commit) or a read for the checksum (mxport.refit.buckets.checksum)."""
    from mxport.refit.buckets import checksum

    for i in range(0, dst.numel(), bucket):
        out = dst[i:i + bucket]
        if copy:
            out.copy_(src[i:i + out.numel()])
        else:
            checksum(out)


def run_size(r: Rank, size: Size) -> dict | None:
    """Every run of one model size on this rank; world rank 0 returns the timings and counts."""
    side = TrainerSide(r, size) if r.is_trainer else EngineSide(r, size)
    flat = torch.zeros(size.bf16_bytes, dtype=torch.uint8)
    # the host passes' buffer: the busiest engine rank's bytes (a multiple of 8, as bucket payloads are)
    staged = torch.zeros(max(side.mesh.engine_bytes()) // 8 * 8, dtype=torch.uint8)
    bucket = r.case.bucket_bytes
    idle = lambda: None  # noqa: E731 - a rank with nothing to do in this step
    steps = {"mxport": side.mxport, "baseline": side.baseline,
             "raw": lambda: _raw_one(r, flat), "raw_all": lambda: _raw_all(r, flat),
             "quant_solo": side.quantize_solo if r.is_trainer else idle,
             "quant_all": side.quantize_all if r.is_trainer else idle,
             "engine_quant": idle if r.is_trainer else side.quantize_slices,
             "host_copy": lambda: _host_pass(flat, staged, bucket, True),
             "host_checksum": lambda: _host_pass(flat, staged, bucket, False),
             "host_commit": idle if r.is_trainer else lambda: _host_pass(flat, staged, bucket, True)}
    tm = Timings()
    for i in range(r.case.warmup + r.case.runs):
        rows = r.gather_rows([r.timed(steps[k]) for k in KINDS])
        if i >= r.case.warmup and r.rank == 0:
            _collect(tm, rows, r.T)
    flags = r.world.all_gather(torch.tensor([1 if r.is_trainer else int(side.bit_exact())]))
    elems = r.world.all_gather(torch.tensor([side.local_elements()], dtype=torch.int64))
    if r.rank != 0:
        return None
    return {"size": asdict(size), "bf16_bytes": size.bf16_bytes, "routes": len(side.mesh.routes),
            "mxport_engine_bytes": side.mesh.engine_bytes(), "timings": asdict(tm),
            "trainer_elements": int(elems[0]), "engine_elements": int(elems[r.T]),
            "host_pass_bytes": staged.numel(),
            "bit_exact": all(bool(f) for f in flags)}


def _collect(tm: Timings, rows: list, trainers: int) -> None:
    """One run's seconds from every rank's ``(start, end, extra)`` rows (indexed [rank][kind])."""
    def span(k: int, ranks) -> float:
        return max(rows[q][k][1] for q in ranks) - min(rows[q][k][0] for q in ranks)

    world = range(len(rows))
    tr, en = range(trainers), range(trainers, len(rows))
    tm.mxport.append(span(0, world))
    tm.mxport_quantize.append(max(rows[q][0][2] for q in tr))
    tm.mxport_commit.append(max(rows[q][0][2] for q in en))
    tm.baseline.append(span(1, world))
    tm.baseline_gather.append(rows[0][1][2])
    tm.baseline_quantize.append(max(rows[q][1][2] for q in en))
    tm.raw.append(span(2, [0, trainers]))
    tm.raw_all.append(span(3, world))
    tm.quant_solo.append(rows[0][4][1] - rows[0][4][0])
    tm.quant_all.append(span(5, tr))
    tm.engine_quant.append(span(6, en))
    tm.host_copy.append(span(7, world))
    tm.host_checksum.append(span(8, world))
    tm.host_commit.append(span(9, en))


def _worker(rank: int, case: Case, q) -> None:
    torch.set_num_threads(1)
    r = None
    try:
        r = Rank(rank, case)
        out = [run_size(r, size) for size in case.sizes]
        q.put(("ok", rank, out))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"))
    finally:
        if r is not None:
            r.close()


def _free_ports(n: int) -> tuple[int, ...]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


def run_case(case: Case, deadline_s: float) -> list[dict]:
    """Start the case's T + E processes and return world rank 0's results (RuntimeError on any failure or
    after ``deadline_s``)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    case = Case(**{**asdict(case), "sizes": case.sizes, "ports": _free_ports(3)})
    world = case.trainers + case.engines
    procs = [ctx.Process(target=_worker, args=(r, case, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    end, out = time.monotonic() + deadline_s, None
    try:
        for _ in range(world):
            try:
                status, rank, val = q.get(timeout=max(1.0, end - time.monotonic()))
            except queue_mod.Empty:
                raise RuntimeError(f"T={case.trainers} E={case.engines}: no result within {deadline_s:.0f} s"
                                   ) from None
            if status != "ok":
                raise RuntimeError(f"T={case.trainers} E={case.engines}: rank {rank} failed: {val}")
            if rank == 0:
                out = val
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return out


# -- figures and the capacity model --------------------------------------------------------------------------
def _entries(size: Size) -> list:
    return [(name, shape, torch.bfloat16) for name, shape in weights(size)]


def predictions(res: dict, case: Case, cal: dict) -> dict:
    """The capacity model's figures for this run's shapes and layouts, with the quiet (solo) trainer quantize
    rate and with the rate of T trainer ranks quantizing at once (both measured in this run)."""
    from mxport.capacity import Hardware, predict
    from mxport.parallel import Layout

    size = Size(**res["size"])
    out = {}
    solo = Hardware(link_gbps=cal["link_gbps"], trainer_quantize_gelems=cal["trainer_quantize_gelems_solo"],
                    engine_quantize_gelems=cal["engine_quantize_gelems"], overlap=False)
    concurrent = Hardware(**{**asdict(solo), "shared_gbps": cal["shared_gbps"],
                             "trainer_quantize_gelems": cal["trainer_quantize_gelems_concurrent"]})
    host = Hardware(**{**asdict(concurrent), "host_copy_gbps": cal["host_copy_gbps"],
                       "host_checksum_gbps": cal["host_checksum_gbps"],
                       "host_commit_gbps": cal["host_commit_gbps"]})
    for label, hw in (("solo", solo), ("concurrent", concurrent), ("host", host)):
        p = predict(_entries(size), Layout(fsdp=case.trainers), Layout(tp=case.engines), hw,
                    bucket_bytes=case.bucket_bytes)
        out[label] = {"mxport_s": p.mxfp8.seconds, "baseline_s": p.bf16.seconds,
                      "mxport_quantize_s": p.mxfp8.quantize_seconds, "mxport_wire_s": p.mxfp8.wire_seconds,
                      "mxport_host_s": p.mxfp8.host_seconds, "passes": p.passes.to_dict(),
                      "baseline_gather_s": p.bf16.gather_seconds, "baseline_wire_s": p.bf16.wire_seconds,
                      "baseline_quantize_s": p.bf16.quantize_seconds,
                      "bytes_per_engine_rank": p.mxfp8.bytes_per_engine_rank,
                      "baseline_bytes_per_engine_rank": p.bf16.bytes_per_engine_rank}
    return out


def case_row(res: dict, case: Case, load: tuple) -> dict:
    """One (T, E, size) row of the report from world rank 0's raw timings."""
    med, tm = statistics.median, res["timings"]
    bf16, mx_engine = res["bf16_bytes"], res["mxport_engine_bytes"]
    share = bf16 // case.trainers * case.trainers
    cal = {"link_gbps": bf16 / med(tm["raw"]) / 1e9, "shared_gbps": share / med(tm["raw_all"]) / 1e9,
           "trainer_quantize_gelems_solo": res["trainer_elements"] / med(tm["quant_solo"]) / 1e9,
           "trainer_quantize_gelems_concurrent": res["trainer_elements"] / med(tm["quant_all"]) / 1e9,
           "engine_quantize_gelems": res["engine_elements"] / med(tm["engine_quant"]) / 1e9,
           "host_copy_gbps": res["host_pass_bytes"] / med(tm["host_copy"]) / 1e9,
           "host_checksum_gbps": res["host_pass_bytes"] / med(tm["host_checksum"]) / 1e9,
           "host_commit_gbps": res["host_pass_bytes"] / med(tm["host_commit"]) / 1e9}
    mx_s, base_s = med(tm["mxport"]), med(tm["baseline"])
    pred = predictions(res, case, cal)
    for p in pred.values():
        p["mxport_over_measured"] = p["mxport_s"] / mx_s
        p["baseline_over_measured"] = p["baseline_s"] / base_s
    return {"trainers": case.trainers, "engines": case.engines, "model": Size(**res["size"]).label,
            "size": res["size"], "bf16_bytes": bf16, "routes": res["routes"], "bit_exact": res["bit_exact"],
            "mxport": {"bytes_per_engine_rank": mx_engine, "bytes_total": sum(mx_engine), "seconds": mx_s,
                       "runs_s": tm["mxport"], "quantize_s": med(tm["mxport_quantize"]),
                       "commit_s": med(tm["mxport_commit"])},
            "baseline": {"bytes_per_engine_rank": [bf16] * case.engines, "bytes_total": bf16 * case.engines,
                         "gather_bytes": (case.trainers - 1) * bf16, "seconds": base_s,
                         "runs_s": tm["baseline"], "gather_s": med(tm["baseline_gather"]),
                         "quantize_s": med(tm["baseline_quantize"])},
            "ratio": base_s / mx_s, "bytes_ratio": max(mx_engine) / bf16,
            "calibration": cal, "predicted": pred, "runs": case.runs,
            "load_before": load[0], "load_after": load[1]}


def growth(rows: list[dict]) -> list[dict]:
    """How each path's time grows (ratios of median seconds): twice the trainer ranks (same E and size), and
    the next larger model (same T and E)."""
    by = {(r["trainers"], r["engines"], r["bf16_bytes"]): r for r in rows}

    def ratio(o: dict, r: dict, **what) -> dict:
        return {**what, "mxport": o["mxport"]["seconds"] / r["mxport"]["seconds"],
                "baseline": o["baseline"]["seconds"] / r["baseline"]["seconds"]}

    out = []
    for (t, e, b), r in sorted(by.items()):
        if (2 * t, e, b) in by:
            out.append(ratio(by[(2 * t, e, b)], r, what=f"T {t} -> {2 * t}", engines=e, bf16_bytes=b,
                             trainers=[t, 2 * t]))
        bigger = sorted(bb for tt, ee, bb in by if (tt, ee) == (t, e) and bb > b)
        if bigger:
            out.append(ratio(by[(t, e, bigger[0])], r, what=f"size x{bigger[0] / b:g}", trainers=t, engines=e,
                             bf16_bytes=b))
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'T':>2} {'E':>2} {'model BF16':>10} {'mx B/engine':>11} {'bf16 B/engine':>13} {'mxport s':>9} "
            f"{'baseline s':>10} {'ratio':>6} {'pred mx (solo/conc/host)':>24} {'pred base':>9} {'exact':>5}")
    lines = [head]
    for r in rows:
        p = r["predicted"]
        lines.append(
            f"{r['trainers']:>2} {r['engines']:>2} {r['bf16_bytes'] / 1e6:>8.1f}MB "
            f"{max(r['mxport']['bytes_per_engine_rank']) / 1e6:>9.1f}MB {r['bf16_bytes'] / 1e6:>11.1f}MB "
            f"{r['mxport']['seconds']:>9.3f} {r['baseline']['seconds']:>10.3f} {r['ratio']:>6.2f} "
            f"{p['solo']['mxport_over_measured']:>9.2f}/{p['concurrent']['mxport_over_measured']:.2f}/"
            f"{p['host']['mxport_over_measured']:<9.2f} "
            f"{p['concurrent']['baseline_over_measured']:>9.2f} {'yes' if r['bit_exact'] else 'NO':>5}")
    return "\n".join(lines)


def run_report(preset: str = "quick", trainers=None, engines=None, runs: int | None = None,
               timeout_s: float = 60.0) -> dict:
    """Every case of ``preset`` (``trainers`` / ``engines`` / ``runs`` override it); the report dict."""
    sizes, t_list, e_list, n_runs, warmup = PRESETS[preset]
    t0 = time.monotonic()
    rows = []
    for e in engines or e_list:
        for t in trainers or t_list:
            case = Case(t, e, sizes, runs or n_runs, warmup, timeout_s=timeout_s)
            before = os.getloadavg()
            results = run_case(case, deadline_s=timeout_s * (4 + 2 * case.runs) * len(sizes))
            load = (before, os.getloadavg())
            rows += [case_row(res, case, load) for res in results]
    from mxport.bench.report import machine

    return {"benchmark": "refit_sharded", "preset": preset, "machine": machine(), "cases": rows,
            "growth": growth(rows), "seconds": time.monotonic() - t0}


def bench_rows(report: dict) -> list[dict]:
    """The report's cases as ``mxport bench`` rows: per case, mxport's sharded refit seconds against the
    default path's (gather BF16 + broadcast + engine quantize, same run; ratio = baseline / mxport)."""
    rows = []
    for c in report["cases"]:
        mx, base = c["mxport"], c["baseline"]
        predicted = c["predicted"]["host"]["mxport_over_measured"]
        rows.append({"benchmark": "refit_sharded", "value": mx["seconds"], "unit": "s", "ratio": c["ratio"],
                     "metric": f"sharded refit T={c['trainers']} -> E={c['engines']}, "
                               f"{c['bf16_bytes'] / 1e6:.1f} MB BF16",
                     "baseline": f"gather BF16 + broadcast + engine quantize {base['seconds']:.3f} s "
                                 "(same run)",
                     "goal": "informational",
                     "note": f"{c['runs']} runs; bytes per engine rank {max(mx['bytes_per_engine_rank'])} vs "
                             f"{c['bf16_bytes']} BF16; bit_exact {c['bit_exact']}; capacity model predicted "
                             f"/ measured (host) {predicted:.2f}"})
    return rows


def run(quick: bool = False) -> list[dict]:
    """``mxport bench``'s rows: the ``tiny`` preset with ``quick``, else ``quick`` (the full preset takes
    minutes: ``python -m mxport.bench.refit_sharded``). RuntimeError when an engine rank's bytes are not
    those of quantizing the full tensor."""
    report = run_report("tiny" if quick else "quick")
    bad = [f"T={c['trainers']} E={c['engines']}" for c in report["cases"] if not c["bit_exact"]]
    if bad:
        raise RuntimeError(f"sharded refit bytes differ from quantize of the full tensor: {bad}")
    return bench_rows(report)


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="16 and 64 MiB models, 3 runs")
    mode.add_argument("--tiny", action="store_true", help="0.5 and 1 MiB, T=2 E=1, 1 run (seconds; tests)")
    ap.add_argument("--trainers", type=_ints, help="trainer ranks, e.g. 2,4")
    ap.add_argument("--engines", type=_ints, help="engine ranks (tensor parallel), e.g. 1,2")
    ap.add_argument("--runs", type=int, help="timed runs per case (after one warm-up)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a group waits on a peer (60)")
    ap.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': stdout)")
    args = ap.parse_args(argv)
    preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    report = run_report(preset, args.trainers, args.engines, args.runs, args.timeout)
    text = json.dumps(report, indent=1)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(table(report["cases"]), file=out)
    for g in report["growth"]:
        print(f"growth {g}", file=out)
    print(f"{report['seconds']:.1f} s", file=out)
    if args.json == "-":
        print(text)
    elif args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if all(r["bit_exact"] for r in report["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
