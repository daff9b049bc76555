"""mxport.nn: MXFP8Linear forward paths, cache invalidation, quantize_model, load_checkpoint."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mxport
from mxport.nn import MXFP8Experts, MXFP8Linear, mxfp8_modules, quantize_model


def _components(n, k, seed=0, fp8=torch.float8_e4m3fn):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k)
    return mxport.quantize(w, fp8)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 100), m=st.integers(1, 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       fp8=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]))
def test_weight_only_equals_x_matmul_dequantized_weight(n, k, m, dtype, fp8):
    comps = _components(n, k, seed=n * 1000 + k, fp8=fp8)
    lin = MXFP8Linear.from_components(comps)
    x = torch.randn(m, k).to(dtype)
    y = lin(x)
    assert y.dtype == dtype
    assert torch.equal(y, x @ mxport.dequantize(comps, dtype).T)


def test_weight_only_3d_input_and_bias():
    comps = _components(24, 40)
    b = torch.randn(24)
    lin = MXFP8Linear.from_components(comps, bias=b)
    x = torch.randn(2, 3, 40)
    assert torch.equal(lin(x), x @ mxport.dequantize(comps).T + b)


def test_buffers_are_modelopt_names_and_components_are_views():
    comps = _components(8, 70)
    lin = MXFP8Linear.from_components(comps)
    sd = lin.state_dict()
    assert list(sd) == ["weight", "weight_scale"]
    assert sd["weight"].dtype == torch.float8_e4m3fn and tuple(sd["weight"].shape) == (8, 70)
    assert sd["weight_scale"].dtype == torch.uint8 and tuple(sd["weight_scale"].shape) == (8, 3)
    assert torch.equal(sd["weight"].view(torch.uint8), comps.data.view(torch.uint8))
    assert torch.equal(sd["weight_scale"], comps.scale_inv)
    c = lin.components()
    assert c.data.data_ptr() == lin.weight.data_ptr()
    assert c.scale_inv.data_ptr() == lin.weight_scale.data_ptr()


def test_cache_invalidated_by_in_place_scale_write():
    # all scales 127 (x1), then one byte 127 -> 128 doubles the block's contribution: output of a 1-block row
    # doubles
    data = (torch.arange(32 * 4, dtype=torch.float32).reshape(4, 32) / 16 - 4).to(torch.float8_e4m3fn)
    comps = mxport.MXFP8Components(data, torch.full((4, 1), 127, dtype=torch.uint8))
    lin = MXFP8Linear.from_components(comps)
    x = torch.randn(3, 32)
    y1 = lin(x)
    assert torch.equal(lin(x), y1)  # second call: served from the cache
    ptr = lin.weight_scale.data_ptr()
    lin.weight_scale[2, 0] = 128  # in place, as a refit receiver writes
    y2 = lin(x)
    assert lin.weight_scale.data_ptr() == ptr
    assert torch.equal(y2[:, 2], 2 * y1[:, 2])
    assert torch.equal(y2[:, [0, 1, 3]], y1[:, [0, 1, 3]])


def test_cache_invalidated_by_load_components_keeps_pointers():
    a, b = _components(16, 64, seed=1), _components(16, 64, seed=2)
    lin = MXFP8Linear.from_components(a)
    x = torch.randn(2, 64)
    ya = lin(x)
    pw, ps = lin.weight.data_ptr(), lin.weight_scale.data_ptr()
    lin.load_components(b)
    assert (lin.weight.data_ptr(), lin.weight_scale.data_ptr()) == (pw, ps)
    assert torch.equal(lin(x), x @ b.dequantize().T)
    assert not torch.equal(lin(x), ya)


def test_refresh_after_write_that_bypasses_version_counter():
    a = _components(8, 32, seed=3)
    lin = MXFP8Linear.from_components(a)
    x = torch.randn(2, 32)
    y = lin(x)
    with torch.no_grad():
        lin.weight_scale.data.add_(1)  # writes through .data do not bump weight_scale._version
    assert torch.equal(lin(x), y)  # so the cache cannot see them ...
    lin.refresh()  # ... until refresh()
    assert torch.equal(lin(x), 2 * y)


def test_activation_mxfp8_quantizes_input_rowwise():
    comps = _components(12, 50, seed=4)
    lin = MXFP8Linear.from_components(comps, activation="mxfp8")
    x = torch.randn(2, 3, 50)
    xq = mxport.quantize(x.reshape(6, 50)).dequantize().reshape(2, 3, 50)
    assert torch.equal(lin(x), xq @ comps.dequantize().T)
    assert not torch.equal(lin(x), x @ comps.dequantize().T)


def test_activation_mxfp8_uses_weight_element_format():
    comps = _components(4, 32, seed=5, fp8=torch.float8_e5m2)
    lin = MXFP8Linear.from_components(comps, activation="mxfp8")
    x = torch.randn(3, 32)
    xq = mxport.quantize(x, torch.float8_e5m2).dequantize()
    assert torch.equal(lin(x), xq @ comps.dequantize().T)


def test_module_to_dtype_keeps_fp8_bytes():
    comps = _components(8, 40, seed=6)
    lin = MXFP8Linear.from_components(comps, bias=torch.randn(8))
    lin.to(torch.bfloat16)
    assert lin.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(lin.weight.view(torch.uint8), comps.data.view(torch.uint8))
    assert lin.bias.dtype == torch.bfloat16


def test_hardware_path_not_chosen_on_cpu():
    lin = MXFP8Linear.from_components(_components(32, 64), activation="mxfp8")
    assert not lin._hardware_ok(torch.randn(16, 64))
    lin.use_mx_gemm = True
    with pytest.raises(RuntimeError, match="MX GEMM"):
        lin(torch.randn(16, 64))


def test_bad_inputs():
    with pytest.raises(ValueError, match="activation"):
        MXFP8Linear(32, 8, activation="int8")
    with pytest.raises(TypeError, match="fp8_dtype"):
        MXFP8Linear(32, 8, fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in_features"):
        MXFP8Linear(0, 8)
    lin = MXFP8Linear(32, 8)
    with pytest.raises(ValueError, match="features"):
        lin(torch.randn(2, 31))
    with pytest.raises(ValueError, match="do not fit"):
        lin.load_components(_components(8, 33))
    with pytest.raises(TypeError, match="float8_e5m2"):
        lin.load_components(_components(8, 32, fp8=torch.float8_e5m2))
    with pytest.raises(TypeError, match="MXFP8Components"):
        lin.load_components(torch.zeros(8, 32))
    col = mxport.quantize(torch.randn(8, 32), direction="columnwise")
    with pytest.raises(ValueError, match="rowwise"):
        MXFP8Linear.from_components(col)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(10, 64)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"up_proj": nn.Linear(64, 96, bias=True), "down_proj": nn.Linear(96, 64)})
            for _ in range(2))
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 10, bias=False)


def test_quantize_model_replaces_policy_linears_only():
    model = _Tiny()
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    quantize_model(model)
    mx = mxfp8_modules(model)
    assert sorted(mx) == ["layers.0.down_proj", "layers.0.up_proj", "layers.1.down_proj", "layers.1.up_proj"]
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, MXFP8Linear)
    for name, mod in mx.items():
        expect = mxport.quantize(ref[f"{name}.weight"])
        assert torch.equal(mod.weight.view(torch.uint8), expect.data.view(torch.uint8))
        assert torch.equal(mod.weight_scale, expect.scale_inv)
    assert torch.equal(model.layers[0]["up_proj"].bias, ref["layers.0.up_proj.bias"])


def test_quantize_model_policy_exclude_and_native_components():
    from mxport.policy import PrecisionPolicy

    model = _Tiny()
    comps = _components(96, 64, seed=9, fp8=torch.float8_e5m2)
    quantize_model(model, PrecisionPolicy(exclude=("layers.1.*",)))
    assert sorted(mxfp8_modules(model)) == ["layers.0.down_proj", "layers.0.up_proj"]
    from mxport.nn import weight_components

    assert weight_components(comps) is comps  # already MXFP8: exported as is, never requantized
    with pytest.raises(TypeError):
        weight_components(torch.zeros(4, 32, dtype=torch.int32))


# -- load_checkpoint
# ---------------------------------------------------------------------------------------------
def _write_checkpoint(src_dir, out, fmt, fp8=torch.float8_e4m3fn):
    """An MXFP8 checkpoint in ``fmt`` written by hand from the naming contract (values + scales by name)."""
    import json

    from safetensors.torch import load_file, save_file

    from mxport.checkpoint.naming import quantization_config, scale_name
    from mxport.policy import PrecisionPolicy, exclude_modules

    state = load_file(str(src_dir / "model.safetensors"))
    decisions = PrecisionPolicy().decide_all([(n, tuple(t.shape), t.dtype) for n, t in state.items()])
    tensors = {}
    for d in decisions:
        if d.quantize:
            c = mxport.quantize(state[d.name], fp8)
            tensors[d.name] = c.data
            tensors[scale_name(d.name, fmt)] = c.scale_inv
        else:
            tensors[d.name] = state[d.name]
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, exclude_modules(decisions))
    if fp8 == torch.float8_e5m2:  # as older mxport wrote E5M2 sglang checkpoints (export refuses them now)
        config["quantization_config"]["fmt"] = "e5m2"
    (out / "config.json").write_text(json.dumps(config))
    return out


def _tiny_llama(tmp_path):
    from transformers import AutoModelForCausalLM

    from mxport.testing import make_tiny_llama

    path = make_tiny_llama(tmp_path / "src", hidden=64, intermediate=96, layers=2, with_tokenizer=False)
    return path, lambda: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors", "sglang"])
def test_quantize_model_and_load_checkpoint_bit_identical(tmp_path, fmt):
    from mxport.nn import load_checkpoint

    path, load = _tiny_llama(tmp_path)
    fp8 = torch.float8_e5m2 if fmt == "sglang" else torch.float8_e4m3fn
    ckpt = _write_checkpoint(path, tmp_path / fmt, fmt, fp8)
    a = quantize_model(load(), fp8_dtype=fp8)
    # 1) a plain model: its policy linears are replaced by MXFP8Linear modules
    b = load()
    report = load_checkpoint(b, ckpt)
    assert len(report["replaced"]) == 14 and not report["missing"] and not report["unexpected"]
    # 2) an already quantized model: filled in place, buffers keep their storage
    c = quantize_model(load(), fp8_dtype=fp8)
    ptrs = {n: m.weight.data_ptr() for n, m in mxfp8_modules(c).items()}
    with torch.no_grad():
        for m in mxfp8_modules(c).values():
            m.weight_scale.zero_()
    report = load_checkpoint(c, ckpt)
    assert len(report["mxfp8"]) == 14
    assert ptrs == {n: m.weight.data_ptr() for n, m in mxfp8_modules(c).items()}
    ma = mxfp8_modules(a)
    for other in (b, c):
        mo = mxfp8_modules(other)
        assert list(mo) == list(ma)
        for name in ma:
            assert mo[name].weight.dtype == fp8
            assert torch.equal(mo[name].weight.view(torch.uint8), ma[name].weight.view(torch.uint8)), name
            assert torch.equal(mo[name].weight_scale, ma[name].weight_scale), name
    x = torch.randint(0, 256, (1, 7))
    assert torch.equal(a(x).logits, b(x).logits)


def test_load_checkpoint_rejects_mismatch(tmp_path):
    from mxport.nn import load_checkpoint

    path, load = _tiny_llama(tmp_path)
    ckpt = _write_checkpoint(path, tmp_path / "ck", "modelopt")
    model = quantize_model(load())
    model.model.layers[0].mlp.up_proj = MXFP8Linear(64, 97)  # a module the checkpoint's shape cannot fill
    with pytest.raises(ValueError, match="do not fit"):
        load_checkpoint(model, ckpt)
    with pytest.raises(ValueError, match="not an MXFP8 checkpoint"):
        load_checkpoint(load(), path)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors", "sglang"])
def test_load_checkpoint_from_mxport_export_sharded_tied(tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    from mxport.checkpoint.export import export_checkpoint
    from mxport.nn import load_checkpoint
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "src", tie_word_embeddings=True, with_tokenizer=False)
    out = tmp_path / "out"
    export_checkpoint(str(src), out, fmt=fmt, max_shard_size="40KB")
    assert len(list(out.glob("*.safetensors"))) > 1

    def load():
        return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()

    a = quantize_model(load())
    b = load()
    load_checkpoint(b, out)
    ma, mb = mxfp8_modules(a), mxfp8_modules(b)
    assert list(ma) == list(mb) and len(ma) == 14
    for name in ma:
        assert torch.equal(mb[name].weight.view(torch.uint8), ma[name].weight.view(torch.uint8)), name
        assert torch.equal(mb[name].weight_scale, ma[name].weight_scale), name
    assert b.lm_head.weight is b.model.embed_tokens.weight  # still tied


def test_load_checkpoint_fused_experts_become_mxfp8_experts(tmp_path):
    from transformers import AutoModelForCausalLM

    from mxport.checkpoint.export import export_checkpoint
    from mxport.nn import load_checkpoint
    from mxport.testing import make_tiny_mixtral

    src = make_tiny_mixtral(tmp_path / "moe", fused_experts=True, layers=1, with_tokenizer=False)
    out = tmp_path / "out"
    export_checkpoint(str(src), out, fmt="modelopt")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ref = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    report = load_checkpoint(model, out)
    assert "model.layers.0.mlp.experts.gate_up_proj" in report["replaced"] and report["missing"] == []
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, MXFP8Experts)  # the 3-D MXFP8 values stay MXFP8 (issue 14), not decoded
    want = mxport.quantize(ref)
    assert torch.equal(experts._buffers["gate_up_proj"].view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(experts._buffers["gate_up_proj_scale"], want.scale_inv)
    assert torch.equal(experts.gate_up_proj, want.dequantize())  # what the forward reads, per expert row
    assert not isinstance(model.model.layers[0].mlp.gate, MXFP8Linear)  # the router stays high precision


# -- load_checkpoint never loads wrong weights (issue 12 item 6)
# ---------------------------------------------------
def _resave(path, fn):
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    fn(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_load_checkpoint_refuses_values_without_scale_and_wrong_element(tmp_path):
    from mxport.nn import load_checkpoint

    path, load = _tiny_llama(tmp_path)
    ckpt = _write_checkpoint(path, tmp_path / "ck", "modelopt")
    v = "model.layers.0.mlp.down_proj.weight"
    # without its scale the FP8 bytes were copied unscaled into nn.Linear (absmax ~400 instead of ~0.004)
    _resave(ckpt / "model.safetensors", lambda s: s.pop(v + "_scale"))
    with pytest.raises(ValueError, match=f"{v}: FP8 values without a scale"):
        load_checkpoint(load(), ckpt)
    ckpt = _write_checkpoint(path, tmp_path / "ck2", "modelopt")
    # E4M3 bytes stored as F8_E5M2 were decoded as E5M2; the config says E4M3
    _resave(ckpt / "model.safetensors", lambda s: s.__setitem__(v, s[v].view(torch.float8_e5m2)))
    with pytest.raises(ValueError, match="float8_e5m2 values, but the quantization config"):
        load_checkpoint(load(), ckpt)


def test_load_checkpoint_strict_over_every_model_tensor(tmp_path):
    import json

    from mxport.checkpoint.export import export_checkpoint
    from mxport.nn import load_checkpoint

    path, load = _tiny_llama(tmp_path)
    out = tmp_path / "out"
    export_checkpoint(str(path), out, fmt="modelopt", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"omits shard\\(s\\) \\['{shard}'\\]"):  # its tensors were dropped
        load_checkpoint(load(), out)
    (out / "model.safetensors.index.json").unlink()  # shards found by name; the norm removed from its shard
    _resave(out / shard, lambda s: s.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"model tensors not in the checkpoint \['model.norm.weight'\]"):
        load_checkpoint(load(), out)
    report = load_checkpoint(load(), out, strict=False)
    assert report["missing"] == ["model.norm.weight"] and len(report["replaced"]) == 14


def test_load_checkpoint_bias_after_its_replaced_weight(tmp_path):
    from mxport.checkpoint.writers import ShardedSafetensorsWriter, TensorSpec
    from mxport.nn import load_checkpoint

    g = torch.Generator().manual_seed(0)
    c = mxport.quantize(torch.randn(8, 64, generator=g))
    bias = torch.randn(8, generator=g)
    tensors = {"lin.weight": c.data, "lin.weight_scale": c.scale_inv, "lin.bias": bias}  # bias written last
    (tmp_path / "ck").mkdir()
    w = ShardedSafetensorsWriter(tmp_path / "ck", [[TensorSpec(k, t.dtype, tuple(t.shape))
                                                    for k, t in tensors.items()]])
    for k, t in tensors.items():
        w.write(k, t)
    w.close()
    (tmp_path / "ck" / "config.json").write_text('{"quantization_config": {"quant_method": "modelopt", '
                                                 '"quant_algo": "MXFP8"}}')
    model = torch.nn.Sequential()
    model.add_module("lin", torch.nn.Linear(64, 8))
    report = load_checkpoint(model, tmp_path / "ck")
    assert report["replaced"] == ["lin.weight"] and report["tensors"] == ["lin.bias"]
    assert not report["missing"]
    # the bias lands in the new module, not in the old module's
    assert isinstance(model.lin, MXFP8Linear) and torch.equal(model.lin.bias, bias)
