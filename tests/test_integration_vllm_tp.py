"""vLLM's CPU build with two tensor-parallel workers, refitted through the "mxport" backend: each worker
receives its own slice straight into its live weights, attests what it holds, and a refit one worker rejects
is applied by none. Runs in .venv-vllm (scripts/setup_vllm.sh); skips where vLLM is not installed."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup_vllm.sh makes .venv-vllm)")
mxv = pytest.importorskip("mxport.integrations.vllm")
from test_integration_vllm import _refit_ok  # noqa: E402  (a refit that must succeed)
from vllm.platforms import current_platform  # noqa: E402

from mxport.demo import vllm as harness  # noqa: E402
from mxport.testing import flip_live_byte  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not current_platform.is_cpu() or os.cpu_count() < 2,
    reason="a tensor-parallel vLLM engine of 2 CPU workers (vLLM's CPU build on a machine of 2+ cores)")]
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_llama

    d = tmp_path_factory.mktemp("vllm-tp2")
    src = make_tiny_llama(d / "bf16", hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2)
    export_checkpoint(str(src), d / "mx")
    s = harness.VllmRefitSession(str(src), str(d / "mx"), timeout_s=30, bucket_bytes=64 << 10, tp=2)
    s.dir, s.ptr0 = d, harness.engine_pointers(s.llm)
    yield s
    s.close_trainer()


#: a fresh tensor-parallel vLLM on argv[1] (tp = argv[2]): its greedy tokens and log-probs to argv[3]
_FRESH = """
import sys, torch
from mxport.demo import vllm as h
llm, _ = h.start_engine(sys.argv[1], tp=int(sys.argv[2]))
out = h.generate(llm, [[5, 6, 7, 8, 9], [40, 41, 42]], full=False)
torch.save([{"tokens": o["tokens"], "logprobs": o["logprobs"]} for o in out], sys.argv[3])
"""


def _fresh_generation(src_dir: str, step: int, tp: int, tmp_path) -> list[dict]:
    """Greedy tokens and log-probs of a fresh vLLM (``tp`` workers, its own process) on ``mxport export`` of
    the trainer's step-``step`` weights."""
    mx = harness.export_step(src_dir, step, tmp_path)
    dump = tmp_path / "fresh.pt"
    proc = subprocess.run([sys.executable, "-c", _FRESH, mx, str(tp), str(dump)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(dump)


def test_each_worker_gets_its_slice_and_generates_as_a_fresh_tp2_engine_on_the_export(tp2, tmp_path):
    ans = _refit_ok(tp2, 1)
    workers = tp2.engine_stats()
    assert [w["attested"] for w in workers] == [True, True] and ans["stats"]["attested"] == 1
    plan = tp2.plan_summary
    # every projection is cut in two, the norms are whole on both: each worker about half of the plan
    assert [w["bytes"] for w in workers] == plan["engine_bytes"]
    assert sum(plan["engine_bytes"]) == ans["stats"]["bytes"]
    for b in plan["engine_bytes"]:
        assert abs(b - plan["bytes"] / 2) / (plan["bytes"] / 2) < 0.05
    assert all(w["host_bytes"] <= 1.2 * w["bytes"] for w in workers)
    assert harness.slice_mismatches(tp2, 1) == []
    assert harness.engine_pointers(tp2.llm) == tp2.ptr0
    ours = [{"tokens": o["tokens"], "logprobs": o["logprobs"]}
            for o in harness.generate(tp2.llm, PROMPTS, full=False)]
    assert ours == _fresh_generation(tp2.src_dir, 1, 2, tmp_path)


def test_a_refit_one_worker_rejects_is_applied_by_none(tp2):
    _refit_ok(tp2, 1)
    ans = tp2.refit(2, fault="corrupt")  # stream 0 (to worker 0) corrupt: worker 0 rejects, worker 1 votes ok
    assert not ans.get("ok") and "checksum" in ans["error"]
    assert [w["ok"] for w in tp2.engine_stats()] == [False, False]
    assert harness.slice_mismatches(tp2, 1) == []  # both workers still hold step 1
    assert [a["attested"] for a in mxv.attest(tp2.llm)] == [True, True]
    _refit_ok(tp2, 2)
    assert harness.slice_mismatches(tp2, 2) == []
    assert harness.engine_pointers(tp2.llm) == tp2.ptr0


def test_attestation_names_a_live_weight_altered_after_the_refit(tp2):
    _refit_ok(tp2, 3)
    assert [a["attested"] for a in mxv.attest(tp2.llm)] == [True, True]
    tp2.llm.collective_rpc(functools.partial(flip_live_byte, param="model.layers.1.mlp.down_proj.weight"))
    got = mxv.attest(tp2.llm)
    assert [a["attested"] for a in got] == [False, False]
    assert [a["changed"] for a in got] == [["model.layers.1.mlp.down_proj.weight"]] * 2
    _refit_ok(tp2, 4)  # the next refit writes every byte again: attested
    assert [a["attested"] for a in mxv.attest(tp2.llm)] == [True, True]


def test_cli_refuses_a_tp_the_model_cannot_take(tmp_path):
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=96, heads=3, kv_heads=1, intermediate=256)
    from pathlib import Path

    mxport = str(Path(sys.executable).with_name("mxport"))
    proc = subprocess.run([mxport, "refit", str(src), "--engine", "vllm,tp=2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "3 attention heads do not divide by tp=2" in proc.stdout + proc.stderr


def test_one_refit_reaches_two_engine_replicas_multicast_once(tmp_path):
    """Two vLLM engines on the same checkpoint (data-parallel replicas; the second in a process of its own):
    one refit, one multicast stream reaching both, each attested and bit-exact."""
    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2)
    export_checkpoint(str(src), tmp_path / "mx")
    s = harness.VllmRefitSession(str(src), str(tmp_path / "mx"), timeout_s=60, bucket_bytes=64 << 10,
                                 replicas=2)
    try:
        ptr0 = s.pointers()
        ans = _refit_ok(s, 1)
        assert [x["engines"] for x in ans["streams"]] == [[1, 2]]  # one stream, multicast to both engines
        assert ans["streams"][0]["bytes"] == s.plan_summary["bytes"]
        workers = s.engine_stats()
        assert [w["attested"] for w in workers] == [True, True]
        assert [w["bytes"] for w in workers] == [s.plan_summary["bytes"]] * 2
        assert harness.slice_mismatches(s, 1) == [] and s.pointers() == ptr0
        ours = [{"tokens": o["tokens"], "logprobs": o["logprobs"]}
                for o in harness.generate(s.llm, PROMPTS, full=False)]
        assert s.replicas[0].ask("generate", prompts=PROMPTS) == ours
    finally:
        s.close()


def test_two_fsdp2_trainer_ranks_each_send_their_own_pieces(tmp_path):
    """An FSDP2 trainer of 2 ranks (each holding half of every tensor) refits a tp=2 vLLM engine: every
    trainer rank sends the pieces it holds straight to the workers that need them (no gather), each worker
    receives from both, and the engine holds exactly the trainer's weights, attested."""
    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2)
    export_checkpoint(str(src), tmp_path / "mx")
    s = harness.VllmRefitSession(str(src), str(tmp_path / "mx"), timeout_s=60, bucket_bytes=64 << 10,
                                 tp=2, trainers=2)
    try:
        assert s.plan_summary["trainer_ranks"] == 2
        for step in (1, 2):
            if step == 2:  # a forward pass on the FSDP2 trainer (scoring) between refits
                s.score([5, 6, 7], [8, 9])
            ans = _refit_ok(s, step)
            assert sorted(x["engines"] for x in ans["streams"]) == [[2], [3]]  # rank 0's streams
            workers = s.engine_stats()
            assert [w["attested"] for w in workers] == [True, True]
            assert harness.slice_mismatches(s, step) == []
    finally:
        s.close()


def test_a_bf16_decoding_emulation_kernel_is_refitted_in_place_and_attested(tmp_path):
    """vLLM's default CPU emulation decodes MXFP8 weights to BF16 at load: those layers take the dequant path
    (FP8 staged, the live BF16 weight decoded in place) and attest by re-encoding it with the live scales."""
    import json
    from pathlib import Path

    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2)
    mxport = str(Path(sys.executable).with_name("mxport"))
    proc = subprocess.run([mxport, "refit", str(src), "--engine", "vllm", "--steps", "2", "--json", "-"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in json.loads(proc.stdout)["steps"]:
        assert row["bit_exact"] and row["attested"] and row["pointers_stable"], row
        assert row["ranks"][0]["apply_paths"]["dequant"] == 8  # every projection of the 2 layers


def test_a_tied_lm_head_follows_the_refit_as_a_fresh_engine_does(tmp_path):
    """tie_word_embeddings: vLLM's lm_head shares the embedding's weight, and on CPUs each of the two layers
    keeps its own packed copy for its GEMM: the refit re-packs both (the logits come from the lm_head's)."""
    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2,
                          tie_word_embeddings=True)
    export_checkpoint(str(src), tmp_path / "mx")
    s = harness.VllmRefitSession(str(src), str(tmp_path / "mx"), timeout_s=60, bucket_bytes=64 << 10)
    try:
        _refit_ok(s, 1)
        assert harness.engine_mismatches(s, 1) == []
        ours = [{"tokens": o["tokens"], "logprobs": o["logprobs"]}
                for o in harness.generate(s.llm, PROMPTS, full=False)]
    finally:
        s.close()
    assert ours == _fresh_generation(str(src), 1, 1, tmp_path)


def test_column_parallel_biases_are_sliced_as_vllm_holds_them(tmp_path):
    """Qwen2 (q / k / v biases, one KV head replicated over both workers) at tp=2: each worker gets its part
    of each bias, at its offset in qkv_proj.bias; exact and attested (`mxport refit --engine vllm,tp=2`)."""
    import json
    from pathlib import Path

    from mxport.testing import make_tiny_qwen2

    src = make_tiny_qwen2(tmp_path / "qwen2", heads=2, kv_heads=1)
    mxport = str(Path(sys.executable).with_name("mxport"))
    proc = subprocess.run([mxport, "refit", str(src), "--engine", "vllm,tp=2", "--steps", "1", "--json", "-"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout)["steps"][0]
    assert row["bit_exact"] and row["attested"] and row["kv_fresh"], row
