"""Global plan build benchmark (issue 23): the seconds :class:`~mxport.refit.mesh.MeshPlan` takes to merge,
check and route a Qwen3-235B-A22B-shaped model (94 layers, 128 fused experts, hidden 4096, moe_intermediate
1536, 64 q / 4 kv heads of 128, vocab 151936: 1601 plan tensors) held as FSDP dim-0 shards by ``T`` trainer
ranks and needed by a ``tp = 8`` engine, as every rank builds it in :func:`~mxport.refit.mesh.agree` (after
every failure too): the tensors' merge and checks, the coverage check, the routes and the digest.

The holdings are built synthetically (no processes, no torch model): trainer rank ``t`` holds rows
``[t n / T, (t + 1) n / T)`` (``torch.chunk``'s split, as FSDP2's ``Shard(0)``) of every tensor, its scales the
same rows; engine rank ``e`` holds what :func:`mxport.refit.shards.engine_holdings` gives a vLLM ``tp = E``
rank (:func:`mxport.refit.shards.engine_boxes`).

Rows: one per trainer rank count (8, 64, 256; quick: 8, 64), the median seconds of a build (value) against
the goal of 1 s (baseline), and the plan's tensors, holdings and routes in the note.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ..refit.mesh import Box, Holding, MeshPlan, TensorInfo

GOAL_S = 1.0


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
        out += [(p + "self_attn.q_proj.weight", (q, m.hidden)), (p + "self_attn.k_proj.weight", (kv, m.hidden)),
                (p + "self_attn.v_proj.weight", (kv, m.hidden)), (p + "self_attn.o_proj.weight", (m.hidden, q)),
                (p + "self_attn.q_norm.weight", (m.head_dim,)), (p + "self_attn.k_norm.weight", (m.head_dim,)),
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
    from ..refit.shards import scales_box

    out = []
    for values, scales in tensors:
        box = Box.along(values.shape, 0, *chunk(values.shape[0], trainers, t))
        out.append(Holding(values, box))
        if scales is not None:
            out.append(Holding(scales, scales_box(box, values.shape)))
    return out


def tp_holdings(tensors, e: int, tp: int, kv_heads: int) -> list[Holding]:
    """What engine rank ``e`` of a vLLM ``tp`` engine needs (as :func:`~mxport.refit.shards.engine_holdings`)."""
    from ..layout import Layout
    from ..refit.shards import engine_boxes, scales_box

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
    """Every trainer rank's and engine rank's holdings of the MoE model (FSDP ``trainers`` -> tp ``engines``)."""
    tensors = plan_tensors(moe_entries(shape))
    return ([fsdp_holdings(tensors, t, trainers) for t in range(trainers)],
            [tp_holdings(tensors, e, engines, shape.kv_heads) for e in range(engines)])


def build(trainers, engines) -> MeshPlan:
    """What every rank computes from the gathered holdings: the plan, its routes and its digest."""
    mesh = MeshPlan(trainers, engines)
    mesh.routes, mesh.digest  # noqa: B018 - cached properties: computing them is the point
    return mesh


def time_build(trainers, engines, runs: int) -> tuple[float, MeshPlan]:
    """Median seconds of :func:`build` over ``runs`` (after one warm-up), and the last plan."""
    mesh, times = build(trainers, engines), []
    for _ in range(runs):
        t0 = time.perf_counter()
        mesh = build(trainers, engines)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), mesh


def run(quick: bool = False) -> list[dict]:
    rows = []
    for t in (8, 64) if quick else (8, 64, 256):
        trainers, engines = moe_mesh_holdings(t)
        seconds, mesh = time_build(trainers, engines, runs=3 if quick else 5)
        held = sum(map(len, trainers)) + sum(map(len, engines))
        rows.append({"benchmark": "mesh_plan", "metric": f"plan build, {t} trainer ranks -> tp=8",
                     "value": seconds, "unit": "s", "baseline": f"goal {GOAL_S:g} s", "ratio": seconds / GOAL_S,
                     "goal": f"<= {GOAL_S:g} s at 256 trainer ranks",
                     "note": f"Qwen3-235B-A22B-shaped, FSDP dim-0 shards: {len(mesh.tensors)} tensors, {held} "
                             f"holdings, {len(mesh.routes)} routes, digest {mesh.digest[:12]}"})
    return rows
