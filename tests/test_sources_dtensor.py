"""quantize_local: each rank's MXFP8 bytes of a DTensor equal quantize(full_tensor()) sliced as the rank
holds it.

Single-process: the local-vs-gather rule (gather_dims) over shapes and placements, plain tensors, bad input.
Multi-process (4 real gloo processes on loopback, spawned once, every wait bounded): FSDP2 ``fully_shard`` and
tensor parallel (ColwiseParallel / RowwiseParallel) on 2-rank meshes, FSDP2 over TP on a 2x2 mesh
(``_StridedShard``), for every parameter on every rank, before and after an AdamW step, with E4M3 rceil,
E5M2 floor and 32x32 blocks.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import mxport
from mxport.sources.dtensor import LocalMXFP8, gather_dims, quantize_local
from mxport.testing import spawn_world

PG_TIMEOUT = datetime.timedelta(seconds=30)
WAIT_S = 120.0
VARIANTS = {"e4m3": (torch.float8_e4m3fn, "rceil", False), "e5m2-floor": (torch.float8_e5m2, "floor", False),
            "2d": (torch.float8_e4m3fn, "rceil", True)}


# ---- the rule, single process ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, mesh, placements, block_2d, want", [
    ((192, 576), (2,), [Shard(0)], False, ()),           # rows: always local
    ((33, 64), (2,), [Shard(0)], False, ()),             # uneven rows 17 / 16
    ((1, 64), (2,), [Shard(0)], False, ()),              # an empty shard
    ((64, 48), (2,), [Shard(0)], False, ()),             # K = 48: a partial block, inside every row
    ((64, 576), (2,), [Shard(1)], False, ()),            # K per rank 288 = 9 blocks
    ((64, 80), (2,), [Shard(1)], False, (0,)),           # K per rank 40: block [32, 64) straddles
    ((64, 127), (2,), [Shard(-1)], False, ()),           # 64 | 63: the second shard ends at K
    ((64, 96), (3,), [Shard(1)], False, ()),             # 32 | 32 | 32
    ((64, 96), (2,), [Shard(1)], False, (0,)),           # 48 | 48
    ((100,), (2,), [Shard(0)], False, (0,)),             # 1-D: dim 0 is K
    ((128,), (2,), [Shard(0)], False, ()),
    ((192, 576), (2,), [Shard(0)], True, ()),            # 96-row shards: whole 32x32 blocks
    ((100, 64), (2,), [Shard(0)], True, (0,)),           # 50-row shards straddle 32-row groups
    ((80, 64), (2,), [Shard(0)], True, (0,)),            # 40 | 40: the second starts mid-group
    ((4, 32, 64), (2,), [Shard(0)], True, ()),           # experts: 2 x 32 rows per shard
    ((4, 40, 64), (2,), [Shard(1)], True, (0,)),         # rows of a middle dim: not one range of (M, K)
    ((4, 40, 64), (2,), [Shard(1)], False, ()),
    ((100, 64), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], False, ()),   # FSDP2 over TP colwise
    ((128, 64), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], True, ()),    # 32-row shards
    ((100, 64), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], True, (0, 1)),
    ((64, 100), (2, 2), [Shard(0), Shard(1)], False, (1,)),                          # FSDP2 x TP rowwise
    ((64, 128), (2, 2), [Shard(0), Shard(1)], False, ()),
    ((64, 128), (2, 2), [Replicate(), Shard(1)], False, ()),
    ((64, 160), (2, 2), [Shard(1), Shard(1)], False, (0, 1)),                        # 80 -> 40 | 40
])
def test_gather_dims_rule(shape, mesh, placements, block_2d, want):
    assert gather_dims(shape, mesh, placements, block_2d=block_2d) == want


def test_gather_dims_refuses_partial_and_bad_placements():
    with pytest.raises(ValueError, match="Partial placement on mesh dimension 1"):
        gather_dims((64, 64), (2, 2), [Shard(0), Partial()])
    with pytest.raises(ValueError, match="one entry per mesh dimension"):
        gather_dims((64, 64), (2, 2), [Shard(0)])
    with pytest.raises(ValueError, match="shard dimension 2"):
        gather_dims((64, 64), (2,), [Shard(2)])


def test_gather_dims_refuses_shards_that_are_not_ranges():
    # Shard(0) then _StridedShard(0, sf=2) on a (2, 2) mesh: rows {0, 2}, {1, 3}, ... (torch's own example)
    with pytest.raises(ValueError, match="shards of dimension 0 are not contiguous ranges"):
        gather_dims((8, 64), (2, 2), [Shard(0), _StridedShard(0, split_factor=2)])


def test_plain_tensor_is_quantized_whole():
    w = torch.randn(33, 80, dtype=torch.bfloat16)
    r = quantize_local(w, torch.float8_e5m2, rounding="floor")
    ref = mxport.quantize(w, torch.float8_e5m2, rounding="floor")
    assert isinstance(r, LocalMXFP8) and not r.gathered and r.global_offset == (0, 0)
    assert r.global_shape == (33, 80) and r.placements == () and r.shape == (33, 80)
    assert torch.equal(r.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(r.scale_inv, ref.scale_inv) and r.scale_inv.shape == (33, 3)
    assert r.values_index() == (slice(0, 33), slice(0, 80))
    assert r.scales_index() == (slice(0, 33), slice(0, 3))
    d = r.to_dict()
    assert d["gathered"] is False and d["scale_shape"] == [33, 3] and d["block_aligned"] is True
    assert torch.equal(r.components().dequantize(), ref.dequantize())
    p = torch.nn.Parameter(w.float())  # a parameter that requires grad
    assert torch.equal(quantize_local(p).scale_inv, mxport.quantize(w.float()).scale_inv)


def test_slice_starting_mid_block_dequantizes_and_refuses_components():
    """A K slice [40, 80) of K = 80 (what a gathered RowwiseParallel rank holds): blocks 1 and 2 overlap
    it."""
    full = mxport.quantize(torch.randn(8, 80) * torch.logspace(-3, 3, 80))
    r = LocalMXFP8(full.data[:, 40:], full.scale_inv[:, 1:], (8, 80), (0, 40), ("Shard(dim=1)",), (2,),
                   True, (0,))
    assert r.scales_index() == (slice(0, 8), slice(1, 3)) and not r.block_aligned
    assert torch.equal(r.dequantize(), full.dequantize()[:, 40:])
    with pytest.raises(ValueError, match=r"slice \[40, 80\) of K = 80 cuts blocks"):
        r.components()
    head = LocalMXFP8(full.data[:, :40], full.scale_inv[:, :2], (8, 80), (0, 0), (), (2,), True, (0,))
    assert head.scales_index() == (slice(0, 8), slice(0, 2)) and not head.block_aligned
    assert torch.equal(head.dequantize(), full.dequantize()[:, :40])


@pytest.mark.parametrize("bad, err, match", [
    (torch.arange(64), TypeError, "dt must be a float32"),
    (torch.zeros(4, 32, dtype=torch.float8_e4m3fn), TypeError, "dt must be a float32"),
    (torch.tensor(1.0), ValueError, "dt must have at least one dimension"),
    ([1.0, 2.0], TypeError, "dt must be a torch.Tensor"),
])
def test_bad_input(bad, err, match):
    with pytest.raises(err, match=match):
        quantize_local(bad)


# ---- real processes ----------------------------------------------------------------------------------------
def _check_param(name, p, variant):
    """quantize_local(p) against quantize(p.full_tensor()) cut at its offsets: one dict per call."""
    fp8, rounding, block_2d = VARIANTS[variant]
    full = p.full_tensor()
    ref = mxport.quantize(full, fp8, rounding=rounding, block_2d=block_2d)
    r = quantize_local(p, fp8, rounding=rounding, block_2d=block_2d)
    local = p.to_local()
    scales_ok = torch.equal(r.scale_inv, ref.scale_inv[r.scales_index()])
    return {
        "name": name, "variant": variant, "gathered": r.gathered, "placements": r.placements,
        "parameter_ok": isinstance(p, torch.nn.Parameter) and type(local) is torch.Tensor,
        "shape_ok": r.shape == tuple(local.shape) and r.global_shape == tuple(full.shape),
        "offset_ok": torch.equal(full[r.values_index()], local),  # the offset really locates the local shard
        "values_ok": torch.equal(r.data.view(torch.uint8), ref.data[r.values_index()].view(torch.uint8)),
        "scales_ok": scales_ok,
        "dtype_ok": r.data.dtype == fp8 and r.scale_inv.dtype == torch.uint8,
        "dequantize_ok": scales_ok and torch.equal(r.dequantize(), ref.dequantize()[r.values_index()]),
        "components_ok": not r.block_aligned or torch.equal(r.components().scale_inv, r.scale_inv),
    }


def _check_all(model, phase):
    out = []
    for variant in VARIANTS:
        for name, p in model.named_parameters():
            out.append({"phase": phase, **_check_param(name, p, variant)})
    return out


def _adamw_step(model, inputs):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    loss = sum(layer(x).square().mean() for layer, x in zip(model.values(), inputs, strict=True))
    loss.backward()
    opt.step()


def _spread(model):
    """Weights whose block scales vary: rows 2**U(-8, 8) apart, columns rising 2**-4 .. 2**4 along K.

    Default Linear init (uniform in +-1/sqrt(K)) gives nearly every block the same scale, so a block cut in
    the wrong place would go unseen; here regrouping rows or shifting blocks along K changes the scales."""
    g = torch.Generator().manual_seed(0)  # every rank builds the same weights
    with torch.no_grad():
        for p in model.parameters():
            rows = torch.exp2(torch.rand(p.shape[:-1], generator=g) * 16 - 8).unsqueeze(-1)
            p.copy_(torch.randn(p.shape, generator=g) * rows * torch.exp2(torch.linspace(-4, 4, p.shape[-1])))
    return model


def _fsdp_tp_models(mesh_1d):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    lin = torch.nn.Linear
    fsdp = _spread(torch.nn.ModuleDict({"q": lin(576, 192), "a": lin(64, 100), "b": lin(48, 64, bias=False),
                                        "c": lin(64, 33), "one": lin(64, 1, bias=False)}))
    for layer in fsdp.values():
        fully_shard(layer, mesh=mesh_1d)
    tp = _spread(torch.nn.ModuleDict({"row288": lin(576, 64), "row40": lin(80, 64, bias=False),
                                      "row127": lin(127, 32, bias=False), "col": lin(64, 100)}))
    row = RowwiseParallel(input_layouts=Replicate())  # the test feeds whole inputs
    parallelize_module(tp, mesh_1d, {"row288": row, "row40": row, "row127": row, "col": ColwiseParallel()})
    ins = {"q": 576, "a": 64, "b": 48, "c": 64, "one": 64,
           "row288": 576, "row40": 80, "row127": 127, "col": 64}
    return fsdp, tp, ins


def _one_d(mesh):
    """FSDP2 and tensor parallel on a 1-D mesh of 2 ranks (before and after AdamW), and a Partial refused."""
    from torch.distributed.tensor import DTensor

    fsdp, tp, ins = _fsdp_tp_models(mesh)
    res = _check_all(fsdp, "fsdp") + _check_all(tp, "tp")
    g = torch.Generator().manual_seed(1)
    _adamw_step(fsdp, [torch.randn(4, ins[n], generator=g) for n in fsdp])
    _adamw_step(tp, [torch.randn(4, ins[n], generator=g) for n in tp])
    res += _check_all(fsdp, "fsdp-after-adamw") + _check_all(tp, "tp-after-adamw")
    partial = DTensor.from_local(torch.randn(4, 64), mesh, [Partial()])
    try:
        quantize_local(partial)
        return res, "accepted"
    except ValueError as exc:
        return res, str(exc)


def _fsdp_over_tp(mesh):
    """FSDP2 over tensor parallel on a 2x2 (dp, tp) mesh (before and after AdamW)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    lin = torch.nn.Linear
    model = _spread(torch.nn.ModuleDict({"col100": lin(64, 100), "col128": lin(64, 128, bias=False),
                                         "row100": lin(100, 64, bias=False), "row128": lin(128, 64)}))
    row = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(model, mesh["tp"], {"col100": ColwiseParallel(), "col128": ColwiseParallel(),
                                           "row100": row, "row128": row})
    for layer in model.values():
        fully_shard(layer, mesh=mesh["dp"])
    res = _check_all(model, "2x2")
    g = torch.Generator().manual_seed(1)
    _adamw_step(model, [torch.randn(4, n, generator=g) for n in (64, 64, 100, 128)])
    return res + _check_all(model, "2x2-after-adamw")


def _four_ranks(rank, init):
    """One world of 4 processes (one spawn: imports dominate the cost): the 1-D scenarios on each 2-rank
    ``tp`` row of the (dp, tp) mesh, then the 2x2 scenario on the whole mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4, init_method=init, timeout=PG_TIMEOUT)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        rows, partial = _one_d(mesh["tp"])
        return {"1d": rows, "partial": partial, "2x2": _fsdp_over_tp(mesh)}
    finally:
        dist.destroy_process_group()


def _spawn(fn, world, tmp_path):
    """Run ``fn(rank, init)`` on ``world`` spawned processes; their results by rank (bounded by WAIT_S)."""
    env = {"MXPORT_DISABLE_COMPILE": os.environ.get("MXPORT_DISABLE_COMPILE", "1")}
    try:
        return spawn_world(fn, world, tmp_path, wait_s=WAIT_S, env=env)
    except RuntimeError as exc:
        pytest.fail(str(exc))


def _assert_exact(rows, want_gathered):
    for row in rows:
        bad = [k for k, v in row.items() if k.endswith("_ok") and not v]
        assert not bad, f"{row['phase']} {row['name']} {row['variant']} {row['placements']}: {bad}"
        want = (row["name"], row["variant"]) in want_gathered
        where = f"{row['phase']} {row['name']} {row['variant']}"
        assert row["gathered"] == want, f"{where}: gathered={row['gathered']}"


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawn(_four_ranks, 4, tmp_path_factory.mktemp("dtensor"))


@pytest.mark.slow
def test_fsdp2_and_tensor_parallel_on_two_ranks(four_ranks):
    # K split (RowwiseParallel's Shard(1); Shard(0) of a 1-D bias, whose only dim is K): gathered unless the
    # shards are whole blocks (row288: 288 | 288, row127: 64 | 63 ending at K, q.bias: 96 | 96)
    k_split = {"row40.weight", "col.bias", "a.bias", "c.bias"}
    # 32x32 blocks: row shards of 50 | 50 (a, col) and 17 | 16 (c) cut 32-row groups; q (96 | 96),
    # b (32 | 32) and one (1 | 0 rows: ends at the tensor's end) do not
    rows_2d = {"a.weight", "c.weight", "col.weight"}
    want = {(n, v) for n in k_split for v in VARIANTS} | {(n, "2d") for n in rows_2d}
    for res in four_ranks.values():
        assert "Partial placement on mesh dimension 0" in res["partial"], res["partial"]
        assert len(res["1d"]) == 2 * len(VARIANTS) * 14  # 2 phases x variants x 14 parameters
        _assert_exact(res["1d"], want)
    placements = {(r["name"], r["placements"]) for res in four_ranks.values() for r in res["1d"]}
    assert {("q.weight", ("Shard(dim=0)",)), ("row40.weight", ("Shard(dim=1)",)),
            ("row288.bias", ("Replicate()",))} <= placements


@pytest.mark.slow
def test_fsdp2_over_tensor_parallel_on_a_2x2_mesh(four_ranks):
    # K = 100 over tp: 50 | 50 (row100.weight, and col100.bias, 25 per rank); col100.weight: 25-row shards
    want = {(n, v) for n in ("row100.weight", "col100.bias") for v in VARIANTS} | {("col100.weight", "2d")}
    placements = {(r["name"], r["placements"]) for res in four_ranks.values() for r in res["2x2"]}
    assert ("col100.weight", ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")) in placements  # FSDP2 over TP
    assert ("row100.weight", ("Shard(dim=0)", "Shard(dim=1)")) in placements
    for res in four_ranks.values():
        assert len(res["2x2"]) == 2 * len(VARIANTS) * 6
        _assert_exact(res["2x2"], want)
