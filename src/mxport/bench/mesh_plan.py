"""Global plan build benchmark (issue 23): the seconds a rank takes to build the sharded refit's plan
(:class:`~mxport.refit.mesh.MeshPlan`) of a Qwen3-235B-A22B-shaped model (94 layers, 128 fused experts, hidden
4096, moe_intermediate 1536, 64 q / 4 kv heads of 128, vocab 151936: 1601 plan tensors) held as FSDP dim-0
shards by ``T`` trainer ranks and needed by a ``tp = 8`` engine, as every rank builds it in
:func:`~mxport.refit.mesh.agree` (after every failure too): every rank's holdings decoded from JSON and
checked, the tensors merged, the coverage checked, the digest; then its own routes.

The holdings are built synthetically (no processes, no torch model): trainer rank ``t`` holds rows
``[t n / T, (t + 1) n / T)`` (``torch.chunk``'s split, as FSDP2's ``Shard(0)``) of every tensor, its scales
the same rows; engine rank ``e`` holds what :func:`mxport.refit.engine.engine_holdings` gives a vLLM
``tp = E`` rank (:func:`mxport.refit.engine.engine_boxes`).

Rows: two per trainer rank count (8, 64, 256; quick: 8, 64), the seconds until every rank has its plan and
its routes (the median plan build, plus the slower of a trainer rank's and an engine rank's routes) against
the goal of 1 s (baseline), each part in the note: the plan from every rank's holdings (:class:`MeshPlan` and
its digest: the goal), and the plan as :func:`~mxport.refit.mesh.agree` builds it from every rank's JSON (the
decode and its checks too). Figures before and after the index: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

from ..refit.mesh import Box, Holding, MeshPlan, TensorInfo, holdings_canonical, mesh_from_json

GOAL_S = 1.0
GOAL = f"ratio <= 1 ({GOAL_S:g} s at 256 trainer ranks)"


@dataclass(frozen=True)
class MoeShape:
    """The sizes of a Qwen3-MoE causal LM (fused 3-D experts, as transformers builds them)."""

    layers: int = 94
    experts: int = 128
    hidden: int = 4096
    moe_intermediate: int = 1536
    heads: int = 64
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 151936


QWEN3_235B = MoeShape()


def moe_entries(m: MoeShape) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of the model, in model order (transformers' Qwen3-MoE names)."""
    out = [("model.embed_tokens.weight", (m.vocab, m.hidden))]
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    for i in range(m.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out += [(a + "q_proj.weight", (q, m.hidden)), (a + "k_proj.weight", (kv, m.hidden)),
                (a + "v_proj.weight", (kv, m.hidden)), (a + "o_proj.weight", (m.hidden, q)),
                (a + "q_norm.weight", (m.head_dim,)), (a + "k_norm.weight", (m.head_dim,)),
                (p + "mlp.experts.gate_up_proj", (m.experts, 2 * m.moe_intermediate, m.hidden)),
                (p + "mlp.experts.down_proj", (m.experts, m.hidden, m.moe_intermediate)),
                (p + "mlp.gate.weight", (m.experts, m.hidden)), (p + "input_layernorm.weight", (m.hidden,)),
                (p + "post_attention_layernorm.weight", (m.hidden,))]
    return out + [("model.norm.weight", (m.hidden,)), ("lm_head.weight", (m.vocab, m.hidden))]


def plan_tensors(entries: list[tuple[str, tuple[int, ...]]]) -> list[tuple[TensorInfo, TensorInfo | None]]:
    """``(values or kept, scales or None)`` per model tensor, as the default policy decides (BF16 weights)."""
    import torch

    from ..components import compact_scale_shape
    from ..policy import PrecisionPolicy
    from ..refit.items import tensor_items

    out = []
    for d in PrecisionPolicy().decide_all([(n, s, torch.bfloat16) for n, s in entries]):
        if d.quantize:
            items = tensor_items(d.name, torch.float8_e4m3fn, d.shape,
                                 scales=(torch.uint8, compact_scale_shape(d.shape)))
        else:
            items = tensor_items(d.name, torch.bfloat16, d.shape)
        infos = [TensorInfo(n, role, str(dt).removeprefix("torch."), tuple(s)) for n, role, dt, s in items]
        out.append((infos[0], infos[1] if len(infos) == 2 else None))
    return out


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """``torch.chunk``'s ``[start, stop)`` of part ``i`` of ``n`` in ``parts`` (ceil(n / parts) each)."""
    per = -(-n // parts)
    return min(i * per, n), min((i + 1) * per, n)


def fsdp_holdings(tensors, t: int, trainers: int) -> list[Holding]:
    """What FSDP trainer rank ``t`` of ``trainers`` holds: dim-0 shards of every tensor, scales alike."""
    from ..refit.mesh import scales_box

    out = []
    for values, scales in tensors:
        box = Box.along(values.shape, 0, *chunk(values.shape[0], trainers, t))
        out.append(Holding(values, box))
        if scales is not None:
            out.append(Holding(scales, scales_box(box, values.shape)))
    return out


def tp_holdings(tensors, e: int, tp: int, kv_heads: int) -> list[Holding]:
    """What engine rank ``e`` of a vLLM ``tp`` engine needs (as
    :func:`~mxport.refit.engine.engine_holdings`)."""
    from ..parallel import Layout
    from ..refit.engine import engine_boxes
    from ..refit.mesh import scales_box

    out, layout = [], Layout(tp=tp)
    for values, scales in tensors:
        boxes = engine_boxes(values.name, values.shape, layout, e, kv_heads, scales is not None)
        out += [Holding(values, b) for b in boxes]
        if scales is not None:
            out += [Holding(scales, scales_box(b, values.shape, name=values.name, whole_blocks=True))
                    for b in boxes]
    return out


def moe_mesh_holdings(trainers: int, engines: int = 8, shape: MoeShape = QWEN3_235B
                      ) -> tuple[list[list[Holding]], list[list[Holding]]]:
    """Every trainer rank's and engine rank's holdings of the MoE model (FSDP ``trainers`` -> tp
    ``engines``)."""
    tensors = plan_tensors(moe_entries(shape))
    return ([fsdp_holdings(tensors, t, trainers) for t in range(trainers)],
            [tp_holdings(tensors, e, engines, shape.kv_heads) for e in range(engines)])


@dataclass(frozen=True)
class BuildTimes:
    """Median seconds of the plan builds of one mesh: from every rank's holdings (:class:`MeshPlan` and its
    digest), and as :func:`~mxport.refit.mesh.agree` does it, from every rank's holdings as JSON bytes
    (:func:`~mxport.refit.mesh.mesh_from_json`: decode and check them too); then a trainer rank's and an
    engine rank's routes on the plan."""

    plan: float
    from_json: float
    trainer_routes: float
    engine_routes: float

    @property
    def routes(self) -> float:
        """The slower rank's routes: every rank has its routes this long after its plan."""
        return max(self.trainer_routes, self.engine_routes)


def time_build(trainers, engines, runs: int) -> tuple[BuildTimes, MeshPlan]:
    """:class:`BuildTimes` (medians over ``runs``, after one warm-up) of fresh plans each run, routes of
    trainer rank 0 and the first engine rank; and the last plan."""
    texts = [json.dumps(holdings_canonical(held), separators=(",", ":")).encode()
             for held in (*trainers, *engines)]
    samples, mesh = [], None
    for _ in range(runs + 1):
        mesh = None  # the last run's plan is freed outside the timings
        t0 = time.perf_counter()
        plan = MeshPlan(trainers, engines)
        plan.digest  # noqa: B018 - a cached property: computing it is the point
        t1 = time.perf_counter()
        del plan
        t2 = time.perf_counter()
        mesh = mesh_from_json(texts, len(trainers))
        t3 = time.perf_counter()
        mesh.routes_of(0)
        t4 = time.perf_counter()
        mesh.routes_of(mesh.engine_rank(0))
        samples.append((t1 - t0, t3 - t2, t4 - t3, time.perf_counter() - t4))
    return BuildTimes(*(statistics.median(s[i] for s in samples[1:]) for i in range(4))), mesh


def run(quick: bool = False) -> list[dict]:
    rows = []
    for t in (8, 64) if quick else (8, 64, 256):
        trainers, engines = moe_mesh_holdings(t)
        times, mesh = time_build(trainers, engines, runs=3 if quick else 5)
        held = sum(map(len, trainers)) + sum(map(len, engines))
        pieces = sum(len(r.pieces) for r in mesh.routes_of(mesh.engine_rank(0)))
        about = (f"Qwen3-235B-A22B-shaped, FSDP dim-0 shards: {len(mesh.tensors)} tensors, {held} holdings; "
                 f"then routes of trainer rank 0 {times.trainer_routes:.3f} s, of engine rank 0 "
                 f"{times.engine_routes:.3f} s ({pieces} pieces); digest {mesh.digest[:12]}")
        for metric, seconds, goal, what in (
                (f"plan build, {t} trainer ranks -> tp=8", times.plan, GOAL if t == 256 else "informational",
                 f"plan + digest {times.plan:.3f} s"),
                (f"plan from every rank's JSON (agree), {t} trainer ranks", times.from_json, "informational",
                 f"decode + check + plan + digest {times.from_json:.3f} s")):
            value = seconds + times.routes
            rows.append({"benchmark": "mesh_plan", "metric": metric, "value": value, "unit": "s",
                         "baseline": f"goal {GOAL_S:g} s", "ratio": value / GOAL_S, "goal": goal,
                         "note": f"{what}; {about}"})
    return rows
