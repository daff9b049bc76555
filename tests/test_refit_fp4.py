"""Refit of 4-bit weights (``quant="nvfp4" | "mxfp4"``): the trainer's plan and an FP4Linear engine's agree,
every refit (whole and delta) leaves in the engine's buffers exactly mxport.fp4's bytes of the trainer's
weights (NVFP4 global scales shared as export shares them), and ``mxport refit --quant`` says so per step."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_refit_coordinator import _refit  # noqa: E402  (a refit between threads: sender and receivers)
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from mxport.cli import app
from mxport.fp4 import quantize_fp4
from mxport.fp4_linear import FP4Linear, quantize_model_fp4, shared_global_scales
from mxport.refit import InProcessChannel, RefitReceiver, RefitSender
from mxport.refit.engine import receiver_plan
from mxport.refit.trainer import TrainerSource
from mxport.testing import make_tiny_llama


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).float()


def _expected(trainer, quant) -> dict[str, object]:
    """module name -> mxport.fp4 of the trainer's weight, NVFP4 with the group-shared global scale."""
    lins = {n: m for n, m in trainer.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    g = shared_global_scales({f"{n}.weight": m.weight for n, m in lins.items()}, quant)
    return {n: quantize_fp4(m.weight.detach(), quant, **({"global_scale": g[f"{n}.weight"]} if g else {}))
            for n, m in lins.items()}


def _holds(engine, trainer, quant) -> bool:
    for name, want in _expected(trainer, quant).items():
        mod = engine.get_submodule(name)
        assert isinstance(mod, FP4Linear)
        got = mod.components()
        if not (torch.equal(got.data, want.data)
                and torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))):
            return False
        if want.global_scale is not None and not torch.equal(got.global_scale.reshape(()),
                                                             want.global_scale.reshape(())):
            return False
    return True


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("delta", [False, True])
def test_fp4_refits_leave_fp4_bytes_of_the_trainer_weights(quant, delta):
    trainer = _model()
    engine = quantize_model_fp4(copy.deepcopy(trainer).to(torch.bfloat16), quant)
    source = TrainerSource(trainer, arena=True, kept_dtype=torch.bfloat16, quant=quant)
    plan, targets = receiver_plan(engine, arena=True)
    assert plan.digest == source.plan.digest
    roles = [e.role for e in plan.entries if e.name.startswith("model.layers.0.self_attn.q_proj.")]
    assert roles == (["values", "scales", "scales"] if quant == "nvfp4" else ["values", "scales"])
    ch = InProcessChannel(1, timeout_s=20)  # one receiver
    sender = RefitSender(ch.endpoint(0), source.plan, bucket_bytes=4096, delta=delta)
    receiver = RefitReceiver(ch.endpoint(1), plan, targets, bucket_bytes=4096, delta=delta)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    for step in range(3):
        if step:  # a real optimizer step: the weights move, some blocks' bytes change
            trainer(torch.randint(0, 128, (1, 12)), labels=torch.randint(0, 128, (1, 12))).loss.backward()
            opt.step()
            opt.zero_grad()
        sent, (got,) = _refit(sender, [receiver], source.tensors())
        assert not isinstance(sent, Exception) and not isinstance(got, Exception), (sent, got)
        assert _holds(engine, trainer, quant), step
        assert sent.delta == (delta and step > 0)
        assert receiver.verify_live()
    with torch.no_grad():  # the engine computes with what it holds: the decoded 4-bit weights
        mod = engine.get_submodule("model.layers.1.mlp.down_proj")
        want = _expected(trainer, quant)["model.layers.1.mlp.down_proj"].dequantize(torch.bfloat16)
        x = torch.randn(3, 96, dtype=torch.bfloat16)
        assert torch.equal(mod.decoded_weight(torch.bfloat16), want)
        assert torch.equal(mod(x), torch.nn.functional.linear(x, want))


def test_fp4_plan_bytes_and_refusals():
    trainer = _model()
    mx8, nv, mx4 = (TrainerSource(trainer, quant=q).plan for q in ("mxfp8", "nvfp4", "mxfp4"))
    values = {q: p.nbytes_by_role["values"] for q, p in (("mxfp8", mx8), ("nvfp4", nv), ("mxfp4", mx4))}
    assert values["nvfp4"] * 2 == values["mxfp8"] == values["mxfp4"] * 2  # two E2M1 codes a byte
    assert nv.total_bytes < mx8.total_bytes and mx4.total_bytes < nv.total_bytes
    with pytest.raises(ValueError, match="quant must be one of"):
        TrainerSource(trainer, quant="fp4")
    torch.manual_seed(0)
    odd = torch.nn.Sequential(torch.nn.Linear(40, 8))  # K = 40: not whole NVFP4 blocks of 16
    with pytest.raises(ValueError, match="K a multiple of 16"):
        TrainerSource(odd, quant="nvfp4")


def test_cli_refit_quant_refusals(tmp_path):
    src = make_tiny_llama(tmp_path / "m")
    for args in (["--engine", "vllm"], ["--trainer", "fsdp=2"]):
        r = CliRunner().invoke(app, ["refit", str(src), "--quant", "nvfp4", *args])
        assert r.exit_code == 2 and "--quant nvfp4 refits the mxport engine" in " ".join(r.output.split())
    # weights the 4-bit refit cannot carry are refused before any process starts (they failed in the
    # processes, with a traceback, found by a breaking round)
    from mxport.testing import make_tiny_mixtral

    odd = make_tiny_llama(tmp_path / "odd", hidden=48, intermediate=40)
    moe = make_tiny_mixtral(tmp_path / "moe", experts=2, layers=1, fused_experts=True)
    for src, quant, needle in ((odd, "nvfp4", "down_proj.weight [48, 40]"), (odd, "mxfp4", "[48, 48]"),
                               (moe, "nvfp4", "experts.gate_up_proj [2, ")):
        r = CliRunner().invoke(app, ["refit", str(src), "--quant", quant])
        out = " ".join(r.output.split())
        assert r.exit_code == 2 and f"--quant {quant} refits 2-D weights" in out and needle in out, out


def test_cli_refit_quant_nvfp4_delta(tmp_path):
    src = make_tiny_llama(tmp_path / "m")
    out = tmp_path / "r.json"
    env = dict(os.environ, MXPORT_DISABLE_COMPILE="1")
    args = ["refit", str(src), "--quant", "nvfp4", "--delta", "--steps", "3", "--lr", "1e-3",
            "--max-new-tokens", "3", "--json", str(out)]
    r = subprocess.run([str(Path(sys.executable).parent / "mxport"), *args], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["quant"] == "nvfp4" and data["plan"]["quant"] == "nvfp4"
    assert data["plan"]["bytes"] < data["plan"]["mxfp8_bytes"]
    steps = data["steps"]
    assert [s["bit_exact"] for s in steps] == [True] * 3
    assert [s["delta"] for s in steps] == [False, True, True]
    assert all(s["bytes"] < s["full_bytes"] == data["plan"]["bytes"] for s in steps[1:])
    assert "nvfp4:" in r.stdout and "MXFP8 of the same model" in r.stdout


@pytest.mark.parametrize("quant, blocks", [("mxfp4", 2), ("nvfp4", 4)])
def test_delta_block_counts_know_the_4bit_layouts(quant, blocks):
    """A [1, 64] weight has 2 MXFP4 blocks (16 packed bytes each) or 4 NVFP4 blocks (8 bytes each); a change
    in the second block's values counts one block of that many (found by a breaking round: MXFP8's 32 bytes
    per block were assumed)."""
    from mxport.quants import get_quant
    from mxport.refit import RefitPlan
    from mxport.refit.items import tensor_items
    from mxport.refit.stream.delta import block_counts

    q = get_quant(quant)
    scales = (q.scale_dtype, q.scale_shape((1, 64)))
    plan = RefitPlan(tensor_items("w", torch.uint8, q.values_shape((1, 64)), scales=scales,
                                  global_scale=q.global_scale))
    second_block_byte = plan.entries[0].offset + q.block // q.per_byte  # the first byte of block 2
    assert block_counts(plan, torch.tensor([second_block_byte])) == (1, blocks)
    scale_of_block_1 = plan.entries[1].offset  # another block: its scale byte changed
    assert block_counts(plan, torch.tensor([second_block_byte, scale_of_block_1])) == (2, blocks)


def test_fp4_linear_keeps_its_bytes_through_a_dtype_cast():
    """``module.to(torch.bfloat16)`` casts floating buffers: the E4M3 scales and the float32 global scale are
    format bytes and stay as they were (the global scale was rounded to BF16 and back, found by a breaking
    round); the bias follows the cast."""
    torch.manual_seed(0)
    m = FP4Linear.from_linear(torch.nn.Linear(64, 32), "nvfp4")
    before = {n: b.clone() for n, b in m.named_buffers()}
    m.to(torch.bfloat16)
    m.half()
    for n, b in m.named_buffers():
        assert b.dtype == before[n].dtype and torch.equal(b.view(torch.uint8), before[n].view(torch.uint8)), n
    assert m.bias.dtype == torch.float16
