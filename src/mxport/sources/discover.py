"""Find the native MXFP8 storage of a model wherever it sits: parameters, buffers, plain module attributes.

A trainer's MXFP8 weights are not always parameters:

- Transformer Engine ``fp8_param`` (``quantized_model_init`` / ``fp8_model_init``): each weight parameter IS
  an ``MXFP8Tensor`` (``transformer_engine/pytorch/tensor/mxfp8_tensor.py``); with
  ``GroupedLinear(single_grouped_weight=True)`` the experts' weights are ONE parameter ``weight``, a
  ``GroupedTensor`` (``transformer_engine/pytorch/module/grouped_linear.py``, ``make_grouped_weights``).
- Megatron-LM ``quantize_params_to_mxfp8`` / ``quantize_model_to_mxfp8``
  (``megatron/core/inference/quantization/utils.py``) walk the modules, and for every parameter with MXFP8
  storage do ``del module._parameters[key]; setattr(module, key, MXFP8Tensor(...))``: the weight becomes a
  plain attribute (an ``MXFP8Tensor`` dataclass of ``megatron/core/inference/quantization/mxfp8_tensor.py``,
  not a tensor), invisible to ``named_parameters()`` / ``state_dict()``, under the same local name
  (``weight``; TE's per-expert ``weight0`` ... ``weight{n-1}``). Megatron keys its ``persistent_buffers`` dict
  by the same fully qualified name (``f"{prefix}{key}"`` over ``named_children``).

:func:`native_tensors` finds all of them; :func:`native_attributes` only the plain attributes (what
``named_parameters()`` misses).
"""

from __future__ import annotations

import torch
from torch import nn

from ..components import MXFP8Components
from ..formats import FLOAT8_E8M0FNU, is_fp8_dtype
from . import resolve_fp8_dtype
from .grouped import is_high_precision_grouped, is_te_grouped
from .megatron import is_megatron_mxfp8
from .te import is_te_mxfp8
from .torchao import is_torchao_mx

_SCALE_DTYPES = (torch.uint8, FLOAT8_E8M0FNU)


def _e8m0_scales(*scales) -> bool:
    """At least one scale tensor present, and every present one holds E8M0 bytes (uint8 / float8_e8m0fnu):
    TE's Float8Blockwise / delayed-scaling storages share the attribute names but carry float32 scales."""
    present = [s for s in scales if s is not None]
    return bool(present) and all(isinstance(s, torch.Tensor) and s.dtype in _SCALE_DTYPES for s in present)


def _names_fp8(value) -> bool:
    try:
        resolve_fp8_dtype(value)
    except TypeError:
        return False
    return True


def _is_te_grouped_mxfp8(obj) -> bool:
    if not is_te_grouped(obj) or is_high_precision_grouped(obj):
        return False
    quantizer = getattr(obj, "quantizer", None)
    dtype = next((getattr(obj, a) for a in ("_fp8_dtype", "fp8_dtype") if getattr(obj, a, None) is not None),
                 getattr(quantizer, "dtype", None))
    return _names_fp8(dtype) and _e8m0_scales(obj.scale_inv, obj.columnwise_scale_inv)


def is_mxfp8_producer(obj) -> bool:
    """True for an object :func:`mxport.export_components` exports as native MXFP8 (never requantized).

    That is (duck-typed, no framework imported): an :class:`~mxport.MXFP8Components`; a TE ``MXFP8Tensor`` /
    ``MXFP8TensorStorage`` whose FP8 type is E4M3/E5M2 and whose scales are E8M0 bytes; a TE ``GroupedTensor``
    / ``GroupedTensorStorage`` quantized the same way; a torchao ``MXTensor`` with FP8 elements; a Megatron-LM
    inference ``MXFP8Tensor`` (FP8 / uint8 ``data``, E8M0 ``scale``). Float tensors, TE Float8 /
    Float8Blockwise / NVFP4 storages, FP4 ``MXTensor`` and high-precision grouped weights are not producers.
    """
    if isinstance(obj, MXFP8Components):
        return True
    if is_te_mxfp8(obj):
        return _names_fp8(obj._fp8_dtype) and _e8m0_scales(obj._rowwise_scale_inv, obj._columnwise_scale_inv)
    if is_te_grouped(obj):
        return _is_te_grouped_mxfp8(obj)
    if is_torchao_mx(obj):
        return isinstance(obj.elem_dtype, torch.dtype) and is_fp8_dtype(obj.elem_dtype)
    if is_megatron_mxfp8(obj):
        return (obj.data.dtype == torch.uint8 or is_fp8_dtype(obj.data.dtype)) and _e8m0_scales(obj.scale)
    return False


def native_attributes(module: nn.Module) -> dict[str, object]:
    """The MXFP8 producers held as plain attributes of ``module`` itself (not its children), by local name, in
    attribute order: what ``module.named_parameters()`` / ``state_dict()`` do not see (Megatron after
    ``quantize_params_to_mxfp8``). Names starting with ``_`` are private state (caches, workspaces) and are
    skipped; so are containers (a producer inside a dict or list is not a weight of the module)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and is_mxfp8_producer(value)}


def native_tensors(model: nn.Module) -> list[tuple[str, object]]:
    """Every native MXFP8 producer reachable in ``model``, as ``(name, obj)`` pairs.

    Contract (what the refit plan relies on; the same canonical order as ``mxport.refit``'s
    ``model_tensors``):

    - **What counts**: :func:`is_mxfp8_producer` objects that are a module's own parameter, persistent buffer
      (``state_dict`` entries; non-persistent buffers are caches, skipped), or public plain attribute
      (:func:`native_attributes`). Float tensors are not returned (quantize-for-inference is the caller's
      business), nor is anything nested in a container.
    - **Order**: ``model.named_modules()`` order (each module before its children, children in registration
      order; a module reachable twice is visited once, at its first name); inside one module, by local name
      (``sorted``), whatever the kind (parameter, buffer or attribute), so the order does not depend on when
      a parameter was swapped for an attribute.
    - **Names**: ``"<module path>.<local name>"`` (just the local name on the root module): the
      ``named_parameters()`` / ``state_dict()`` key the tensor has or, for a plain attribute, had before
      Megatron replaced the parameter (also Megatron's ``persistent_buffers`` key). These are the trainer's
      names; mapping them to a checkpoint's (HF) names is the caller's naming step.
    - **Sharing**: an object reachable under several names (tied weights, a shared module) appears once, at
      its first name in the order above.
    - A TE ``GroupedTensor`` (one parameter for all experts) is ONE entry: :func:`mxport.export_components`
      gives its ``[E, N, K]`` components, :func:`mxport.export_grouped_components` one per expert.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    seen: set[int] = set()
    out: list[tuple[str, object]] = []
    for prefix, module in model.named_modules():
        local: dict[str, object] = {n: p for n, p in module._parameters.items() if p is not None}
        local.update((n, b) for n, b in module._buffers.items()
                     if b is not None and n not in module._non_persistent_buffers_set)
        local.update(native_attributes(module))
        for name in sorted(local):
            obj = local[name]
            if id(obj) in seen or not is_mxfp8_producer(obj):
                continue
            seen.add(id(obj))
            out.append((f"{prefix}.{name}" if prefix else name, obj))
    return out


__all__ = ["is_mxfp8_producer", "native_attributes", "native_tensors"]
