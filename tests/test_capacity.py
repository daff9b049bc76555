"""The capacity model (mxport.parallel, mxport.capacity, `mxport plan`): layouts, engine slices and byte
counts, exact for small hand-made models."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mxport.capacity import Hardware, HostPasses, config_entries, predict
from mxport.cli import app
from mxport.parallel import Layout, engine_shard, mxfp8_bytes

BF16 = torch.bfloat16


@pytest.mark.parametrize("text,want", [("", Layout()), ("1", Layout()), ("tp=2", Layout(tp=2)),
                                       ("tp=2,pp=2", Layout(tp=2, pp=2)), (" FSDP=8 ", Layout(fsdp=8)),
                                       ("tp=8,ep=16", Layout(tp=8, ep=16))])
def test_layout_parse(text, want):
    assert Layout.parse(text) == want
    assert Layout.parse(str(want)) == want


@pytest.mark.parametrize("text", ["tp", "tp=0", "tp=-1", "tp=2,tp=2", "dp=2", "tp=x", "tp=1.5"])
def test_layout_parse_rejects(text):
    with pytest.raises(ValueError):
        Layout.parse(text)


def test_layout_ranks():
    assert Layout.parse("fsdp=2,tp=2,pp=2,ep=2").ranks == 16


def test_mxfp8_bytes():
    assert mxfp8_bytes((192, 576)) == 192 * 576 + 192 * 18
    assert mxfp8_bytes((4, 3, 33)) == 12 * 33 + 12 * 2   # a short last block has its own scale byte


def test_engine_shards_follow_vllm_parallel_layers():
    tp2 = Layout(tp=2)
    assert engine_shard("m.layers.0.self_attn.q_proj.weight", (64, 96), tp2).shape == (32, 96)
    assert engine_shard("m.layers.0.self_attn.o_proj.weight", (96, 64), tp2).shape == (96, 32)
    assert engine_shard("m.embed_tokens.weight", (100, 64), tp2).shape == (50, 64)
    assert engine_shard("m.layers.0.input_layernorm.weight", (64,), tp2).shape == (64,)
    assert engine_shard("m.layers.0.mlp.gate.weight", (8, 64), tp2).dim is None   # router: replicated
    # 2 KV heads over tp=4: each head on two ranks
    kv = engine_shard("m.layers.0.self_attn.k_proj.weight", (256, 64), Layout(tp=4), kv_heads=2)
    assert kv.shape == (128, 64) and kv.parts == 2
    # fused experts: TP splits N (gate_up) and K (down); EP splits the experts over tp * ep ranks
    assert engine_shard("m.layers.0.mlp.experts.gate_up_proj", (8, 64, 32), tp2).shape == (8, 32, 32)
    assert engine_shard("m.layers.0.mlp.experts.down_proj", (8, 32, 64), tp2).shape == (8, 32, 32)
    assert (engine_shard("m.layers.0.mlp.experts.down_proj", (8, 32, 64), Layout(tp=2, ep=2)).shape
            == (2, 32, 64))


def test_column_parallel_mxfp8_slices_vllm_refuses_are_problems():
    tp2 = Layout(tp=2)
    s = engine_shard("m.layers.0.mlp.up_proj.weight", (100, 64), Layout(tp=3), quantized=True)
    assert s.problem == "m.layers.0.mlp.up_proj.weight: 100 rows do not split into 3 equal slices (tp=3)"
    assert engine_shard("m.layers.0.mlp.up_proj.weight", (100, 64), Layout(tp=3)).problem == ""  # kept
    s = engine_shard("m.layers.0.mlp.experts.gate_up_proj", (8, 192, 64), tp2, quantized=True)
    assert s.shape == (8, 96, 64) and s.problem == (
        "m.layers.0.mlp.experts.gate_up_proj: I=96 split over tp=2 gives 48 per rank, not a multiple of 32 "
        "(vLLM's MXFP8 MoE requires intermediate_size_per_partition divisible by 32)")
    gate_up = engine_shard("m.layers.0.mlp.experts.gate_up_proj", (8, 256, 64), tp2, quantized=True)
    assert gate_up.problem == ""
    # a whole K that is not whole blocks is no slicing matter: export refuses it (vLLM does at any tp)
    assert engine_shard("m.layers.0.mlp.gate_proj.weight", (128, 200), tp2, quantized=True).problem == ""
    assert engine_shard("m.layers.0.mlp.experts.down_proj", (8, 64, 48), Layout(ep=2),
                        quantized=True).problem == ""


def test_row_parallel_k_that_splits_blocks_is_a_problem():
    s = engine_shard("m.layers.0.mlp.down_proj.weight", (64, 96), Layout(tp=2), quantized=True)
    assert s.shape == (64, 48) and "not a multiple of 32" in s.problem
    assert engine_shard("m.layers.0.mlp.down_proj.weight", (64, 96), Layout(tp=2)).problem == ""  # kept: fine
    assert engine_shard("m.layers.0.mlp.down_proj.weight", (64, 128), Layout(tp=2),
                        quantized=True).problem == ""


ENTRIES = [("m.embed_tokens.weight", (100, 64), BF16), ("m.layers.0.self_attn.q_proj.weight", (64, 64), BF16),
           ("m.layers.0.self_attn.o_proj.weight", (64, 64), BF16),
           ("m.layers.0.input_layernorm.weight", (64,), BF16)]


def test_predict_counts_bytes_exactly():
    hw = Hardware(link_gbps=1.0, trainer_quantize_gelems=1.0, engine_quantize_gelems=2.0, overlap=False)
    r = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), hw, engine_replicas=3)
    # one engine rank: q [32, 64] and o [64, 32] as MXFP8 (values + 1 scale byte per 32), embed [50, 64] and
    # the norm [64] in BF16
    rank = (32 * 64 + 32 * 2) + (64 * 32 + 64 * 1) + 50 * 64 * 2 + 64 * 2
    assert r.mxfp8.bytes_per_engine_rank == rank
    assert r.mxfp8.wire_bytes == rank * 2 * 3                 # 2 ranks per engine, 3 engines
    assert r.mxfp8.bytes_per_trainer_rank == rank * 3         # 2 trainer ranks share it
    params = 100 * 64 + 2 * 64 * 64 + 64
    # BF16, the default path: the full tensors are broadcast to every engine rank (its loader slices them)
    assert r.bf16.bytes_per_engine_rank == params * 2
    assert r.bf16.wire_bytes == params * 2 * 2 * 3 and r.bf16.bytes_per_trainer_rank == params * 3
    assert r.bf16.wire_seconds == pytest.approx(params * 2 * 3 / 2 / 1e9)  # pipelined: once per link
    assert r.quantized_parameters == 2 * 64 * 64 and r.parameters == 100 * 64 + 2 * 64 * 64 + 64
    assert r.mxfp8.wire_seconds == pytest.approx(rank * 3 / 1e9)
    assert r.mxfp8.quantize_seconds == pytest.approx(2 * 64 * 64 / 2 / 1e9)
    assert r.mxfp8.seconds == pytest.approx(r.mxfp8.wire_seconds + r.mxfp8.quantize_seconds)  # no overlap
    assert r.bf16.gather_seconds == pytest.approx(params * 2 * 0.5 / 1e9)
    assert r.bf16.quantize_seconds == pytest.approx(2 * 32 * 64 / 2e9)
    assert r.speedup == pytest.approx(r.bf16.seconds / r.mxfp8.seconds)


def test_bf16_sharded_path_routes_slices_at_two_bytes_an_element():
    """The BF16 path systems at scale run (vLLM RDT, NeMo-RL nccl_reshard): each engine rank receives its own
    slice in BF16 from the trainer ranks that hold it, then quantizes it; no gather, no full broadcast."""
    hw = Hardware(link_gbps=1.0, trainer_quantize_gelems=1.0, engine_quantize_gelems=2.0, overlap=False)
    r = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), hw, engine_replicas=3)
    s = r.bf16_sharded
    rank = (32 * 64 + 64 * 32 + 50 * 64 + 64) * 2  # q and o slices, the embedding's rows, the norm: BF16
    assert s.bytes_per_engine_rank == rank and s.wire_bytes == rank * 2 * 3
    assert s.bytes_per_trainer_rank == rank * 3 and s.gather_seconds == 0
    assert s.wire_seconds == pytest.approx(rank * 3 / 1e9)  # 2 trainer ranks share 2 x 3 engine ranks' bytes
    assert s.quantize_seconds == r.bf16.quantize_seconds  # the engine ranks quantize their slices
    assert s.seconds == pytest.approx(s.wire_seconds + s.quantize_seconds)
    assert r.speedup_sharded == pytest.approx(s.seconds / r.mxfp8.seconds)
    assert r.bf16.seconds > s.seconds > r.mxfp8.seconds
    d = r.to_dict()
    assert d["bf16_sharded"]["wire_bytes"] == s.wire_bytes
    assert d["speedup_vs_bf16_sharded"] == r.speedup_sharded
    # with host rates its protocol passes are the MXFP8 path's at BF16's bytes
    h = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), Hardware(host_copy_gbps=1.0), engine_replicas=3)
    mx_bytes = h.mxfp8.bytes_per_engine_rank
    assert h.bf16_sharded.host_seconds == pytest.approx(h.mxfp8.host_seconds * rank / mx_bytes)


def test_shared_bandwidth_bounds_every_phase_by_its_total_bytes():
    """Ranks sharing one host (loopback) or one NIC: a phase takes at least all its bytes over the shared
    bandwidth — the gather moves (group - 1) x the model, the wires every engine rank's bytes."""
    hw = Hardware(link_gbps=1.0, trainer_quantize_gelems=1.0, engine_quantize_gelems=1.0, overlap=False)
    alone = predict(ENTRIES, Layout(fsdp=4), Layout(tp=2), hw)
    shared = predict(ENTRIES, Layout(fsdp=4), Layout(tp=2), Hardware(**{**hw.__dict__, "shared_gbps": 1.0}))
    params = 100 * 64 + 2 * 64 * 64 + 64
    assert alone.bf16.gather_seconds == pytest.approx(params * 2 * 3 / 4 / 1e9)   # each rank's own link
    assert shared.bf16.gather_seconds == pytest.approx(params * 2 * 3 / 1e9)      # 4 ranks share 1 GB/s
    assert shared.mxfp8.wire_seconds == pytest.approx(shared.mxfp8.wire_bytes / 1e9)
    assert shared.bf16.wire_seconds == pytest.approx(params * 2 * 2 / 1e9)        # 2 engine ranks, full
    assert alone.bf16.wire_seconds == pytest.approx(params * 2 / 1e9)
    assert shared.mxfp8.bytes_per_engine_rank == alone.mxfp8.bytes_per_engine_rank  # bytes unchanged
    with pytest.raises(ValueError, match="shared_gbps"):
        Hardware(shared_gbps=0)


def test_predict_overlap_and_pipeline_stages():
    hw = Hardware(link_gbps=1.0, trainer_quantize_gelems=1.0)
    r = predict(ENTRIES, Layout(), Layout(pp=2), hw)
    assert r.mxfp8.seconds == max(r.mxfp8.wire_seconds, r.mxfp8.quantize_seconds)
    full = predict(ENTRIES, Layout(), Layout(), hw)
    assert r.mxfp8.wire_bytes == full.mxfp8.wire_bytes
    assert r.mxfp8.bytes_per_engine_rank == -(-full.mxfp8.bytes_per_engine_rank // 2)


HOST = dict(host_copy_gbps=1.0, host_checksum_gbps=2.0, host_commit_gbps=4.0)


def test_host_passes_are_counted_bytes_over_measured_rates():
    """The protocol's passes in host memory: every sender byte packed, the o_proj pieces (a column half of
    the trainer's rows) cut out first; every engine byte read for its checksum and copied at commit."""
    hw = Hardware(link_gbps=1.0, trainer_quantize_gelems=1.0, engine_quantize_gelems=2.0, overlap=False)
    off = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), hw)
    on = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), Hardware(**{**hw.__dict__, **HOST}))
    rank, o_proj = 10752, 64 * 32 + 64  # one engine rank's bytes (test above); its o_proj [64, 32] slice
    want = HostPasses(pack=rank, cut=o_proj, sender_checksum=0, checksum=rank, commit=rank, scatter=0)
    assert on.passes == off.passes == want  # 2 trainer ranks send 2 engine ranks' bytes: one rank's each
    send, check, commit = (rank + o_proj) / 1e9, rank / 2e9, rank / 4e9
    assert on.passes.seconds(on.hardware) == pytest.approx((send, check, commit), rel=1e-12)
    assert on.mxfp8.host_seconds == pytest.approx(send + check + commit, rel=1e-12)
    assert on.mxfp8.seconds == pytest.approx(off.mxfp8.seconds + send + check + commit, rel=1e-12)
    # default off: nothing changes (GPU predictions, `mxport plan` without --host-copy-gbps)
    assert off.mxfp8.host_seconds == 0.0 and off.passes.seconds(hw) == (0.0, 0.0, 0.0)
    assert off.mxfp8.seconds == pytest.approx(off.mxfp8.wire_seconds + off.mxfp8.quantize_seconds, rel=1e-12)
    assert on.bf16 == off.bf16 and on.mxfp8.wire_seconds == off.mxfp8.wire_seconds
    # overlapped: packing and checksums run while buckets are on the wire; the commit after the vote
    lap = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), Hardware(**{**hw.__dict__, **HOST, "overlap": True}))
    assert lap.mxfp8.seconds == pytest.approx(max(lap.mxfp8.quantize_seconds, lap.mxfp8.wire_seconds, send,
                                                  check) + commit, rel=1e-12)
    # checksum and commit rates default to the copy rate
    one = Hardware(host_copy_gbps=1.0)
    assert on.passes.seconds(one) == pytest.approx(((rank + o_proj) / 1e9, rank / 1e9, rank / 1e9))
    for name in HOST:
        with pytest.raises(ValueError, match=name):
            Hardware(**{name: 0.0})



def test_delta_refit_sends_its_fraction_after_quantize_diff_and_checks():
    """A delta refit: f of each link's bytes, after the full quantize and a diff reading the base and the new
    stream; the engine sums its whole stream, then copies it at commit (staging) or not (direct)."""
    hw = Hardware(link_gbps=1.0, trainer_quantize_gelems=1.0, engine_quantize_gelems=2.0, overlap=True)
    full = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), hw, engine_replicas=3)
    r = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), hw, engine_replicas=3, delta_fraction=0.25)
    assert r.mxfp8 == full.mxfp8 and full.delta is None and r.delta_fraction == 0.25
    rank = 10752  # one engine rank's bytes; each of the 2 trainer ranks sends 3 engine ranks' worth
    d = r.delta
    assert (d.wire_bytes, d.bytes_per_trainer_rank, d.bytes_per_engine_rank) == (rank * 6 // 4, rank * 3 // 4,
                                                                                   rank // 4)
    assert d.wire_seconds == pytest.approx(rank * 3 / 4 / 1e9, rel=1e-12)
    assert d.seconds == pytest.approx(full.mxfp8.quantize_seconds + d.wire_seconds, rel=1e-12)  # no overlap
    host = Hardware(**{**hw.__dict__, **HOST})
    staging = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), host, engine_replicas=3, delta_fraction=0.25)
    direct = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), host, engine_replicas=3, delta_fraction=0.25,
                     direct=True)
    # the full refit's passes (each bucket packed and summed before its diff: 3 engine ranks' worth a trainer
    # rank; the engine's checksum and commit), then the diff of a trainer rank's stream once (replicas share
    # it), reading two streams at the checksum rate, and the patch at the copy rate (the defaults)
    send, check, commit = staging.passes.seconds(host)
    assert send == pytest.approx((3 * rank + 3 * (64 * 32 + 64)) / 1e9, rel=1e-12)  # o_proj pieces cut
    diff, patch = 2 * rank / 2e9, (rank // 4) / 1e9
    assert staging.delta.host_seconds == pytest.approx(send + diff + patch + check + commit, rel=1e-12)
    assert direct.passes.commit == 0
    assert direct.delta.host_seconds == pytest.approx(send + diff + patch + check, rel=1e-12)
    assert direct.delta.seconds == pytest.approx(d.seconds + send + diff + patch + check, rel=1e-12)
    rated = Hardware(**{**host.__dict__, "host_diff_gbps": 3.0, "host_patch_gbps": 0.5})
    got = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), rated, engine_replicas=3, delta_fraction=0.25,
                  direct=True)
    assert got.delta.host_seconds == pytest.approx(send + rank / 3e9 + (rank // 4) / 0.5e9 + check, rel=1e-12)
    one = predict(ENTRIES, Layout(fsdp=2), Layout(tp=2), host, engine_replicas=1, delta_fraction=0.25)
    assert one.delta.host_seconds - sum(one.passes.seconds(host)) == pytest.approx(diff + patch, rel=1e-9)
    out = staging.to_dict()
    assert out["delta"]["wire_bytes"] == rank * 6 // 4 and out["delta_fraction"] == 0.25
    assert out["delta_vs_full"] == pytest.approx(staging.delta.seconds / staging.mxfp8.seconds)
    assert full.to_dict()["delta"] is None and full.to_dict()["delta_vs_full"] is None
    for bad in (-0.1, 1.5, float("nan"), True, "x"):
        with pytest.raises(ValueError, match="delta_fraction"):
            predict(ENTRIES, Layout(), Layout(), hw, delta_fraction=bad)
    import numpy as np

    assert predict(ENTRIES, Layout(), Layout(), hw, delta_fraction=np.float32(0.5)).delta_fraction == 0.5
    assert str(predict(ENTRIES, Layout(), Layout(), hw, delta_fraction=-0.0).delta_fraction) == "0.0"


def test_host_passes_scatter_and_zero_copy_buckets():
    o_proj = [("m.layers.0.self_attn.o_proj.weight", (64, 64), BF16)]
    # a row-parallel trainer (tp=2: column halves) into one engine rank: each piece is a column half of the
    # engine's full tensor, received in a buffer and scattered at commit; contiguous on the trainer
    r = predict(o_proj, Layout(tp=2), Layout(), Hardware(), bucket_bytes=1 << 20)
    full = 64 * 64 + 64 * 2
    assert r.passes == HostPasses(pack=full // 2, cut=0, sender_checksum=0, checksum=full, commit=full,
                                  scatter=full)
    # one piece of 4096 value bytes in 1024-byte buckets: the expected 3072 bytes go out zero-copy (only
    # read for their checksum), the rest is packed
    r = predict(o_proj, Layout(), Layout(), Hardware(host_copy_gbps=1.0, host_checksum_gbps=3.0),
                bucket_bytes=1024)
    assert r.passes == HostPasses(pack=full - 3072, cut=0, sender_checksum=3072, checksum=full, commit=full,
                                  scatter=0)
    assert r.passes.seconds(r.hardware)[0] == pytest.approx((full - 3072) / 1e9 + 3072 / 3e9, rel=1e-12)
    with pytest.raises(ValueError, match="bucket_bytes"):
        predict(o_proj, Layout(), Layout(), bucket_bytes=0)


def test_config_entries_count_tied_weights_once(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "tie_word_embeddings": True}
    names = [n for n, _, _ in config_entries(cfg)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))


def test_plan_cli_json_and_exit_codes(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    run = CliRunner().invoke
    res = run(app, ["plan", str(tmp_path), "--trainer", "fsdp=2", "--engine", "tp=2", "--json", "-"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)  # JSON alone on stdout; the table on stderr, as the README says
    assert "MB per engine rank" in res.stderr and "per engine rank" not in res.stdout  # a small model: MB
    assert "refit ms" in res.stderr and "0.000 │" not in res.stderr.split("refit ms")[1].split("\n")[0]
    assert d["trainer"] == "fsdp=2" and d["engine"] == "tp=2" and d["problems"] == []
    assert d["bf16"]["wire_bytes"] > d["mxfp8"]["wire_bytes"] > 0
    assert d["mxfp8"]["host_seconds"] == 0.0 and d["hardware"]["host_copy_gbps"] is None  # default: off
    res = run(app, ["plan", str(tmp_path), "--trainer", "fsdp=2", "--engine", "tp=2", "--host-copy-gbps", "1",
                    "--json", "-"])
    on = json.loads(res.stdout)
    assert res.exit_code == 0 and on["passes"] == d["passes"] and on["passes"]["commit"] > 0
    p = on["passes"]
    assert on["mxfp8"]["host_seconds"] == pytest.approx(
        (p["pack"] + p["cut"] + p["sender_checksum"] + p["checksum"] + p["commit"] + p["scatter"]) / 1e9)
    res = run(app, ["plan", str(tmp_path), "--delta-fraction", "0.05", "--link-gbit", "8", "--json", "-"])
    delta = json.loads(res.stdout)
    assert res.exit_code == 0 and delta["delta_fraction"] == 0.05 and 0 < delta["delta_vs_full"] < 1
    assert delta["delta"]["bytes_per_engine_rank"] == -(-delta["mxfp8"]["bytes_per_engine_rank"] * 5 // 100)
    res = run(app, ["plan", str(tmp_path), "--delta-fraction", "0.05"], env={"COLUMNS": "100"})
    assert res.exit_code == 0 and "MXFP8 delta" in res.output and "over full MXFP8" in res.output
    assert "counted only with --host-copy-gbps" in " ".join(res.output.split())  # the default leaves them out
    assert run(app, ["plan", str(tmp_path), "--delta-fraction", "2"]).exit_code == 2
    # down_proj K = 96 over tp = 2: 48 per rank straddles MXFP8 blocks -> a failed check (exit 1)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    res = run(app, ["plan", str(tmp_path / "config.json"), "--engine", "tp=2"])
    assert res.exit_code == 1 and "K=96 split over tp=2" in res.output
    assert run(app, ["plan", str(tmp_path), "--engine", "tp=0"]).exit_code == 2
    assert run(app, ["plan", str(tmp_path / "missing.json")]).exit_code == 2
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert run(app, ["plan", str(tmp_path / "bad.json")]).exit_code == 2


def test_plan_link_rate_in_bits_as_nics_are_rated_or_in_bytes_by_name(tmp_path):
    """A 400 Gb/s NIC is --link-gbit 400 = --link-gbytes 50 (the default); the old --link-gbps (GB/s, read as
    bits by users: 8x off) still works, with a warning; two spellings at once are refused."""
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    run = CliRunner().invoke

    def link(*args):
        res = run(app, ["plan", str(tmp_path), *args, "--json", "-"])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["hardware"]["link_gbps"]

    assert link() == link("--link-gbit", "400") == link("--link-gbytes", "50") == 50.0
    assert link("--link-gbit", "100") == 12.5
    res = run(app, ["plan", str(tmp_path), "--link-gbps", "25"])
    assert res.exit_code == 0 and "--link-gbit 200" in " ".join(res.output.split())
    res = run(app, ["plan", str(tmp_path), "--link-gbit", "400", "--link-gbytes", "50"])
    assert res.exit_code == 2 and "--link-gbit and --link-gbytes" in " ".join(res.output.split())


@pytest.mark.parametrize("text,want", [("vllm", ("vllm", Layout())), ("tp=2", ("mxport", Layout(tp=2))),
                                       ("vllm,tp=2", ("vllm", Layout(tp=2))),
                                       ("MXPORT", ("mxport", Layout())),
                                       ("tp=2, vllm", ("vllm", Layout(tp=2)))])
def test_parse_engine(text, want):
    from mxport.parallel import parse_engine

    assert parse_engine(text) == want


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2), Layout(tp=2, ep=4)])
def test_parse_engine_reads_what_a_layout_prints(layout):
    """str(Layout()) is "1": `mxport refit --trainer fsdp=2` (engine one rank) passes it on to its ranks."""
    from mxport.parallel import parse_engine

    assert parse_engine(str(layout)) == ("mxport", layout)
    assert parse_engine(f"vllm,{layout}") == ("vllm", layout)


@pytest.mark.parametrize("text", ["sglang", "vllm,mxport", "vllm,tp=0", "vllm,dp=2", "2"])
def test_parse_engine_rejects(text):
    from mxport.parallel import parse_engine

    with pytest.raises(ValueError):
        parse_engine(text)


def test_guide_capacity_tp_claim_holds():
    """docs/guide-capacity.md names a tensor-parallel size at which Qwen3-30B-A3B's experts cannot be MXFP8
    (K per rank not whole blocks): `mxport plan` reports exactly that at that size, nothing at half of it."""
    import re
    from pathlib import Path

    from mxport.capacity import predict_config, read_config

    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "docs" / "guide-capacity.md").read_text().split())
    m = re.search(r"Qwen3-30B-A3B at `tp=(\d+)` cannot take MXFP8 experts "
                  r"\(`down_proj` K = (\d+) / \1 = (\d+) per rank\)", text)
    assert m, "the claim moved: update this test"
    tp, k, per_rank = (int(g) for g in m.groups())
    config = read_config(root / "benchmarks" / "configs" / "qwen3-30b-a3b.json")
    assert config["moe_intermediate_size"] == k and k // tp == per_rank
    problems = predict_config(config, Layout.parse("fsdp=8"), Layout(tp=tp)).problems
    down = [p for p in problems if ".experts.down_proj:" in p]
    gate_up = [p for p in problems if ".experts.gate_up_proj:" in p]
    assert len(down) == len(gate_up) == config["num_hidden_layers"] and len(problems) == 2 * len(down)
    assert all(f"K={k} split over tp={tp} gives {per_rank} per rank" in p for p in down)
    # the same I sliced on the column side: vLLM's MXFP8 MoE refuses intermediate_size_per_partition 48
    assert all(f"I={k} split over tp={tp} gives {per_rank} per rank, not a multiple of 32 (vLLM's MXFP8 MoE"
               in p for p in gate_up)
    assert not predict_config(config, Layout.parse("fsdp=8"), Layout(tp=tp // 2)).problems


@pytest.mark.parametrize("cfg, missing", [
    ({"model_type": "llama"},
     "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size"),
    ({"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 128, "moe_intermediate_size": 32}, "num_experts"),
])
def test_plan_refuses_a_config_without_its_sizes(tmp_path, cfg, missing):
    """A config with only ``model_type`` (or an MoE one without its expert count) was planned with
    transformers' default sizes: refused, one line naming the missing fields, exit 2."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["plan", str(tmp_path)])
    assert res.exit_code == 2 and res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"error: config gives no {missing}: the model's sizes are needed"), line
    with pytest.raises(ValueError, match=f"config gives no {missing}:"):
        config_entries(cfg)


def test_plan_names_attention_heads_the_engine_tp_does_not_divide():
    """Found by a newcomer: `mxport plan --engine tp=2` on the embedded model (9 heads) predicted a refit
    (exit 0) that `mxport refit` refuses; both now read the problem from one place (predict's problems)."""
    from mxport.capacity import predict_config

    config = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 1,
              "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 1000}
    problems = predict_config(config, Layout(), Layout(tp=2)).problems
    assert problems[0] == ("9 attention heads do not divide by tp=2 (vLLM refuses this layout; tp can be 1, "
                           "3, 9)")
    assert not any("attention heads" in p for p in predict_config(config, Layout(), Layout(tp=3)).problems)
