"""Activation calibration for W4A4 NVFP4 checkpoints (``mxport export --quant nvfp4 --activation nvfp4``):
each quantized linear's largest input magnitude over a few calibration batches, and from it the input scale
ModelOpt 0.47 writes (``input_scale = amax / (6 * 448)``, float32:
``NVFP4QTensor.get_activation_scaling_factor``).

The batches default to ``mxport verify``'s built-in prompts through the model's chat template (one batch a
prompt), or :func:`mxport.models.vocabulary_prompts` for a model without a tokenizer. The model runs in its
own dtype, unquantized, as ModelOpt's calibration does (its quantizers only observe).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .fp4 import E2M1_MAX, E4M3_MAX
from .policy import global_scale_group


def calibration_batches(model: nn.Module, tokenizer=None, count: int = 8) -> list[torch.Tensor]:
    """``count`` token-id batches ``[1, T]``: the built-in prompts (chat template) or vocabulary prompts."""
    if tokenizer is None:
        from .models import vocabulary_prompts

        return list(vocabulary_prompts(int(model.config.vocab_size), count).split(1))
    from .prompts import load_prompts
    from .verify import encode_prompts

    return [ids.view(1, -1) for ids in encode_prompts(tokenizer, load_prompts()[:count])]


@torch.no_grad()
def input_amax(model: nn.Module, modules: Sequence[str],
               batches: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The largest |input| of each named linear module over ``model``'s forward of every batch (float32, 0-d).
    ValueError for a module that never ran."""
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def pre(_mod, args):
            m = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], m) if name in amax else m
        return pre

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in modules]
    try:
        for ids in batches:
            model(input_ids=ids.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in modules if n not in amax]
    if missing:
        raise ValueError(f"calibration never ran {missing[0]!r} (and {len(missing) - 1} more)")
    return amax


def nvfp4_input_scales(amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt's NVFP4 ``input_scale`` per module, ``amax / (6 * 448)``, the largest of the modules vLLM
    fuses (q/k/v and gate/up read the same input: the same value)."""
    group: dict[str, torch.Tensor] = {}
    for n, a in amax.items():
        k = global_scale_group(f"{n}.weight")
        group[k] = torch.maximum(group[k], a) if k in group else a
    return {n: group[global_scale_group(f"{n}.weight")] / (E2M1_MAX * E4M3_MAX) for n in amax}
