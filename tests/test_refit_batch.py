"""TrainerSource(arena=True) quantizes runs of consecutive plain-float weights with one
:func:`mxport.quantize.quantize_many` call into their send-buffer slots: the same tensors, in the same order,
with the same bytes as the per-weight source, whatever the batch size or kernel."""

from __future__ import annotations

import importlib

import pytest
import torch

import mxport.refit.trainer.whole as trainer_mod
from mxport.refit.buckets import byte_view
from mxport.refit.trainer import TrainerSource

mq = importlib.import_module("mxport.quantize")  # the module (mxport.quantize is also the function)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mxport.models import load_causal_lm
    from mxport.testing import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("m") / "llama", hidden=64, intermediate=80, layers=3)
    m, _ = load_causal_lm(path, dtype=torch.float32)
    with torch.no_grad():  # one weight in bf16, one in float16: a batch mixes input dtypes
        m.model.layers[1].mlp.up_proj.weight.data = m.model.layers[1].mlp.up_proj.weight.data.bfloat16()
        m.model.layers[2].self_attn.k_proj.weight.data = m.model.layers[2].self_attn.k_proj.weight.data.half()
    return m


@pytest.mark.parametrize("batch_numel", [1, 5000, 1 << 22])
@pytest.mark.parametrize("kernel", [None, "eager"])
def test_batched_arena_sends_what_per_weight_quantize_sends(model, monkeypatch, batch_numel, kernel):
    calls = []
    real = mq.quantize_many

    def spy(xs, *args, **kwargs):
        calls.append(len(xs))
        return real(xs, *args, **kwargs)

    monkeypatch.setattr(mq, "quantize_many", spy)
    monkeypatch.setattr(trainer_mod, "BATCH_NUMEL", batch_numel)
    plain = TrainerSource(model, kernel=kernel)
    arena = TrainerSource(model, arena=True, kernel=kernel)
    want = list(plain.tensors())
    assert calls == []  # without a send buffer: one quantize per weight, as before
    for _ in range(2):  # twice: the slots are rewritten in place
        got = list(arena.tensors())
        assert len(got) == len(want) == len(arena.plan.entries)
        for e, a, b in zip(arena.plan.entries, got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape == e.shape, e.name
            assert torch.equal(byte_view(a), byte_view(b)), e.name
    quantized = sum(e.role == "values" for e in arena.plan.entries)
    assert sum(calls) == 2 * quantized
    if batch_numel == 1:
        assert set(calls) == {1}
    elif batch_numel == 5000:  # 64 x 64 = 4096 elements (or more) per weight: a second one fills the batch
        assert max(calls) == 2
    else:  # a layer's 7 linear weights are consecutive in the plan: whole layers in one call
        assert max(calls) >= 7


def test_generator_stays_lazy(model):
    """Pulling the first tensor quantizes one run, not the model: the other slots still hold their old
    bytes."""
    arena = TrainerSource(model, arena=True)
    slots = arena._slots
    for s in slots:
        if s.dtype != torch.float32:  # (float32 slots hold the adopted kept parameters: left alone)
            s.view(torch.uint8).fill_(0xEE)
    it = arena.tensors()
    first = next(it)
    assert first.data_ptr() == slots[0].data_ptr()
    last_values = max(i for i, e in enumerate(arena.plan.entries) if e.role == "values")
    assert bool((slots[last_values].view(torch.uint8) == 0xEE).all())
    rest = list(it)
    assert not bool((slots[last_values].view(torch.uint8) == 0xEE).all()) and len(rest) + 1 == len(slots)
