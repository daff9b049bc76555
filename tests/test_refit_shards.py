"""Sharded refit sources (mxport.refit.trainer, mxport.refit.engine): what each trainer rank holds and its
bytes, what each engine rank needs and where it lands, and the two meeting in a MeshPlan.

Two real gloo processes (world 2, CPU, spawned once, every wait bounded) shard tiny Llamas with FSDP2
(``fully_shard``: it runs on CPU / gloo in torch 2.13) and tensor parallel (ColwiseParallel / RowwiseParallel
via ``parallelize_module``); each rank returns its holdings and local bytes, before and after a real AdamW
step. Every byte is checked against :class:`~mxport.refit.TrainerSource` of the unsharded model (the same
plan entries; ``quantize`` of the full tensor cut with the box); then, without processes, every route of a
:class:`~mxport.refit.mesh.MeshPlan` is copied from ``route_tensors`` into ``route_targets`` of engine
buffers, and every engine rank's buffers must equal the full quantized tensors cut with its boxes.
"""

from __future__ import annotations

import datetime
import os
import queue
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from mxport.nn import quantize_model
from mxport.parallel import Layout, engine_shard
from mxport.policy import PrecisionPolicy
from mxport.refit import (
    HeldTensorsSource,
    RefitPlanMismatch,
    ShardedTrainerSource,
    TrainerSource,
    engine_buffers,
    engine_holdings,
)
from mxport.refit.items import model_tensors
from mxport.refit.mesh import (
    Box,
    MeshPlan,
    holdings_canonical,
    holdings_from_canonical,
    local_items,
    route_targets,
    route_tensors,
)
from mxport.refit.plan import dtype_from_name
from mxport.testing import make_tiny_llama, make_tiny_mixtral, make_tiny_qwen3_moe

PG_TIMEOUT = datetime.timedelta(seconds=30)
WAIT_S = 240.0
KEPT = torch.bfloat16
#: (trainer layout, model) pairs the two processes shard; llama96's down_proj K = 96 is 48 per TP rank (blocks
#: straddle: quantize_local gathers), llama128's is 64 (whole blocks)
SCENARIOS = (("fsdp", "llama128"), ("tp", "llama96"), ("tp", "llama128"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    kw = {"with_tokenizer": False}
    return {"llama96": str(make_tiny_llama(d / "llama96", intermediate=96, **kw)),
            "llama128": str(make_tiny_llama(d / "llama128", intermediate=128, **kw)),
            "llama_wide": str(make_tiny_llama(d / "wide", hidden=128, intermediate=128, **kw)),
            "qwen3moe": str(make_tiny_qwen3_moe(d / "qwen3moe", **kw)),
            "mixtral": str(make_tiny_mixtral(d / "mixtral", **kw))}


def _load(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _engine(path: str, policy=None):
    return quantize_model(_load(path, torch.bfloat16), policy)


def _reference(model, policy=None) -> tuple[list, dict]:
    """TrainerSource of the unsharded model: its plan items and every tensor's full bytes, by name."""
    src = TrainerSource(model, policy, kept_dtype=KEPT)
    ref = {e.name: t.clone() for e, t in zip(src.plan.entries, src.tensors(), strict=True)}
    return [(e.name, e.role, e.dtype, e.shape) for e in src.plan.entries], ref


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _mismatches(local: dict, ref: dict) -> list[str]:
    """Entries (``name[box]``) whose local bytes differ from the full reference cut with their box."""
    return [f"{n}{box}" for n, box, t in local_items(local)
            if not torch.equal(_u8(t), _u8(ref[n][box.index()]))]


def _items(holdings) -> list:
    return [(h.tensor.name, h.tensor.role, h.tensor.dtype, h.tensor.shape) for h in holdings]


def _refit(trainers: list, locals_: list, engines: list) -> tuple[MeshPlan, list[dict]]:
    """Every route of the MeshPlan copied trainer -> engine in process: route_tensors into route_targets of
    each engine rank's engine_buffers, scatters run."""
    mesh = MeshPlan(trainers, engines)
    buffers = [engine_buffers(h) for h in engines]
    for rt in mesh.routes:
        sent = route_tensors(rt, locals_[rt.trainer])
        targets, scatters = route_targets(rt, buffers[rt.engine - mesh.num_trainers])
        for dst, src in zip(targets, sent, strict=True):
            dst.copy_(src)
        for scatter in scatters:
            scatter()
    return mesh, buffers


def _assert_refit_exact(trainers, locals_, engines, ref) -> MeshPlan:
    mesh, buffers = _refit(trainers, locals_, engines)
    for e, (held, bufs) in enumerate(zip(engines, buffers, strict=True)):
        assert set(bufs) == {h.tensor.name for h in held}
        assert not _mismatches(bufs, ref), f"engine rank {e}: {_mismatches(bufs, ref)[:4]}"
    return mesh


# ---- real processes: FSDP2 and tensor parallel -------------------------------------------------------------
def _shard(model, kind: str, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.model.layers:
        if kind == "fsdp":
            fully_shard(layer, mesh=mesh)
        else:
            col, row = ColwiseParallel(), RowwiseParallel()
            parallelize_module(layer, mesh, {"self_attn.q_proj": col, "self_attn.k_proj": col,
                                             "self_attn.v_proj": col, "self_attn.o_proj": row,
                                             "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row})
    if kind == "fsdp":
        fully_shard(model, mesh=mesh)


def _wire(local: dict) -> dict:
    """Local bytes as plain Python data for the result queue (no shared-memory tensors)."""
    return {n: (box.canonical(), str(t.dtype).removeprefix("torch."), list(t.shape),
                _u8(t).flatten().numpy().tobytes()) for n, (box, t) in local.items()}


def _unwire(wired: dict) -> dict:
    out = {}
    for n, ((start, stop), dtype, shape, raw) in wired.items():
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        out[n] = (Box(tuple(start), tuple(stop)), t.view(dtype_from_name(dtype)).reshape(shape))
    return out


def _after_step(model, src) -> dict:
    """A real AdamW step (forward, backward, step) on the sharded model, then this rank's local() against
    quantize of the gathered full weights (full_tensor())."""
    from mxport.quantize import quantize
    from mxport.sources.dtensor import is_dtensor

    before = src.local()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.float().square().mean().backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    local = src.local()
    full = {n: (t.full_tensor() if is_dtensor(t) else t).detach() for n, t in model_tensors(model)}
    ref = {}
    for h in src.holdings:
        if h.tensor.role == "values":
            c = quantize(full[h.tensor.name])
            ref[h.tensor.name], scales = c.data, c.scale_inv
        elif h.tensor.role == "scales":
            ref[h.tensor.name] = scales
        else:
            ref[h.tensor.name] = full[h.tensor.name].to(KEPT)
    changed = [n for n in local if not torch.equal(_u8(local[n][1]), _u8(before[n][1]))]
    return {"mismatches": _mismatches(local, ref), "changed": len(changed), "tensors": len(local)}


def _trainer_ranks(rank: int, init: str, paths: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=init, timeout=PG_TIMEOUT)
    try:
        mesh = init_device_mesh("cpu", (2,))
        out = {}
        for kind, key in SCENARIOS:
            model = _load(paths[key])
            _shard(model, kind, mesh)
            src = ShardedTrainerSource(model, kept_dtype=KEPT)
            out[kind, key] = {"holdings": holdings_canonical(src.holdings), "local": _wire(src.local()),
                              "after_step": _after_step(model, src)}
        return out
    finally:
        dist.destroy_process_group()


def _entry(rank, init, paths, q):
    try:
        q.put((rank, "ok", _trainer_ranks(rank, init, paths)))
    except BaseException as exc:  # noqa: BLE001
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


@pytest.fixture(scope="module")
def trainer_ranks(models, tmp_path_factory):
    """Per scenario, per rank: (holdings, local) of ShardedTrainerSource, and the after-step check."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('store')}/store"
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_entry, args=(r, init, models, q), daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        results = {}
        while len(results) < 2:
            try:
                rank, status, val = q.get(timeout=WAIT_S)
            except queue.Empty:
                pytest.fail(f"timed out waiting for trainer ranks {set(range(2)) - set(results)}")
            assert status == "ok", f"rank {rank} failed: {val}"
            results[rank] = val
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return {s: [(holdings_from_canonical(results[r][s]["holdings"], r), _unwire(results[r][s]["local"]),
                 results[r][s]["after_step"]) for r in range(2)] for s in SCENARIOS}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s if isinstance(s, str) else "-".join(s))
def test_dtensor_holdings_are_trainer_source_plan_and_bytes_exact(trainer_ranks, models, scenario):
    items, ref = _reference(_load(models[scenario[1]]))
    for rank, (held, local, after) in enumerate(trainer_ranks[scenario]):
        assert _items(held) == items  # every rank: the unsharded TrainerSource plan, in order
        assert set(local) == {h.tensor.name for h in held}
        assert all(local[h.tensor.name][0] == h.box for h in held)
        assert not _mismatches(local, ref), f"rank {rank}: {_mismatches(local, ref)[:4]}"
        assert not after["mismatches"], f"rank {rank} after AdamW: {after['mismatches'][:4]}"
        assert after["changed"] > after["tensors"] // 2  # the step really moved the weights


@pytest.mark.slow
def test_dtensor_boxes(trainer_ranks):
    def boxes(scenario, name):
        return [next(str(h.box) for h in held if h.tensor.name == name)
                for held, _, _ in trainer_ranks[scenario]]

    fsdp, tp96 = trainer_ranks["fsdp", "llama128"], trainer_ranks["tp", "llama96"]
    k = "model.layers.0.self_attn.k_proj.weight"
    assert boxes(("fsdp", "llama128"), k) == ["[0:16,0:64]", "[16:32,0:64]"]
    assert boxes(("fsdp", "llama128"), "model.norm.weight") == ["[0:32]", "[32:64]"]
    assert len(fsdp[0][0]) == len(fsdp[1][0])
    # RowwiseParallel K = 96: 48 | 48, the block [32, 64) straddles; both ranks hold its scale byte
    name = "model.layers.1.mlp.down_proj.weight"
    assert boxes(("tp", "llama96"), name) == ["[0:64,0:48]", "[0:64,48:96]"]
    assert boxes(("tp", "llama96"), name + "_scale") == ["[0:64,0:2]", "[0:64,1:3]"]
    assert boxes(("tp", "llama96"), "model.layers.0.self_attn.o_proj.weight_scale") == ["[0:64,0:1]",
                                                                                         "[0:64,1:2]"]
    assert boxes(("tp", "llama96"), "lm_head.weight") == ["[0:256,0:64]"] * 2  # not parallelized: whole
    assert len(tp96[0][0]) == len(tp96[1][0])


@pytest.mark.slow
@pytest.mark.parametrize("scenario, engine_tp", [(("fsdp", "llama128"), 2), (("fsdp", "llama128"), 1),
                                                 (("tp", "llama96"), 1), (("tp", "llama128"), 2)],
                         ids=["fsdp2-tp2", "fsdp2-tp1", "tp2-tp1-straddle", "tp2-tp2"])
def test_dtensor_trainers_to_engine_ranks_end_to_end(trainer_ranks, models, scenario, engine_tp):
    _, ref = _reference(_load(models[scenario[1]]))
    eng = _engine(models[scenario[1]])
    engines = [engine_holdings(eng, Layout(tp=engine_tp), r) for r in range(engine_tp)]
    ranks = trainer_ranks[scenario]
    mesh = _assert_refit_exact([h for h, _, _ in ranks], [loc for _, loc, _ in ranks], engines, ref)
    assert {rt.trainer for rt in mesh.routes} == {0, 1}  # both trainer ranks send
    full = sum(Box.full(t.shape).numel * dtype_from_name(t.dtype).itemsize for t in mesh.tensors)
    if engine_tp == 2:
        assert all(b < full for b in mesh.engine_bytes())  # each engine rank gets its shard only
    else:
        assert mesh.engine_bytes() == [full]


# ---- in process: a model held whole, held names (pipeline, expert parallel) -------------------------------
def test_unsharded_model_is_held_whole_with_trainer_source_bytes(models):
    model = _load(models["llama96"])
    src = ShardedTrainerSource(model, kept_dtype=KEPT)
    items, ref = _reference(model)
    assert _items(src.holdings) == items
    assert all(h.box == Box.full(h.tensor.shape) for h in src.holdings)
    local = src.local()
    assert set(local) == set(ref) and not _mismatches(local, ref)
    eager = ShardedTrainerSource(model, kept_dtype=KEPT, kernel="eager").local()  # every kernel: same bytes
    assert not _mismatches(eager, ref)


def _stage_items(model, stage: int):
    """Pipeline stage ``stage`` of 2 of a 2-layer Llama: embeddings + layer 0, or layer 1 + norm + lm_head."""
    def items():
        for n, t in model_tensors(model):
            first = "embed_tokens" in n or ".layers.0." in n
            if first == (stage == 0):
                yield n, t.detach()
    return items


def _meta_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def test_pipeline_stages_decide_on_the_whole_model(models):
    """keep_last=1 keeps layer 1; stage 0 (layers 0 only) must not take its layer 0 for the last layer."""
    policy = PrecisionPolicy(keep_last=1)
    model = _load(models["llama96"])
    meta = _meta_model(models["llama96"])
    srcs = [HeldTensorsSource(_stage_items(model, s), names_and_shapes=meta, policy=policy, kept_dtype=KEPT)
            for s in range(2)]
    items, ref = _reference(model, policy)
    union = sorted(_items(srcs[0].holdings) + _items(srcs[1].holdings))
    assert union == sorted(items)
    assert "model.layers.0.self_attn.q_proj.weight_scale" in {h.tensor.name for h in srcs[0].holdings}
    assert srcs[1].held_names() == {n for n, _ in _stage_items(model, 1)()}
    engine = _engine(models["llama96"], policy)
    _assert_refit_exact([s.holdings for s in srcs], [s.local() for s in srcs],
                        [engine_holdings(engine, Layout(), 0)], ref)
    # without the whole model's list: refused, not decided on the stage's subset
    with pytest.raises(ValueError, match="pass names_and_shapes"):
        HeldTensorsSource(_stage_items(model, 0), policy=policy)
    # what deciding on the subset would do: stage 0 keeps its layer 0, the engine quantizes it
    alone = HeldTensorsSource(_stage_items(model, 0), policy=policy, kept_dtype=KEPT,
                              names_and_shapes=[(n, t.shape, t.dtype) for n, t in _stage_items(model, 0)()])
    with pytest.raises(RefitPlanMismatch, match="layers.0.self_attn.q_proj.weight"):
        MeshPlan([alone.holdings, srcs[1].holdings], [engine_holdings(engine, Layout(), 0)])


def _ep_items(model, rank: int, experts: int, replicated: bool):
    """Expert-parallel rank ``rank`` of 2: its half of every fused expert tensor (dim 0); the other tensors
    on both ranks (``replicated``) or on rank 0 only."""
    half = experts // 2

    def items():
        for n, t in model_tensors(model):
            if ".experts." in n and t.dim() == 3:
                yield n, t.detach()[rank * half:(rank + 1) * half], 0, rank * half, experts
            elif replicated or rank == 0:
                yield n, t.detach()
    return items


@pytest.mark.parametrize("key, replicated", [("qwen3moe", False), ("mixtral", True)])
def test_expert_parallel_ranks_to_engine_tp1_and_ep2(models, key, replicated):
    model = _load(models[key])
    srcs = [HeldTensorsSource(_ep_items(model, r, 4, replicated), kept_dtype=KEPT) for r in range(2)]
    _, ref = _reference(model)
    name = "model.layers.1.mlp.experts.down_proj"
    assert [str(next(h.box for h in s.holdings if h.tensor.name == name + "_scale")) for s in srcs] == \
        [f"[0:2,0:64,0:{2 if key == 'qwen3moe' else 3}]", f"[2:4,0:64,0:{2 if key == 'qwen3moe' else 3}]"]
    locals_ = [s.local() for s in srcs]
    engine = _engine(models[key])
    assert any(h.tensor.name == name + "_scale" for h in engine_holdings(engine, Layout(), 0))
    for layout in (Layout(), Layout(ep=2)):
        engines = [engine_holdings(engine, layout, r) for r in range(layout.ranks)]
        mesh = _assert_refit_exact([s.holdings for s in srcs], locals_, engines, ref)
        if layout.ep == 2:  # each engine rank gets its own experts from the trainer rank holding them
            experts = [rt for rt in mesh.routes if any(p.tensor.name == name for p in rt.pieces)]
            assert [(rt.trainer, rt.engine) for rt in experts] == [(0, 2), (1, 3)]


def test_held_tensors_refuse_bad_items(models):
    w = torch.randn(64, 96)
    with pytest.raises(ValueError, match=r"K range \[48, 96\) of K = 96 cuts MXFP8 blocks"):
        HeldTensorsSource(lambda: [("m.layers.0.mlp.down_proj.weight", w[:, 48:], 1, 48, 96)])
    ok = HeldTensorsSource(lambda: [("m.layers.0.mlp.down_proj.weight", w[:, 64:], 1, 64, 96)])
    assert [str(h.box) for h in ok.holdings] == ["[0:64,64:96]", "[0:64,2:3]"]
    with pytest.raises(ValueError, match="yields 'a.weight' twice"):
        HeldTensorsSource(lambda: [("a.weight", w), ("a.weight", w)])
    with pytest.raises(ValueError, match="lies outside its full size 8"):
        HeldTensorsSource(lambda: [("a.weight", w[:8], 0, 4, 8)])
    with pytest.raises(ValueError, match="names_and_shapes lacks"):
        HeldTensorsSource(lambda: [("a.weight", w)], names_and_shapes=[("b.weight", (64, 96), torch.float32)])
    with pytest.raises(ValueError, match=r"gives as \(64, 97\)"):
        HeldTensorsSource(lambda: [("a.weight", w)], names_and_shapes=[("a.weight", (64, 97), torch.float32)])
    state = {"w": w}
    src = HeldTensorsSource(lambda: [("a.weight", state["w"])])
    state["w"] = w[:32]
    with pytest.raises(ValueError, match="now yields 'a.weight' as"):
        src.local()


# ---- engine side -------------------------------------------------------------------------------------------
def _check_engine_boxes(engine, layout, kv_heads=None):
    """Every rank's boxes of a tensor (one, or one per block: a fused gate_up's gate and up rows) have
    engine_shard's shape together; a split tensor's distinct boxes tile it exactly."""
    ranks = [engine_holdings(engine, layout, r, kv_heads=kv_heads) for r in range(layout.ranks)]
    assert all([h.tensor for h in held] == [h.tensor for h in ranks[0]] for held in ranks)
    for t in dict.fromkeys(h.tensor for h in ranks[0]):
        boxes = [[h.box for h in held if h.tensor == t] for held in ranks]
        if t.role != "scales":
            shard = engine_shard(t.name, t.shape, layout, kv_heads=kv_heads)
            dim = shard.dim % len(t.shape) if shard.dim is not None else 0
            for bs in boxes:
                assert len(bs) == shard.blocks and all(b.shape[:dim] + b.shape[dim + 1:] == shard.shape[:dim]
                                                       + shard.shape[dim + 1:] for b in bs), (t.name, bs)
                assert sum(b.shape[dim] for b in bs) == shard.shape[dim], (t.name, bs, shard)
        distinct = {b for bs in boxes for b in bs}
        assert sum(b.numel for b in distinct) == Box.full(t.shape).numel, (t.name, boxes)
    return ranks


def test_engine_holdings_tp(models):
    engine = _engine(models["llama128"])
    one = _check_engine_boxes(engine, Layout())
    assert all(h.box == Box.full(h.tensor.shape) for h in one[0])
    two = _check_engine_boxes(engine, Layout(tp=2))
    box = {(r, h.tensor.name): str(h.box) for r, held in enumerate(two) for h in held}
    p = "model.layers.0."
    assert [box[r, p + "self_attn.k_proj.weight"] for r in (0, 1)] == ["[0:16,0:64]", "[16:32,0:64]"]
    assert [box[r, p + "self_attn.o_proj.weight_scale"] for r in (0, 1)] == ["[0:64,0:1]", "[0:64,1:2]"]
    assert [box[r, p + "mlp.down_proj.weight"] for r in (0, 1)] == ["[0:64,0:64]", "[0:64,64:128]"]
    assert [box[r, "lm_head.weight"] for r in (0, 1)] == ["[0:128,0:64]", "[128:256,0:64]"]
    assert [box[r, p + "input_layernorm.weight"] for r in (0, 1)] == ["[0:64]"] * 2
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight: K=96 split over tp=2 gives 48"):
        engine_holdings(_engine(models["llama96"]), Layout(tp=2), 1)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        engine_holdings(engine, Layout(tp=2), 2)
    with pytest.raises(ValueError, match="cut by tp and ep only"):
        engine_holdings(engine, Layout(pp=2), 0)


def test_engine_holdings_replicate_kv_heads(models):
    """tp=4 over 2 KV heads: ranks 0, 1 hold KV head 0, ranks 2, 3 head 1 (vLLM num_kv_head_replicas)."""
    model = _load(models["llama_wide"])
    engine = _engine(models["llama_wide"])
    ranks = _check_engine_boxes(engine, Layout(tp=4), kv_heads=2)
    assert ranks == [engine_holdings(engine, Layout(tp=4), r) for r in range(4)]  # kv_heads from the config
    k = "model.layers.1.self_attn.v_proj.weight"
    assert [str(next(h.box for h in held if h.tensor.name == k)) for held in ranks] == \
        ["[0:32,0:128]", "[0:32,0:128]", "[32:64,0:128]", "[32:64,0:128]"]
    one = HeldTensorsSource(lambda: ((n, t.detach()) for n, t in model_tensors(model)), kept_dtype=KEPT)
    _, ref = _reference(model)
    mesh = _assert_refit_exact([one.holdings], [one.local()], ranks, ref)
    assert len(set(mesh.engine_bytes())) == 1


def test_engine_holdings_ep(models):
    engine = _engine(models["qwen3moe"])
    ranks = _check_engine_boxes(engine, Layout(ep=2))
    n = "model.layers.0.mlp.experts.gate_up_proj"
    got = [[str(h.box) for h in held if h.tensor.name in (n, n + "_scale")] for held in ranks]
    assert got == [["[0:2,0:96,0:64]", "[0:2,0:96,0:2]"], ["[2:4,0:96,0:64]", "[2:4,0:96,0:2]"]]
    with pytest.raises(ValueError, match=r"experts.down_proj: K=48 split over tp=2"):
        engine_holdings(engine, Layout(tp=2), 0)


def test_engine_buffers_merge_qkv_and_gate_up(models):
    engine = _engine(models["llama128"])
    for tp in (1, 2):
        held = engine_holdings(engine, Layout(tp=tp), tp - 1)
        bufs = engine_buffers(held)
        assert set(bufs) == {h.tensor.name for h in held}
        assert all(bufs[h.tensor.name][0] == h.box and tuple(bufs[h.tensor.name][1].shape) == h.box.shape
                   and bufs[h.tensor.name][1].dtype == dtype_from_name(h.tensor.dtype) for h in held)
        assert all(not t.any() for _, t in bufs.values())
        for layer in (0, 1):
            for suffix in ("weight", "weight_scale"):
                for parts in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                              ("mlp.gate_proj", "mlp.up_proj")):
                    views = [bufs[f"model.layers.{layer}.{p}.{suffix}"][1] for p in parts]
                    assert all(v.is_contiguous() for v in views)
                    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
                    offsets = [v.storage_offset() for v in views]
                    assert offsets == [sum(v.numel() for v in views[:i]) for i in range(len(views))]
                    assert views[0].untyped_storage().nbytes() == sum(v.nbytes for v in views)
        o = bufs["model.layers.0.self_attn.o_proj.weight"][1]
        assert o.untyped_storage().nbytes() == o.nbytes  # not merged
    bf = engine_buffers(held, dtype_of=lambda info: torch.uint8)
    assert all(t.dtype == torch.uint8 for _, t in bf.values())


@pytest.mark.parametrize(("heads", "kv", "msg"), [
    (3, 3, r"3 attention heads do not divide by tp=2 \(vLLM refuses this layout; tp can be 1, 3\)"),
    (6, 3, r"3 KV heads and tp=2: one must divide the other \(vLLM refuses this layout; tp can be 1, 3, 6\)"),
])
def test_engine_holdings_refuse_heads_vllm_refuses(heads, kv, msg):
    """Rows split evenly (96 or 192 q rows over tp=2) would still cut heads apart: vLLM refuses the layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32 * heads, intermediate_size=32 * heads,
                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv)
    engine = LlamaForCausalLM(cfg).to(torch.bfloat16)
    quantize_model(engine)
    with pytest.raises(ValueError, match=msg):
        engine_holdings(engine, Layout(tp=2), 0)
    assert engine_holdings(engine, Layout(tp=heads), 0)  # tp = heads divides both
