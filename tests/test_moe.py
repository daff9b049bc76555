"""MoE end to end (issue 14): fused 3-D experts (transformers 5.x ``MixtralExperts`` / ``Qwen3MoeExperts``:
``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) quantized alike by
``quantize_model``, the refit trainer and receiver, export + ``load_checkpoint``, and ``verify``."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import mxport
from mxport.nn import MXFP8Experts, load_checkpoint, mxfp8_experts, quantize_model
from mxport.policy import PrecisionPolicy
from mxport.refit import InProcessChannel, RefitReceiver, RefitSender, TrainerSource, receiver_plan

WEIGHTS = ("gate_up_proj", "down_proj")


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["mixtral", "mixtral-fused", "qwen3-moe"])
def moe_dir(request, tmp_path_factory):
    from mxport.testing import make_tiny_mixtral, make_tiny_qwen3_moe

    path = tmp_path_factory.mktemp("moe") / request.param
    if request.param == "qwen3-moe":  # down_proj K = 48: a partial last block
        return make_tiny_qwen3_moe(path, dtype=torch.float32)
    return make_tiny_mixtral(path, fused_experts=request.param.endswith("fused"), dtype=torch.float32)


def _experts(model):
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}


def _spread(model, seed=1):
    """Give every expert row a different magnitude (random init gives nearly equal block scales, which would
    hide a misplaced expert or block)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in _experts(model).values():
            for w in WEIGHTS:
                p = getattr(mod, w)
                p.mul_(torch.exp2(torch.randint(-6, 7, p.shape[:-1], generator=g).float()).unsqueeze(-1))


def test_both_families_hold_fused_3d_experts(moe_dir):
    model = _load(moe_dir)
    experts = _experts(model)
    assert len(experts) == 2
    for mod in experts.values():
        gu, down = mod.gate_up_proj, mod.down_proj
        assert gu.dim() == 3 and down.dim() == 3 and gu.shape[0] == down.shape[0] == 4
        assert gu.shape[2] == down.shape[1] and gu.shape[1] == 2 * down.shape[2]  # [E, 2I, H], [E, H, I]


# -- (a) quantize_model: bytes and forward -------------------------------------------------------------------
def test_quantize_model_expert_buffers_equal_quantize_of_3d_weights(moe_dir):
    model = _load(moe_dir)
    _spread(model)
    q = quantize_model(copy.deepcopy(model))
    assert set(mxfp8_experts(q)) == set(_experts(model))
    state = q.state_dict()
    for name, mod in _experts(model).items():
        qm = q.get_submodule(name)
        assert isinstance(qm, MXFP8Experts) and isinstance(qm, type(mod))
        assert type(qm).__name__ == f"MXFP8{type(mod).__name__}"
        for w in WEIGHTS:
            ref = mxport.quantize(getattr(mod, w).detach())
            values, scales = state[f"{name}.{w}"], state[f"{name}.{w}_scale"]
            assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
            assert scales.shape == (*ref.shape[:-1], math.ceil(ref.shape[-1] / 32))
            assert torch.equal(values.view(torch.uint8), ref.data.view(torch.uint8)), (name, w)
            assert torch.equal(scales, ref.scale_inv), (name, w)
            assert getattr(qm, w).dtype == torch.float32
            assert torch.equal(getattr(qm, w), ref.dequantize(torch.float32))
            assert f"{name}.{w}" not in dict(q.named_parameters())


def test_quantized_forward_equals_model_with_dequantized_experts(moe_dir):
    model = _load(moe_dir)
    q = quantize_model(copy.deepcopy(model))
    ref = copy.deepcopy(model)
    with torch.no_grad():  # reference: same quantized linears, experts replaced by their decoded values
        for mod in _experts(ref).values():
            for w in WEIGHTS:
                getattr(mod, w).copy_(mxport.quantize(getattr(mod, w)).dequantize())
    quantize_model(ref, PrecisionPolicy(exclude=("*.experts.*",)))  # the same linears, experts left as set
    assert not mxfp8_experts(ref)
    ids = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, want, hp = q(ids).logits, ref(ids).logits, model(ids).logits
    assert torch.equal(out, want)
    assert not torch.equal(out, hp)  # the experts really run quantized


def test_to_dtype_keeps_fp8_bytes_and_moves_the_compute_dtype(moe_dir):
    q = quantize_model(_load(moe_dir))
    name = next(iter(mxfp8_experts(q)))
    before = {k: v.clone() for k, v in q.state_dict().items() if k.startswith(name)}
    q.to(torch.bfloat16)
    mod = q.get_submodule(name)
    assert mod.gate_up_proj.dtype == torch.bfloat16
    assert mod._buffers["gate_up_proj"].dtype == torch.float8_e4m3fn
    for k, v in before.items():
        assert torch.equal(q.state_dict()[k].view(torch.uint8), v.view(torch.uint8)), k
    with torch.no_grad():
        assert q(torch.tensor([[5, 6, 7]])).logits.dtype == torch.bfloat16
    q.float()
    assert mod.down_proj.dtype == torch.float32
    assert torch.equal(mod.down_proj, mod.mx_components("down_proj").dequantize())


def test_decoded_cache_follows_in_place_writes(tmp_path):
    from mxport.testing import make_tiny_mixtral

    q = quantize_model(_load(make_tiny_mixtral(tmp_path / "m", layers=1, with_tokenizer=False)))
    mod = next(iter(mxfp8_experts(q).values()))
    first = mod.gate_up_proj
    assert mod.gate_up_proj is first  # cached
    mod._buffers["gate_up_proj_scale"][1].add_(1)  # one expert's scales doubled, in place
    second = mod.gate_up_proj
    assert torch.equal(second[1], 2 * first[1]) and torch.equal(second[0], first[0])


def test_policy_keeps_a_whole_moe_layer_and_explicit_modules_convert_whole_experts(tmp_path):
    from mxport.testing import make_tiny_qwen3_moe

    model = _load(make_tiny_qwen3_moe(tmp_path / "q", with_tokenizer=False))
    policy = PrecisionPolicy(exclude=("model.layers.1.mlp.experts.down_proj",))  # one weight of layer 1
    q = quantize_model(copy.deepcopy(model), policy)
    # layer 1's experts all kept (one precision)
    assert list(mxfp8_experts(q)) == ["model.layers.0.mlp.experts"]
    assert isinstance(q.model.layers[1].mlp.experts.gate_up_proj, torch.nn.Parameter)
    source = TrainerSource(model, policy)
    assert receiver_plan(q)[0].digest == source.plan.digest
    assert quantize_model(q, policy) is q and list(mxfp8_experts(q)) == ["model.layers.0.mlp.experts"]

    e = quantize_model(copy.deepcopy(model), modules=["model.layers.1.mlp.experts"])
    assert list(mxfp8_experts(e)) == ["model.layers.1.mlp.experts"]
    assert e.model.layers[1].mlp.experts._mx_weights == ("down_proj", "gate_up_proj")
    with pytest.raises(TypeError, match="neither an nn.Linear nor a fused-experts"):
        quantize_model(copy.deepcopy(model), modules=["model.layers.0.mlp"])


# -- (b) the trainer's refit plan equals the receiver's (the RefitPlanMismatch of issue 14) ------------------
def test_trainer_plan_digest_equals_receiver_plan_of_quantized_model(moe_dir):
    model = _load(moe_dir)
    source = TrainerSource(model)
    plan, _ = receiver_plan(quantize_model(copy.deepcopy(model)))
    names = [e.name for e in plan.entries]
    assert any(n.endswith("experts.down_proj_scale") for n in names)
    assert plan.digest == source.plan.digest


# -- (c) in-process refit into the quantized MoE -------------------------------------------------------------
def _refit(plan, source, targets, versions: int) -> RefitReceiver:
    """``versions`` refits from ``source`` into ``targets`` (receiver in a thread); returns the receiver."""
    ch = InProcessChannel(1, timeout_s=30)
    receiver = RefitReceiver(ch.endpoint(1), plan, targets, bucket_bytes=4096)
    errors = []

    def rx():
        try:
            for _ in range(versions):
                receiver.receive()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    th = threading.Thread(target=rx)
    th.start()
    sender = RefitSender(ch.endpoint(0), source.plan, bucket_bytes=4096)
    for _ in range(versions):
        sender.send(source.tensors())
    th.join(timeout=60)
    assert not th.is_alive() and not errors, errors
    return receiver


def test_in_process_refit_lands_quantize_bytes_and_forward_follows(moe_dir):
    trainer = _load(moe_dir)
    engine = quantize_model(copy.deepcopy(trainer))
    source = TrainerSource(trainer)
    plan, targets = receiver_plan(engine)
    ids = torch.tensor([[5, 9, 40, 41, 77, 3]])
    _refit(plan, source, targets, versions=1)
    with torch.no_grad():
        before = engine(ids).logits  # decoded caches built for the first version
        _spread(trainer, seed=7)  # the trainer's experts change
    assert _refit(plan, source, targets, versions=1).verify_live()
    for name, mod in _experts(trainer).items():
        em = engine.get_submodule(name)
        for w in WEIGHTS:
            ref = mxport.quantize(getattr(mod, w).detach())
            assert torch.equal(em._buffers[w].view(torch.uint8), ref.data.view(torch.uint8)), (name, w)
            assert torch.equal(em._buffers[f"{w}_scale"], ref.scale_inv), (name, w)
            assert torch.equal(getattr(em, w), ref.dequantize())  # the decoded cache followed the refit
    fresh = quantize_model(copy.deepcopy(trainer))
    with torch.no_grad():
        after, want = engine(ids).logits, fresh(ids).logits
    assert torch.equal(after, want) and not torch.equal(after, before)


# -- (d) export + load_checkpoint ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["modelopt", "sglang"])
def test_export_and_load_checkpoint_round_trip_expert_bytes(moe_dir, tmp_path, fmt):
    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_qwen3_moe

    if json.loads((moe_dir / "config.json").read_text()).get("moe_intermediate_size") == 48:
        # K = 48 cannot be MXFP8 in a checkpoint (test_cli_export covers the refusal): whole blocks here
        moe_dir = make_tiny_qwen3_moe(tmp_path / "q64", moe_intermediate=64, dtype=torch.float32)
    model = _load(moe_dir)
    _spread(model)
    out = tmp_path / "ckpt"
    export_checkpoint(model, out, fmt=fmt)
    fresh = _load(moe_dir)
    report = load_checkpoint(fresh, out)
    assert report["missing"] == [] and report["unexpected"] == []
    want = quantize_model(copy.deepcopy(model)).state_dict()
    got = fresh.state_dict()
    for name in _experts(model):
        assert f"{name}.gate_up_proj" in report["replaced"] and f"{name}.down_proj" in report["replaced"]
        assert isinstance(fresh.get_submodule(name), MXFP8Experts)
        for w in WEIGHTS:
            for key in (f"{name}.{w}", f"{name}.{w}_scale"):
                assert got[key].dtype == want[key].dtype, key
                assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), key
    again = load_checkpoint(fresh, out)  # into the quantized modules, in place
    name = next(iter(_experts(model)))
    assert f"{name}.gate_up_proj" in again["mxfp8"] and again["missing"] == []


def test_load_checkpoint_refuses_experts_of_another_shape(tmp_path):
    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_mixtral

    small = make_tiny_mixtral(tmp_path / "small", intermediate=64, layers=1, with_tokenizer=False)
    big = make_tiny_mixtral(tmp_path / "big", intermediate=96, layers=1, with_tokenizer=False)
    export_checkpoint(_load(small), tmp_path / "ck")
    with pytest.raises(ValueError, match="experts"):
        load_checkpoint(_load(big), tmp_path / "ck")


# -- (e) verify ----------------------------------------------------------------------------------------------
def test_verify_quantizes_experts_and_sweeps_them_with_their_layer(tmp_path):
    from transformers import AutoTokenizer

    from mxport.testing import make_tiny_qwen3_moe
    from mxport.verify import verify

    path = make_tiny_qwen3_moe(tmp_path / "q", moe_intermediate=64, dtype=torch.float32)  # K % 32 == 0:
    prompts = tmp_path / "p.txt"  # exported as a checkpoint below
    prompts.write_text("Name a color.\n\nCount to three.\n")
    model, tok = _load(path), AutoTokenizer.from_pretrained(str(path))
    r = verify((model, tok), prompts=str(prompts), max_new_tokens=4, per_layer=True, target_kl=0.0)
    experts = [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in WEIGHTS]
    assert all(k in r["weight_sqnr_db"] and math.isfinite(r["weight_sqnr_db"][k]) for k in experts)
    assert r["mxfp8_experts"] == 2 and r["mxfp8_layers"] == 2 * 4 + 2 and r["mxfp8_tensors"] == 2 * 4 + 4
    assert math.isfinite(r["gen_kl_error_mean"]) and r["gen_kl_error_mean"] > 0
    assert [row["layer"] for row in r["per_layer"]["layers"]] == [0, 1]
    # keeping both layers swaps their experts back too: exactly the source model
    assert r["per_layer"]["suggestion"]["keep_layers"] == [0, 1]
    assert r["per_layer"]["suggestion"]["gen_kl_error_mean"] == 0.0
    assert all(isinstance(m, torch.nn.Parameter) for n, m in model.named_parameters() if "experts" in n)

    from mxport.checkpoint.export import export_checkpoint

    export_checkpoint(model, tmp_path / "ck")
    c = verify((model, tok), checkpoint=str(tmp_path / "ck"), prompts=str(prompts), max_new_tokens=4)
    assert c["weight_sqnr_db"] == r["weight_sqnr_db"] and c["gen_kl_error_mean"] == r["gen_kl_error_mean"]


def test_verify_twin_experts_match_quantize_model(tmp_path):
    from mxport.testing import make_tiny_qwen3_moe
    from mxport.verify import build_twin, quantized_modules

    model = _load(make_tiny_qwen3_moe(tmp_path / "q", layers=2, dtype=torch.float32, with_tokenizer=False))
    twin = build_twin(model)
    mx = quantized_modules(twin)
    assert "model.layers.1.mlp.experts" in mx and "model.layers.1.self_attn.q_proj" in mx
    want = quantize_model(copy.deepcopy(model)).state_dict()
    got = twin.state_dict()
    assert list(got) == list(want)
    for k, v in got.items():
        assert v.dtype == want[k].dtype and torch.equal(v.view(torch.uint8), want[k].view(torch.uint8)), k


# -- the CLI as a user runs it -------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_refit_tiny_moe_bit_exact(tmp_path):
    from mxport.testing import make_tiny_qwen3_moe

    path = make_tiny_qwen3_moe(tmp_path / "q", dtype=torch.bfloat16)
    out = tmp_path / "r.json"
    src = str(Path(mxport.__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-m", "mxport.cli", "refit", str(path), "--steps", "2", "--json",
                           str(out)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": src})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = json.loads(out.read_text())["steps"]
    assert len(steps) == 2 and all(s["bit_exact"] for s in steps)


def _tiny_deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                           first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                           qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
                           max_position_embeddings=128)
    return DeepseekV3ForCausalLM(cfg).eval()


def test_deepseek_v3_style_experts_and_shared_experts():
    model = _tiny_deepseek_v3()  # layer 0 dense, layer 1 MoE with routed (3-D) and shared (Linear) experts
    q = quantize_model(copy.deepcopy(model))
    assert list(mxfp8_experts(q)) == ["model.layers.1.mlp.experts"]
    assert type(q.model.layers[1].mlp.shared_experts.gate_proj).__name__ == "MXFP8Linear"
    assert not isinstance(q.model.layers[1].mlp.gate, MXFP8Experts)  # the router stays high precision
    mod, qm = model.model.layers[1].mlp.experts, q.model.layers[1].mlp.experts
    for w in WEIGHTS:
        ref = mxport.quantize(getattr(mod, w).detach())
        assert torch.equal(qm._buffers[w].view(torch.uint8), ref.data.view(torch.uint8))
    assert TrainerSource(model).plan.digest == receiver_plan(q)[0].digest


def test_quantized_experts_survive_torch_save_and_load():
    import io

    q = quantize_model(_tiny_deepseek_v3())
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    mod = back.model.layers[1].mlp.experts
    assert type(mod) is type(q.model.layers[1].mlp.experts)  # the generated class, rebuilt
    assert torch.equal(mod.gate_up_proj, q.model.layers[1].mlp.experts.gate_up_proj)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, q(ids).logits)
