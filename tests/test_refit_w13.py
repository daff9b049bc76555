"""A fused expert ``gate_up_proj`` on engine tp ranks, held as vLLM's ``FusedMoE`` ``w13_weight``.

vLLM (tp > 1, ep 1) holds ``mlp.experts.gate_up_proj`` ``[E, 2I, K]`` (gate rows ``[0, I)``, up rows
``[I, 2I)``) on tp rank ``r`` as ``w13_weight`` ``[E, 2I/tp, K]``: gate rows ``[r*I/tp, (r+1)*I/tp)`` then up
rows ``[I + r*I/tp, I + (r+1)*I/tp)`` (``fused_moe/layer.py`` ``_load_w13``: gate (``w1``) and up (``w3``)
narrowed separately, each into its half); its E8M0 scales ``[E, 2I/tp, K/32]`` the same rows. A contiguous
``[r*2I/tp, (r+1)*2I/tp)`` slice (all gate on rank 0 at tp 2) is consistent bytes in the wrong layout.

Here: the boxes :func:`engine_holdings` gives, and a tiny Qwen3-MoE refit end to end through
:class:`~mxport.refit.mesh.MeshPlan` routes (from one trainer rank and from two expert-parallel ones) into
:func:`engine_buffers`: each engine rank's merged buffer must be ``cat([gate[r], up[r]])`` of quantize of the
full tensor, values and scales, byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from mxport.nn import quantize_model
from mxport.parallel import Layout, engine_shard
from mxport.quantize import quantize
from mxport.refit import (
    HeldTensorsSource,
    ShardedTrainerSource,
    TrainerSource,
    engine_buffers,
    engine_holdings,
)
from mxport.refit.items import model_tensors
from mxport.refit.mesh import MeshPlan, local_items, route_targets, route_tensors
from mxport.testing import make_tiny_qwen3_moe

KEPT = torch.bfloat16
E, INTER, K = 4, 64, 64  # experts, moe_intermediate (down_proj's K: 32 per tp rank), hidden
GATE_UP = "model.layers.{}.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    return str(make_tiny_qwen3_moe(tmp_path_factory.mktemp("w13") / "m", moe_intermediate=INTER, experts=E,
                                   hidden=K, with_tokenizer=False))


def _load(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_engine_shard_of_a_fused_gate_up_is_two_row_ranges():
    name = GATE_UP.format(0)
    s = engine_shard(name, (E, 2 * INTER, K), Layout(tp=2), quantized=True)
    assert (s.dim, s.parts, s.blocks, s.shape, s.problem) == (-2, 2, 2, (E, INTER, K), "")
    assert [s.ranges(2 * INTER, r) for r in range(2)] == [[(0, 32), (64, 96)], [(32, 64), (96, 128)]]
    assert engine_shard(name, (E, 2 * INTER, K), Layout(tp=4)).ranges(2 * INTER, 3) == [(48, 64), (112, 128)]
    ep = engine_shard(name, (E, 2 * INTER, K), Layout(ep=2))  # expert parallel: experts split, rows whole
    assert (ep.dim, ep.blocks, ep.ranges(E, 1)) == (0, 1, [(2, 4)])
    assert engine_shard(name, (E, 2 * INTER, K), Layout()).ranges(2 * INTER, 0) == [(0, 2 * INTER)]
    plain = engine_shard("m.layers.0.mlp.gate_proj.weight", (64, 32), Layout(tp=2))
    assert (plain.blocks, plain.ranges(64, 1)) == (1, [(32, 64)])
    assert "cannot be gate | up" in engine_shard(name, (E, 7, K), Layout(tp=2)).problem


def test_engine_holdings_give_vllm_w13_rows(qwen3moe):
    engine = quantize_model(_load(qwen3moe, KEPT))
    for r in range(2):
        held = engine_holdings(engine, Layout(tp=2), r)
        n = GATE_UP.format(1)
        got = [str(h.box) for h in held if h.tensor.name in (n, n + "_scale")]
        lo, hi = 32 * r, 32 * (r + 1)
        assert got == [f"[0:4,{lo}:{hi},0:64]", f"[0:4,{64 + lo}:{64 + hi},0:64]",
                       f"[0:4,{lo}:{hi},0:2]", f"[0:4,{64 + lo}:{64 + hi},0:2]"]
        down = [str(h.box) for h in held if h.tensor.name == "model.layers.1.mlp.experts.down_proj"]
        assert down == [f"[0:4,0:64,{lo}:{hi}]"]  # row parallel: K split, one box


def _ep_items(model, rank: int):
    """Expert-parallel trainer rank ``rank`` of 2: its experts of every fused expert tensor, the rest
    whole."""
    half = E // 2

    def items():
        for n, t in model_tensors(model):
            if ".experts." in n and t.dim() == 3:
                yield n, t.detach()[rank * half:(rank + 1) * half], 0, rank * half, E
            else:
                yield n, t.detach()
    return items


def _refit(trainers, locals_, engines) -> list[dict]:
    """Every MeshPlan route copied trainer -> engine in process (scatters run): each engine rank's buffers."""
    mesh = MeshPlan(trainers, engines)
    buffers = [engine_buffers(h) for h in engines]
    for rt in mesh.routes:
        targets, scatters = route_targets(rt, buffers[rt.engine - mesh.num_trainers])
        for dst, src in zip(targets, route_tensors(rt, locals_[rt.trainer]), strict=True):
            dst.copy_(src)
        for scatter in scatters:
            scatter()
    return buffers


def _merged(entries) -> torch.Tensor:
    """The one buffer under a name's (gate, up) views, as flat bytes; checked to be exactly those two (a
    single ``(box, tensor)``: its bytes)."""
    if isinstance(entries, tuple):
        return _u8(entries[1]).flatten()
    (_, g), (_, u) = entries
    storage = g.untyped_storage()
    assert u.untyped_storage().data_ptr() == storage.data_ptr() and g.storage_offset() == 0
    assert storage.nbytes() == g.nbytes + u.nbytes
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@pytest.mark.parametrize("trainer", ["one", "ep2"])
def test_tp2_engine_w13_buffers_equal_gate_then_up_of_quantize(qwen3moe, trainer):
    model = _load(qwen3moe)
    if trainer == "one":
        srcs = [ShardedTrainerSource(model, kept_dtype=KEPT)]
    else:
        srcs = [HeldTensorsSource(_ep_items(model, r), kept_dtype=KEPT) for r in range(2)]
    engine = quantize_model(_load(qwen3moe, KEPT))
    engines = [engine_holdings(engine, Layout(tp=2), r) for r in range(2)]
    buffers = _refit([s.holdings for s in srcs], [s.local() for s in srcs], engines)
    full = dict(model_tensors(model))
    for layer in range(model.config.num_hidden_layers):
        name = GATE_UP.format(layer)
        c = quantize(full[name].detach())
        for r, bufs in enumerate(buffers):
            rows = slice(32 * r, 32 * (r + 1))
            for key, q in ((name, c.data), (name + "_scale", c.scale_inv)):
                gate, up = q[:, :INTER][:, rows], q[:, INTER:][:, rows]
                want = torch.cat([gate, up], dim=1)  # vLLM's w13 on tp rank r: [E, 2I/tp, K | K/32]
                assert want.shape == (E, INTER, q.shape[-1])
                assert torch.equal(_merged(bufs[key]), _u8(want).flatten()), (trainer, r, key)
        down = f"model.layers.{layer}.mlp.experts.down_proj"
        cd = quantize(full[down].detach())
        for r, bufs in enumerate(buffers):
            assert torch.equal(_u8(bufs[down][1]), _u8(cd.data[..., 32 * r:32 * (r + 1)]))
            assert torch.equal(_u8(bufs[down + "_scale"][1]), _u8(cd.scale_inv[..., r:r + 1]))
    # every other byte too: each entry is the unsharded TrainerSource's tensor (quantize of the full tensor,
    # kept ones in bf16) cut with its box
    src = TrainerSource(model, kept_dtype=KEPT)
    ref = {e.name: t for e, t in zip(src.plan.entries, src.tensors(), strict=True)}
    for bufs in buffers:
        bad = [f"{n}{b}" for n, b, t in local_items(bufs) if not torch.equal(_u8(t), _u8(ref[n][b.index()]))]
        assert not bad, bad[:4]
