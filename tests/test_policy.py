"""The precision policy: default decisions on real model layouts, user rules, MoE groups, bad arguments."""

import pytest
import torch

from mxport.policy import Decision, PrecisionPolicy, decide_module_names, exclude_modules, layer_index

BF16 = torch.bfloat16


def llama_entries(layers=3):
    e = [("model.embed_tokens.weight", (256, 64), BF16)]
    for i in range(layers):
        p = f"model.layers.{i}."
        e += [(p + "input_layernorm.weight", (64,), BF16)]
        e += [(p + f"self_attn.{m}_proj.weight", (64 if m in "qo" else 32, 64), BF16) for m in "qkvo"]
        e += [(p + "self_attn.q_proj.bias", (64,), BF16)]
        e += [(p + "post_attention_layernorm.weight", (64,), BF16)]
        e += [(p + "mlp.gate_proj.weight", (96, 64), BF16), (p + "mlp.up_proj.weight", (96, 64), BF16),
              (p + "mlp.down_proj.weight", (64, 96), BF16)]
    e += [("model.norm.weight", (64,), BF16), ("lm_head.weight", (256, 64), BF16)]
    return e


def by_name(decisions):
    return {d.name: d for d in decisions}


def test_default_llama_decisions():
    d = by_name(PrecisionPolicy().decide_all(llama_entries()))
    assert (not d["model.embed_tokens.weight"].quantize
            and "embedding" in d["model.embed_tokens.weight"].reason)
    assert not d["lm_head.weight"].quantize and "lm_head" in d["lm_head.weight"].reason
    assert not d["model.norm.weight"].quantize
    assert not d["model.layers.0.input_layernorm.weight"].quantize
    assert not d["model.layers.0.self_attn.q_proj.bias"].quantize
    quantized = sorted(n for n, x in d.items() if x.quantize)
    assert quantized == sorted(f"model.layers.{i}.{m}.weight" for i in range(3) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert all(x.reason for x in d.values())


def test_order_and_fields_follow_entries():
    entries = llama_entries(1)
    out = PrecisionPolicy().decide_all(entries)
    assert [(x.name, x.shape, x.dtype) for x in out] == entries
    assert isinstance(out[0], Decision) and out[0].to_dict()["dtype"] == "bfloat16"


def test_safetensors_dtype_names_and_non_float():
    out = PrecisionPolicy().decide_all([("a.weight", (8, 64), "BF16"), ("b.weight", (8, 64), "I32"),
                                        ("c.weight", (8, 64), torch.float8_e4m3fn)])
    assert [x.quantize for x in out] == [True, False, False]
    assert out[0].dtype == torch.bfloat16


def test_exclude_include_patterns_match_tensor_and_module_names():
    pol = PrecisionPolicy(exclude=("*.mlp.*",))
    d = by_name(pol.decide_all(llama_entries()))
    assert not d["model.layers.1.mlp.up_proj.weight"].quantize
    assert "--exclude '*.mlp.*'" in d["model.layers.1.mlp.up_proj.weight"].reason
    assert d["model.layers.1.self_attn.q_proj.weight"].quantize
    pol = PrecisionPolicy(exclude=("model.layers.1.self_attn.k_proj",))  # module name, no wildcard
    d = by_name(pol.decide_all(llama_entries()))
    assert not d["model.layers.1.self_attn.k_proj.weight"].quantize
    assert d["model.layers.0.self_attn.k_proj.weight"].quantize
    pol = PrecisionPolicy(include=("*o_proj",))
    d = by_name(pol.decide_all(llama_entries()))
    assert sorted(n for n, x in d.items() if x.quantize) == [f"model.layers.{i}.self_attn.o_proj.weight"
                                                              for i in range(3)]
    assert "--include" in d["model.layers.0.mlp.up_proj.weight"].reason
    # include cannot force a structural keep
    d = by_name(PrecisionPolicy(include=("*",)).decide_all(llama_entries()))
    assert not d["lm_head.weight"].quantize and not d["model.embed_tokens.weight"].quantize


@pytest.mark.parametrize(("first", "last", "quantized_layers"), [(1, 0, {1, 2}), (0, 1, {0, 1}), (1, 1, {1}),
                                                                  (3, 0, set()), (5, 5, set())])
def test_keep_first_keep_last(first, last, quantized_layers):
    d = PrecisionPolicy(keep_first=first, keep_last=last).decide_all(llama_entries(3))
    assert {layer_index(x.name) for x in d if x.quantize} == quantized_layers
    kept = [x for x in d if not x.quantize and x.name.endswith("q_proj.weight")]
    assert all("--keep-" in x.reason for x in kept)


def mixtral_entries(fused=False):
    e = [("model.embed_tokens.weight", (256, 64), BF16)]
    for i in range(2):
        p = f"model.layers.{i}."
        e += [(p + "self_attn.q_proj.weight", (64, 64), BF16)]
        if fused:
            e += [(p + "mlp.gate.weight", (4, 64), BF16),
                  (p + "mlp.experts.gate_up_proj", (4, 192, 64), BF16),
                  (p + "mlp.experts.down_proj", (4, 64, 96), BF16)]
        else:
            e += [(p + "block_sparse_moe.gate.weight", (4, 64), BF16)]
            e += [(p + f"block_sparse_moe.experts.{x}.{w}.weight", (96, 64) if w != "w2" else (64, 96), BF16)
                  for x in range(4) for w in ("w1", "w2", "w3")]
    e += [("lm_head.weight", (256, 64), BF16)]
    return e


@pytest.mark.parametrize("fused", [False, True])
def test_moe_router_kept_experts_quantized(fused):
    d = by_name(PrecisionPolicy().decide_all(mixtral_entries(fused)))
    router = "model.layers.0.mlp.gate.weight" if fused else "model.layers.0.block_sparse_moe.gate.weight"
    assert not d[router].quantize and "router" in d[router].reason
    experts = [x for n, x in d.items() if ".experts." in n]
    assert experts and all(x.quantize for x in experts)
    if fused:
        assert "fused expert" in d["model.layers.0.mlp.experts.gate_up_proj"].reason


def test_experts_of_one_moe_layer_share_one_precision():
    pol = PrecisionPolicy(exclude=("model.layers.0.*.experts.2.w1.weight",))
    d = by_name(pol.decide_all(mixtral_entries()))
    layer0 = [x for n, x in d.items() if n.startswith("model.layers.0.block_sparse_moe.experts.")]
    layer1 = [x for n, x in d.items() if n.startswith("model.layers.1.block_sparse_moe.experts.")]
    assert not any(x.quantize for x in layer0) and all(x.quantize for x in layer1)
    assert "share one precision" in d["model.layers.0.block_sparse_moe.experts.0.w2.weight"].reason
    excl = exclude_modules(d.values())
    assert "model.layers.0.block_sparse_moe.experts" in excl and "lm_head" in excl
    assert not any("embed" in m or "norm" in m for m in excl)


@pytest.mark.parametrize(("rule", "group"), [
    (dict(exclude=("model.layers.1.self_attn.k_proj",)), ("q_proj", "k_proj", "v_proj")),
    (dict(include=("*.q_proj", "*down_proj", "*o_proj")), ("q_proj", "k_proj", "v_proj")),
    (dict(exclude=("model.layers.1.mlp.up_proj",)), ("gate_proj", "up_proj")),
])
def test_engine_fused_projections_share_one_precision(rule, group):
    d = by_name(PrecisionPolicy(**rule).decide_all(llama_entries()))
    parent = "self_attn" if "q_proj" in group else "mlp"
    members = [d[f"model.layers.1.{parent}.{m}.weight"] for m in group]
    assert not any(x.quantize for x in members)
    assert all("share one precision" in x.reason or "kept by" in x.reason for x in members)
    if "exclude" in rule:  # other layers untouched
        assert all(d[f"model.layers.0.{parent}.{m}.weight"].quantize for m in group)


def test_decide_module_names_on_a_module():
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 64),
                                 "proj": torch.nn.Linear(64, 32), "norm": torch.nn.LayerNorm(64)})
    d = decide_module_names(model)
    assert set(d) == {"embed_tokens", "proj", "norm"}
    assert d["proj"].quantize and not d["embed_tokens"].quantize and not d["norm"].quantize


def test_bad_arguments():
    with pytest.raises(ValueError, match="keep_first"):
        PrecisionPolicy(keep_first=-1)
    with pytest.raises(TypeError, match="keep_last"):
        PrecisionPolicy(keep_last=1.5)
    with pytest.raises(TypeError, match="exclude"):
        PrecisionPolicy(exclude=("",))
    assert PrecisionPolicy(include="*q_proj").include == ("*q_proj",)
    with pytest.raises(ValueError, match="twice"):
        PrecisionPolicy().decide_all([("a.weight", (2, 2), BF16)] * 2)
    with pytest.raises(TypeError, match="entries"):
        PrecisionPolicy().decide_all([("a.weight", (2, 2))])
    with pytest.raises(TypeError, match="dtype"):
        PrecisionPolicy().decide_all([("a.weight", (2, 2), "NOPE")])
