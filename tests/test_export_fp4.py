"""4-bit export (``quant="mxfp4" | "nvfp4"``): every packed value, block scale and global scale is
mxport.fp4's bytes of the source weight, the global scale shared where vLLM fuses, under each checkpoint
format's names and config; inspect reads them back; the unaligned, sglang and already-4-bit cases refused."""

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import mxport.checkpoint.export as export_mod
from mxport.checkpoint.export import export_checkpoint
from mxport.checkpoint.inspect import inspect
from mxport.checkpoint.naming import detect_fp4, quant_names
from mxport.checkpoint.readers import SafetensorsDir
from mxport.cli import app
from mxport.fp4 import quantize_fp4
from mxport.policy import global_scale_group
from mxport.testing import make_tiny_llama

CASES = [(q, f) for q in ("nvfp4", "mxfp4") for f in ("modelopt", "compressed-tensors")]


def load(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def expected_globals(src: dict[str, torch.Tensor], fmt: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each projection's NVFP4 ``(global scale g, stored tensor)`` from the max amax of its fusion group:
    ModelOpt ``g = amax / (6 * 448)`` stored as is; compressed-tensors the divisor ``d = (6 * 448) / amax``
    stored, ``g = 1 / d`` (float32 throughout)."""
    amax: dict[str, torch.Tensor] = {}
    for n, w in src.items():
        if n.endswith("_proj.weight"):
            k = global_scale_group(n)
            amax[k] = torch.maximum(amax.get(k, torch.tensor(0.0)), w.abs().amax().float())
    out = {}
    for n in (n for n in src if n.endswith("_proj.weight")):
        a = amax[global_scale_group(n)]
        if fmt == "modelopt":
            out[n] = (a / 2688.0, a / 2688.0)
        else:
            d = torch.tensor(2688.0) / a
            out[n] = (1.0 / d, d)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quant,fmt", CASES)
def test_fp4_export_is_fp4_bytes_of_the_source(tmp_path, quant, fmt, dtype):
    src_dir = make_tiny_llama(tmp_path / "src", dtype=dtype, intermediate=160)
    src = {n: SafetensorsDir(src_dir).get(n) for n in SafetensorsDir(src_dir).names()}
    r = export_checkpoint(src_dir, tmp_path / "out", fmt=fmt, quant=quant)
    out = load(tmp_path / "out")
    g_of = expected_globals(src, fmt)
    n_quantized = 0
    for name, w in src.items():
        if not name.endswith("_proj.weight"):
            assert torch.equal(out[name], w), name  # kept as it is
            continue
        values, scale, glob = quant_names(name, fmt, quant)
        kwargs = {"global_scale": g_of[name][0]} if quant == "nvfp4" else {}
        want = quantize_fp4(w, quant, **kwargs)
        assert out[values].dtype == torch.uint8 and torch.equal(out[values], want.data), values
        assert out[scale].dtype == want.scale.dtype
        assert torch.equal(out[scale].view(torch.uint8), want.scale.view(torch.uint8)), scale
        if quant == "nvfp4":
            stored = out[glob]
            assert stored.dtype == torch.float32 and stored.shape == (() if fmt == "modelopt" else (1,))
            assert torch.equal(stored.reshape(()), g_of[name][1].reshape(())), glob
            # what vLLM computes from the file at load is the g the values were quantized with
            g = stored if fmt == "modelopt" else 1.0 / stored.max()
            assert torch.equal(g.reshape(()), g_of[name][0].reshape(())), glob
        else:
            assert glob is None and not any(k.startswith(name[:-6]) and "global" in k for k in out)
        n_quantized += 1
    assert n_quantized == 14 and r.quant == quant and r.to_dict()["quant"] == quant
    assert detect_fp4(json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]) == (
        fmt, quant)


def test_nvfp4_global_scale_is_shared_where_vllm_fuses(tmp_path):
    src_dir = make_tiny_llama(tmp_path / "src")
    export_checkpoint(src_dir, tmp_path / "out", quant="nvfp4")
    out = load(tmp_path / "out")
    attn = "model.layers.0.self_attn."
    mlp = "model.layers.0.mlp."
    qkv = {out[attn + p + ".weight_scale_2"].item() for p in ("q_proj", "k_proj", "v_proj")}
    gate_up = {out[mlp + p + ".weight_scale_2"].item() for p in ("gate_proj", "up_proj")}
    assert len(qkv) == 1 and len(gate_up) == 1
    # o_proj and down_proj are not fused: each keeps its own
    src = SafetensorsDir(src_dir)
    for p in (attn + "o_proj.weight", mlp + "down_proj.weight"):
        assert out[p + "_scale_2"].item() == (src.get(p).abs().amax().float() / 2688.0).item()


def test_fp4_export_streams_in_row_chunks(tmp_path, monkeypatch):
    """Chunks of a few rows (the global scale read once before) give the bytes of the whole-tensor export."""
    src_dir = make_tiny_llama(tmp_path / "src", dtype=torch.float32)
    export_checkpoint(src_dir, tmp_path / "whole", quant="nvfp4")
    monkeypatch.setattr(export_mod, "CHUNK_NUMEL", 64 * 3)
    export_checkpoint(src_dir, tmp_path / "chunks", quant="nvfp4", fmt="modelopt")
    a, b = load(tmp_path / "whole"), load(tmp_path / "chunks")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


@pytest.mark.parametrize("quant,fmt", CASES)
def test_inspect_reads_fp4_exports(tmp_path, quant, fmt):
    export_checkpoint(make_tiny_llama(tmp_path / "src"), tmp_path / "out", fmt=fmt, quant=quant)
    r = inspect(tmp_path / "out")
    assert r.ok, r.problems
    assert r.quant == quant and r.format == fmt and len(r.pairs) == 14
    assert all(p["element"] == "e2m1" and p["ok"] for p in r.pairs)
    assert {t["role"] for t in r.tensors} == {"values", "scales", "kept"}


def _rewrite(path, name, tensor):
    from safetensors.torch import save_file

    f = path / "model.safetensors"
    tensors = load(path)
    tensors[name] = tensor
    save_file(tensors, str(f))


def test_inspect_flags_broken_fp4_tensors(tmp_path):
    export_checkpoint(make_tiny_llama(tmp_path / "src"), tmp_path / "out", quant="nvfp4")
    w = "model.layers.0.mlp.down_proj.weight"
    out = load(tmp_path / "out")
    nan = out[w + "_scale"].clone()
    nan.view(torch.uint8)[0, 0] = 0x7F
    _rewrite(tmp_path / "out", w + "_scale", nan)
    _rewrite(tmp_path / "out", "model.layers.1.mlp.down_proj.weight_scale_2", torch.tensor(-1.0))
    wrong = torch.zeros(2, 2, dtype=torch.uint8)
    _rewrite(tmp_path / "out", "model.layers.0.mlp.up_proj.weight_scale", wrong)
    problems = "\n".join(inspect(tmp_path / "out").problems)
    assert f"{w}_scale: 1 NaN scale byte(s)" in problems
    assert "layers.1.mlp.down_proj.weight_scale_2: -1.0 is not a finite global scale above 0" in problems
    assert "model.layers.0.mlp.up_proj.weight_scale: uint8 scales; nvfp4 stores float8_e4m3fn" in problems


def test_fp4_refusals(tmp_path):
    src = make_tiny_llama(tmp_path / "src", intermediate=40)  # down_proj K = 40: not whole 16s or 32s
    with pytest.raises(ValueError, match="K not a multiple of 16 cannot be NVFP4"):
        export_checkpoint(src, tmp_path / "a", quant="nvfp4")
    r = export_checkpoint(src, tmp_path / "b", quant="nvfp4", keep_unaligned=True)
    assert "model.layers.0.mlp.down_proj.weight" in r.kept_unaligned
    ok = make_tiny_llama(tmp_path / "ok", intermediate=48)  # 48 = 3 x 16: NVFP4 yes, MXFP4 no
    export_checkpoint(ok, tmp_path / "c", quant="nvfp4")
    with pytest.raises(ValueError, match="K not a multiple of 32 cannot be MXFP4"):
        export_checkpoint(ok, tmp_path / "d", quant="mxfp4")
    with pytest.raises(ValueError, match="format 'sglang' holds MXFP8 only"):
        export_checkpoint(ok, tmp_path / "e", quant="nvfp4", fmt="sglang")
    with pytest.raises(ValueError, match="quant must be one of"):
        export_checkpoint(ok, tmp_path / "f", quant="fp4")
    with pytest.raises(ValueError, match=r"\(nonzero_scales\) applies to MXFP8"):
        export_checkpoint(ok, tmp_path / "g", quant="mxfp4", nonzero_scales=True)
    with pytest.raises(ValueError, match="already an NVFP4 checkpoint"):  # values would pass as plain uint8
        export_checkpoint(tmp_path / "c", tmp_path / "h", quant="mxfp4")
    assert not (tmp_path / "a").exists() and not (tmp_path / "h").exists()


def test_cli_export_quant(tmp_path):
    src = make_tiny_llama(tmp_path / "src")
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "out"), "--quant", "nvfp4",
                                   "--format", "compressed-tensors", "--json", "-"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout[res.stdout.index("{"):res.stdout.rindex("}") + 1])
    assert r["quant"] == "nvfp4" and r["format"] == "compressed-tensors" and r["quantized"] == 14
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "tensor_group"
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "x"), "--quant", "mxfp4",
                                   "--format", "sglang"])
    assert res.exit_code == 2 and "holds MXFP8 only" in res.output
    res = CliRunner().invoke(app, ["export", str(src), "--dry-run", "--quant", "mxfp4"])
    assert res.exit_code == 0 and "14 tensors MXFP4" in res.output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cfg, activation", [("W4A16_NVFP4_CFG", "none"), ("NVFP4_DEFAULT_CFG", "nvfp4")])
def test_nvfp4_export_equals_modelopts_own_byte_for_byte(tmp_path, cfg, activation, dtype):
    """ModelOpt 0.47's own HF export of the same weights (its NVFP4 recipe quantized and, for W4A4, calibrated
    on the same batches): every tensor the same bytes, input scales included."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import LlamaForCausalLM

    src = make_tiny_llama(tmp_path / "src", dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (1, 16), generator=gen) for _ in range(3)]
    model = LlamaForCausalLM.from_pretrained(src, dtype="auto")
    mtq.quantize(model, getattr(mtq, cfg), lambda m: [m(b) for b in batches])
    export_hf_checkpoint(model, export_dir=str(tmp_path / "modelopt"))
    export_checkpoint(src, tmp_path / "mxport", quant="nvfp4", activation=activation, calibration=batches)
    theirs, ours = load(tmp_path / "modelopt"), load(tmp_path / "mxport")
    assert theirs.keys() == ours.keys()
    assert sum(k.endswith("input_scale") for k in ours) == (14 if activation == "nvfp4" else 0)
    for k in theirs:
        assert theirs[k].dtype == ours[k].dtype and theirs[k].shape == ours[k].shape, k
        assert torch.equal(theirs[k].reshape(-1).view(torch.uint8), ours[k].reshape(-1).view(torch.uint8)), k
    theirs_qc = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())
    algo = theirs_qc["quantization"]["quant_algo"]
    ours_qc = json.loads((tmp_path / "mxport" / "hf_quant_config.json").read_text())["quantization"]
    assert ours_qc["quant_algo"] == algo and ours_qc["group_size"] == 16


def test_cli_export_w4a4_writes_calibrated_input_scales(tmp_path):
    src = make_tiny_llama(tmp_path / "src")
    res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "out"), "--quant", "nvfp4",
                                   "--activation", "nvfp4", "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert "NVFP4 with calibrated input scales" in " ".join(res.output.split())
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["quant"], report["activation"]) == ("nvfp4", "nvfp4")  # the JSON says it is W4A4
    out = load(tmp_path / "out")
    scales = {k: v for k, v in out.items() if k.endswith(".input_scale")}
    assert len(scales) == 14
    assert all(v.dtype == torch.float32 and v.shape == () and v > 0 for v in scales.values())
    a = "model.layers.0.self_attn."
    assert out[a + "q_proj.input_scale"] == out[a + "k_proj.input_scale"] == out[a + "v_proj.input_scale"]
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_algo"] == "NVFP4"
    assert qc["config_groups"]["group_0"]["input_activations"]["num_bits"] == 4
    report = inspect(tmp_path / "out")
    assert report.ok
    pair = {t["name"]: t["pair"] for t in report.tensors}
    assert pair[a + "q_proj.input_scale"] == pair[a + "q_proj.weight_scale_2"] == a + "q_proj.weight"
    for bad in (["--quant", "mxfp4"], ["--quant", "nvfp4", "--format", "compressed-tensors"]):
        res = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "x"), "--activation", "nvfp4",
                                       *bad])
        assert res.exit_code == 2 and "needs --quant nvfp4 --format modelopt" in " ".join(res.output.split())


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
def test_an_empty_weight_exports_and_inspects(tmp_path, quant):
    """A weight of 0 rows (found by a breaking round: NVFP4's amax pass raised, inspect's statistics too)."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(0, 64, dtype=torch.bfloat16),
               "model.layers.0.mlp.up_proj.weight": torch.randn(32, 64).to(torch.bfloat16)},
              str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    export_checkpoint(src, tmp_path / "out", quant=quant)
    r = inspect(tmp_path / "out")
    assert r.ok, r.problems
    empty = next(p for p in r.pairs if p["shape"] == [0, 64])
    assert empty["ok"] and "absmax" not in empty


@pytest.mark.parametrize("fmt, name, stored, says", [
    ("modelopt", "weight_scale_2", torch.tensor(float("inf")), "inf is not a finite global scale above 0"),
    ("compressed-tensors", "weight_global_scale", torch.tensor([0.0]),
     "0.0 (as a divisor: global scale inf) is not a finite global scale above 0"),
])
def test_inspect_names_an_infinite_global_scale_without_crashing(tmp_path, fmt, name, stored, says):
    export_checkpoint(make_tiny_llama(tmp_path / "src"), tmp_path / "out", quant="nvfp4", fmt=fmt)
    w = "model.layers.0.mlp.down_proj."
    _rewrite(tmp_path / "out", w + name, stored)
    for stats in (True, False):
        r = inspect(tmp_path / "out", stats=stats)
        assert f"{w}{name}: {says}" in r.problems


def test_compressed_tensors_nvfp4_keeps_a_tiny_weight(tmp_path):
    """An amax below ~7.9e-36 overflows the divisor 2688 / amax: it is clamped to the largest float32 (it fell
    back to 1 and every value decoded to 0, found by a breaking round); ModelOpt's form keeps it too."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    w = torch.randn(8, 64) * 1e-39
    save_file({"model.layers.0.mlp.down_proj.weight": w}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    for fmt in ("compressed-tensors", "modelopt"):
        export_checkpoint(src, tmp_path / fmt, quant="nvfp4", fmt=fmt)
        r = inspect(tmp_path / fmt)
        assert r.ok, r.problems
        names = quant_names("model.layers.0.mlp.down_proj.weight", fmt, "nvfp4")
        out = load(tmp_path / fmt)
        g = out[names[2]].reshape(())
        g = g if fmt == "modelopt" else 1.0 / g
        from mxport.fp4 import NVFP4, FP4Components

        decoded = FP4Components(NVFP4, out[names[0]], out[names[1]], g).dequantize()
        assert (decoded - w).abs().max() <= 0.25 * w.abs().max() and decoded.abs().max() > 0, fmt


def test_mxfp8_readers_refuse_a_4bit_checkpoint_in_one_line(tmp_path):
    from mxport.checkpoint import open_checkpoint
    from mxport.checkpoint.readers import CheckpointError

    export_checkpoint(make_tiny_llama(tmp_path / "src"), tmp_path / "out", quant="mxfp4",
                      fmt="compressed-tensors")
    with pytest.raises(CheckpointError, match="holds MXFP4 weights .compressed-tensors.: `mxport inspect`"):
        open_checkpoint(tmp_path / "out")


def test_smaller_breaking_round_findings(tmp_path):
    """The dry run refuses what the export refuses (NVFP4 fused experts), reasons name the 4-bit format, a
    NaN weight is named, and MLA's q_a_proj / kv_a_proj_with_mqa share a global scale (vLLM fuses them)."""
    from safetensors.torch import save_file

    from mxport.testing import make_tiny_mixtral

    moe = make_tiny_mixtral(tmp_path / "moe", experts=2, layers=1, fused_experts=True)
    res = CliRunner().invoke(app, ["export", str(moe), "--dry-run", "--quant", "nvfp4"])
    assert res.exit_code == 2 and "fused expert tensors" in res.output
    res = CliRunner().invoke(app, ["export", str(make_tiny_llama(tmp_path / "l")), "--dry-run", "--quant",
                                   "mxfp4", "--json", "-"])
    decisions = json.loads(res.stdout[res.stdout.index("{"):])["decisions"]
    reasons = {d["reason"] for d in decisions if d["quantize"]}
    assert reasons == {"linear weight: MXFP4"}
    src = tmp_path / "nan"
    src.mkdir()
    w = torch.randn(8, 64)
    w[3, 7] = float("nan")
    save_file({"model.layers.0.mlp.up_proj.weight": w}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight: nvfp4: x holds NaN or Inf"):
        export_checkpoint(src, tmp_path / "o", quant="nvfp4")
    a = "model.layers.3.self_attn."
    assert global_scale_group(a + "q_a_proj.weight") == global_scale_group(a + "kv_a_proj_with_mqa.weight")
    assert global_scale_group(a + "q_b_proj.weight") == a + "q_b_proj.weight"
