"""native_tensors: every native MXFP8 producer of a model, wherever it sits, in canonical order.

The module tree mimics a Megatron-LM GPT with Transformer Engine ``fp8_param`` weights (parameters that ARE TE
``MXFP8Tensor`` wrapper subclasses), then Megatron's ``quantize_params_to_mxfp8``
(megatron/core/inference/quantization/utils.py), reproduced here step for step: recurse over
``named_children`` with ``_prefix``, and for each own parameter with MXFP8 storage
``del module._parameters[key]; setattr(module, key, MXFP8Tensor(...))``, keyed by ``f"{_prefix}{key}"`` in the
returned ``persistent_buffers`` dict. Those names are computed independently of mxport: the test checks that
``native_tensors`` finds exactly those objects under exactly those names.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_grouped import grouped_tensor, high_precision_grouped
from test_sources_megatron import megatron_tensor
from torch import nn

import mxport
from mxport.sources import is_mxfp8_producer, native_attributes, native_tensors
from mxport.sources.te import to_te_layout

TE_FIELDS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv", "_fp8_dtype",
             "_with_gemm_swizzled_scales")


class TEMXFP8Tensor(torch.Tensor):
    """Stand-in for TE's ``MXFP8Tensor`` (a wrapper subclass, nominal dtype bf16)
    as ``fp8_param`` makes it."""

    @staticmethod
    def __new__(cls, fields: dict, shape):
        inst = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=torch.bfloat16,
                                                   device=fields["_rowwise_data"].device)
        for name in TE_FIELDS:
            setattr(inst, name, fields[name])
        return inst

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            src = args[0]
            return TEMXFP8Tensor({n: getattr(src, n) for n in TE_FIELDS}, src.shape)
        raise RuntimeError(f"stand-in forbids {func}")


def te_param(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, (shape[-1],), generator=g).float())
    data, scale = to_te_layout(mxport.quantize(x))
    fields = dict(zip(TE_FIELDS, (data, scale, None, None, 7, False), strict=True))
    return nn.Parameter(TEMXFP8Tensor(fields, shape))


class Linear(nn.Module):
    def __init__(self, n, k, seed, fp8=True):
        super().__init__()
        self.weight = te_param((n, k), seed) if fp8 else nn.Parameter(torch.randn(n, k).bfloat16())
        self.bias = nn.Parameter(torch.zeros(n))


class GroupedLinear(nn.Module):
    """TE GroupedLinear without single_grouped_weight: one parameter per expert, weight0 ... weight{n-1}."""

    def __init__(self, num_gemms, n, k, seed):
        super().__init__()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", te_param((n, k), seed + i))


class Layer(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = Linear(96, 64, seed)
        self.self_attention.linear_proj = Linear(64, 32, seed + 1)
        self.mlp = nn.Module()
        self.mlp.router = Linear(4, 64, seed + 2, fp8=False)  # kept in bf16 by the precision recipe
        self.mlp.experts = nn.Module()
        self.mlp.experts.linear_fc1 = GroupedLinear(3, 64, 64, seed + 3)
        self.mlp.experts.linear_fc2 = GroupedLinear(3, 64, 32, seed + 6)


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(64, 64)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([Layer(10), Layer(30)])
        self.output_layer = Linear(64, 64, 60)  # a vocabulary of 64: TE shapes are multiples of 32


def _has_mxfp8_storage(val) -> bool:
    return isinstance(val, TEMXFP8Tensor)


@torch.no_grad()
def quantize_params_to_mxfp8(model, persistent_buffers=None, _prefix=""):
    """Megatron's loop, step for step (see the module docstring)."""
    if persistent_buffers is None:
        persistent_buffers = {}
    for child_name, child_module in model.named_children():
        child_prefix = f"{_prefix}{child_name}." if _prefix else f"{child_name}."
        quantize_params_to_mxfp8(child_module, persistent_buffers, _prefix=child_prefix)
    for key in list(model._parameters.keys()):
        val = model._parameters[key]
        if val is None or not _has_mxfp8_storage(val):
            continue
        fqn = f"{_prefix}{key}"
        bf16 = mxport.export_components(val).dequantize(torch.bfloat16)
        mcore_tensor, _ = megatron_tensor(bf16.float(), backend="triton")
        persistent_buffers[fqn] = mcore_tensor
        del model._parameters[key]
        setattr(model, key, mcore_tensor)
    return persistent_buffers


def canonical(names):
    """named_modules() order, then local names sorted inside a module (the refit's canonical order)."""
    return sorted(names, key=lambda n: (n.rsplit(".", 1)[0] if "." in n else "", n.rsplit(".", 1)[-1]))


def test_megatron_after_quantize_params_to_mxfp8():
    model = GPT()
    te_names = [n for n, p in model.named_parameters() if isinstance(p, TEMXFP8Tensor)]
    before = native_tensors(model)  # TE fp8_param: the producers ARE parameters
    assert [n for n, _ in before] == te_names and len(te_names) == 2 * (2 + 6) + 1
    assert all(obj is model.get_parameter(n) for n, obj in before)

    persistent = quantize_params_to_mxfp8(model)
    assert not any(isinstance(p, TEMXFP8Tensor) for p in model.parameters())  # invisible to named_parameters
    found = native_tensors(model)
    assert sorted(n for n, _ in found) == sorted(persistent) == sorted(te_names)
    module_order = [n for n, _ in model.named_modules()]
    owners = [module_order.index(n.rsplit(".", 1)[0]) for n, _ in found]
    assert owners == sorted(owners)  # model order: each module's producers together, modules in order
    assert [n for n, _ in found][:8] == [
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight0", "decoder.layers.0.mlp.experts.linear_fc1.weight1",
        "decoder.layers.0.mlp.experts.linear_fc1.weight2", "decoder.layers.0.mlp.experts.linear_fc2.weight0",
        "decoder.layers.0.mlp.experts.linear_fc2.weight1", "decoder.layers.0.mlp.experts.linear_fc2.weight2",
    ]
    for name, obj in found:
        assert obj is persistent[name]  # the very objects Megatron refits in place (CUDA-graph pointers)
        c = mxport.export_components(obj)
        assert c.data.data_ptr() == obj.data.data_ptr()
    qkv = model.decoder.layers[1].self_attention.linear_qkv
    assert native_attributes(qkv) == {"weight": qkv.weight} and "bias" not in native_attributes(qkv)


def test_parameters_buffers_attributes_one_canonical_order():
    model = nn.Module()
    model.a = nn.Module()
    model.a.register_buffer("w_buf", te_param((32, 64), 1).data)  # a producer as a persistent buffer
    model.a.register_buffer("cache", te_param((32, 64), 2).data, persistent=False)  # not a weight: skipped
    model.a.zeta = te_param((32, 32), 3)  # parameter
    model.a.beta = megatron_tensor(torch.randn(32, 64))[0]  # plain attribute
    model.a._workspace = megatron_tensor(torch.randn(32, 64))[0]  # private state: skipped
    model.a.cached = {"w": megatron_tensor(torch.randn(32, 64))[0]}  # inside a container: skipped
    model.a.blockwise = SimpleNamespace(  # TE Float8Blockwise storage: same attribute names, float32 scales
        _rowwise_data=torch.zeros(32, 64, dtype=torch.uint8), _rowwise_scale_inv=torch.ones(1, 32),
        _columnwise_data=None, _columnwise_scale_inv=None, _fp8_dtype=7)
    model.a.float_w = nn.Parameter(torch.randn(8, 32))
    model.b = nn.Module()
    model.b.tied = model.a.beta  # the same object under a second name: listed once, at its first name
    model.b.comp = mxport.quantize(torch.randn(4, 32))
    model.top = megatron_tensor(torch.randn(16, 32))[0]
    names = [n for n, _ in native_tensors(model)]
    assert names == ["top", "a.beta", "a.w_buf", "a.zeta", "b.comp"]
    assert names == canonical(names)


def test_grouped_tensor_parameter_is_one_entry():
    g = nn.Module()
    g.linear_fc1 = nn.Module()
    xs = [torch.randn(64, 96) for _ in range(4)]
    g.linear_fc1.weight = nn.Parameter(grouped_tensor(xs, "rowwise"))  # GroupedLinear(single_grouped_weight)
    g.linear_fc2 = nn.Module()
    g.linear_fc2.weight = nn.Parameter(high_precision_grouped([x.bfloat16() for x in xs]))  # bf16: not native
    found = native_tensors(g)
    assert [n for n, _ in found] == ["linear_fc1.weight"]
    assert mxport.export_components(found[0][1]).shape == (4, 64, 96)
    assert len(mxport.export_grouped_components(found[0][1])) == 4


def test_what_counts_as_a_producer():
    mt = megatron_tensor(torch.randn(32, 64))[0]
    assert is_mxfp8_producer(mt) and is_mxfp8_producer(mxport.quantize(torch.randn(2, 32)))
    assert not is_mxfp8_producer(SimpleNamespace(data=torch.randn(32, 64), scale=torch.ones(4)))  # float
    assert not is_mxfp8_producer(torch.randn(4, 32)) and not is_mxfp8_producer(object())
    nvfp4_grouped = SimpleNamespace(num_tensors=1, rowwise_data=torch.zeros(16, dtype=torch.uint8),
                                    columnwise_data=None, scale_inv=torch.zeros(512, dtype=torch.uint8),
                                    columnwise_scale_inv=None, quantizer=SimpleNamespace(dtype=10))
    assert not is_mxfp8_producer(nvfp4_grouped)  # kFloat4E2M1: not MXFP8
    with pytest.raises(TypeError, match="nn.Module"):
        native_tensors(object())
