""":class:`FP4Linear`: a linear layer whose weight is held as MXFP4 or NVFP4 bytes (the refit engine's and
the twin's module for ``--quant mxfp4|nvfp4``), and :func:`quantize_model_fp4`, which converts a model's
planned linears into it.

Buffers, under ModelOpt's checkpoint names (the refit plan's names): ``weight`` (uint8 ``[N, K/2]``, two
E2M1 codes a byte, low nibble first), ``weight_scale`` (``[N, K/block]``: uint8 E8M0 bytes for MXFP4,
``float8_e4m3fn`` for NVFP4) and, for NVFP4, ``weight_scale_2`` (the float32 global scale, one element).
The forward decodes the weight (cached until a buffer's version changes: a refit writing the buffers in
place is seen) and runs ``F.linear`` in the input's dtype: weight-only, as vLLM's W4A16 paths do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp4 import FP4Components, abs_max
from .nn import planned_linears
from .policy import global_scale_group
from .quants import Quant, get_quant


def _version(t: torch.Tensor):
    try:
        return (t._version, t.data_ptr())
    except RuntimeError:  # inference tensors have no version counter
        return None


class FP4Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as 4-bit ``quant`` (``"mxfp4"`` or ``"nvfp4"``) bytes; see the
    module doc for the buffers. A fresh module holds zeros (scale 1.0). ValueError for a K that is not whole
    blocks of the format."""

    def __init__(self, in_features: int, out_features: int, quant: Quant | str, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        q = get_quant(quant)
        if q.fp4_format is None:
            raise ValueError(f"FP4Linear holds mxfp4 or nvfp4 weights, not {q.name}")
        if out_features <= 0 or not q.aligned(in_features):
            raise ValueError(f"FP4Linear({in_features}, {out_features}): K must be a positive multiple of "
                             f"{q.block} ({q.name}) and N positive")
        self.in_features, self.out_features, self.quant = int(in_features), int(out_features), q
        shape = (self.out_features, self.in_features)
        one = 127 if q.scale_dtype == torch.uint8 else 1.0
        self.register_buffer("weight", torch.zeros(q.values_shape(shape), dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.full(q.scale_shape(shape), one, device=device).to(
            q.scale_dtype))
        if q.global_scale:
            self.register_buffer("weight_scale_2", torch.ones(1, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(self.out_features, device=device)) if bias else None
        self._cache: tuple | None = None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, quant: Quant | str,
                    global_scale: torch.Tensor | None = None) -> FP4Linear:
        """The 4-bit form of ``linear``'s weight (NVFP4 with ``global_scale``, else the weight's own), its
        bias copied in its dtype."""
        n, k = linear.weight.shape
        mod = cls(k, n, quant, bias=linear.bias is not None, device=linear.weight.device)
        mod.load(mod.quant.quantize(linear.weight.detach(), global_scale=global_scale))
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return mod

    def components(self) -> FP4Components:
        """The weight as :class:`~mxport.fp4.FP4Components` of the buffers themselves (views)."""
        g = self.weight_scale_2 if self.quant.global_scale else None
        return FP4Components(self.quant.fp4_format, self.weight, self.weight_scale, g)

    @torch.no_grad()
    def load(self, q) -> None:
        """Copy a :class:`~mxport.quants.Quantized` of this shape into the buffers in place."""
        self.weight.copy_(q.values)
        self.weight_scale.copy_(q.scale)
        if self.quant.global_scale:
            self.weight_scale_2.copy_(q.global_scale.reshape(1))

    def decoded_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight decoded to ``dtype``, cached until a buffer changes."""
        key = (dtype, *[_version(b) for b in self.buffers()])
        if None in key[1:] or self._cache is None or self._cache[0] != key:
            w = self.components().dequantize(dtype)
            self._cache = (key, w) if None not in key[1:] else None
            return w
        return self._cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.decoded_weight(x.dtype), bias)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) casts every floating buffer: the E4M3 scales and the float32 global scale are
        # bytes of the format, never rounded: a cast one is replaced by the original, moved where fn put it
        before = {n: b for n, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for n, b in before.items():
            if self._buffers[n].dtype != b.dtype:
                self._buffers[n] = b.to(self._buffers[n].device)
        self._cache = None
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, quant={self.quant.name}")


def shared_global_scales(weights: dict[str, torch.Tensor], quant: Quant | str) -> dict[str, torch.Tensor]:
    """NVFP4: each weight's global scale, shared where vLLM fuses (:func:`mxport.policy.global_scale_group`:
    q/k/v, gate/up, one expert's w1/w3) as export writes it; {} for formats without one. ``weights``: name
    (``<m>.weight``) -> tensor."""
    q = get_quant(quant)
    if not q.global_scale:
        return {}
    amax: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        key = global_scale_group(name)
        m = abs_max(w)
        amax[key] = torch.maximum(amax[key], m) if key in amax else m
    return {name: q.global_scale_of(amax[global_scale_group(name)]) for name in weights}


@torch.no_grad()
def quantize_model_fp4(model: nn.Module, quant: Quant | str, policy=None) -> nn.Module:
    """Replace, in place, the ``nn.Linear`` layers ``policy`` quantizes (:func:`mxport.nn.planned_linears`)
    with :class:`FP4Linear` of ``quant``; NVFP4 global scales shared as :func:`shared_global_scales` says.
    Fused 3-D expert weights are not converted (TypeError naming the first)."""
    q = get_quant(quant)
    names = planned_linears(model, policy)
    from .nn import planned_experts

    experts = planned_experts(model, policy)
    if any(experts.values()):
        raise TypeError(f"{q.name} refit does not convert fused 3-D expert weights yet "
                        f"({next(n for n, w in experts.items() if w)})")
    g = shared_global_scales({f"{n}.weight": model.get_submodule(n).weight for n in names}, q)
    for name in names:
        mod = FP4Linear.from_linear(model.get_submodule(name), q, g.get(f"{name}.weight"))
        model.set_submodule(name, mod)
    return model
