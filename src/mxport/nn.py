"""Inference-side MXFP8: :class:`MXFP8Linear`, model conversion (:func:`quantize_model`) and checkpoint
loading (:func:`load_checkpoint`).

``MXFP8Linear`` keeps its weight as MXFP8 components in two buffers, ``weight`` (FP8 values ``[N, K]``) and
``weight_scale`` (uint8 E8M0 bytes ``[N, ceil(K/32)]``, compact rowwise), so its ``state_dict()`` names are
the ModelOpt checkpoint names (docs/format.md, "What each consumer expects"). Forward paths:

- weight-only (``activation="none"``): the weight is decoded (``float(q) * 2**(E-127)`` in float32, cast to
  the compute dtype) and multiplied with ``F.linear``. The decoded weight is cached; the cache key holds the
  buffers' ``_version`` counters and ``data_ptr``, so any in-place write (``copy_`` during a refit,
  ``load_components``) or a move invalidates it without a call; :meth:`MXFP8Linear.refresh` drops it
  explicitly.
- W8A8 emulation (``activation="mxfp8"``): the input is quantized rowwise along K (blocks of 32, ``rceil``,
  the weight's FP8 element format) with :func:`mxport.quantize`, decoded, then multiplied as above — what an
  MXFP8 GEMM computes, up to accumulation order.
- hardware (``activation="mxfp8"`` on a CUDA GPU with MX GEMM, SM100+, see
  :func:`mxport._env.mx_gemm_available`): ``torch._scaled_mm`` with both operands FP8 and swizzled
  ``float8_e8m0fnu`` scales (:func:`mxport.layouts.swizzle`, the cuBLAS ``VEC32_UE8M0`` layout), as torchao's
  MX linear calls it (``mx_formats/mx_ops.py``). Chosen automatically for E4M3 weights when K is a multiple of
  32 and N, M are multiples of 16; any failure falls back to emulation for good (with a warning).
  ``MXPORT_DISABLE_MX_GEMM=1`` or ``module.use_mx_gemm = False`` forces emulation. **Untested here**: the
  development machines have no SM100 GPU.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ._env import mx_gemm_available
from .components import MXFP8Components
from .formats import BLOCK_SIZE, ceil_div, element_format
from .layouts import swizzle
from .quantize import quantize

ACTIVATIONS = ("none", "mxfp8")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
#: dtypes a fused expert weight decodes to (the original parameter's; float32 for anything else)
_DECODE_DTYPES = (*_FLOAT_DTYPES, torch.float64)


def _version_key(t: torch.Tensor):
    """(version, data_ptr, device) of a tensor, or None when it has no version counter (inference tensors)."""
    try:
        return (t._version, t.data_ptr(), t.device)
    except RuntimeError:
        return None


class MXFP8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as MXFP8 (FP8 values + one E8M0 shared scale per block of 32 along
    K).

    Args:
        in_features: K.
        out_features: N.
        bias: add a ``bias`` parameter ``[N]`` (dtype ``compute_dtype`` or float32).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, the element format of ``weight``.
        activation: ``"none"`` (weight-only: activations stay in the compute dtype) or ``"mxfp8"``
            (activations quantized rowwise along K on the fly, W8A8; the hardware path where available).
        device: where the buffers live.
        compute_dtype: dtype of the matmul; ``None`` = the input's dtype.

    Buffers: ``weight`` (``fp8_dtype``, ``[N, K]``), ``weight_scale`` (uint8 E8M0, ``[N, ceil(K/32)]``). A
        fresh
    module holds zeros with scale byte 127 (1.0). ``module.to(dtype)`` casts the bias only; FP8 values are
    restored to ``fp8_dtype`` (the round trip through any wider float dtype is exact).

    Raises:
        ValueError: non-positive sizes, an unknown ``activation``.
        TypeError: ``fp8_dtype`` not an FP8 element dtype, ``compute_dtype`` not float32/bfloat16/float16.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, activation: str = "none",
                 device: torch.device | str | None = None, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if int(in_features) <= 0 or int(out_features) <= 0:
            raise ValueError(f"in_features and out_features must be positive, got "
                             f"({in_features}, {out_features})")
        fmt = element_format(fp8_dtype)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be 'none' or 'mxfp8', got {activation!r}")
        if compute_dtype is not None and compute_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"compute_dtype must be None, float32, bfloat16 or float16, "
                            f"got {compute_dtype!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.fp8_dtype = fmt.dtype
        self.activation = activation
        self.compute_dtype = compute_dtype
        # : None = choose the hardware path automatically; False = never; True = require it (error if
        # unavailable)
        self.use_mx_gemm: bool | None = None
        self._mx_gemm_failed: str | None = None
        k_blocks = ceil_div(self.in_features, BLOCK_SIZE)
        self.register_buffer("weight", torch.zeros((self.out_features, self.in_features), dtype=fmt.dtype,
                                                   device=device))
        self.register_buffer("weight_scale", torch.full((self.out_features, k_blocks), 127, dtype=torch.uint8,
                                                        device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=compute_dtype or torch.float32,
                                                 device=device))
        else:
            self.register_parameter("bias", None)
        self._cache: dict = {}

    # -- construction and in-place updates
    # --------------------------------------------------------------------
    @classmethod
    def from_components(cls, components: MXFP8Components, bias: torch.Tensor | None = None, *,
                        activation: str = "none", compute_dtype: torch.dtype | None = None) -> MXFP8Linear:
        """A module holding (copies of) rowwise 2-D ``components`` ``[N, K]`` and an optional ``bias``
        ``[N]``.

        Raises:
            TypeError: ``components`` is not an :class:`MXFP8Components`.
            ValueError: not rowwise, not 2-D, a bias of the wrong shape.
        """
        _check_linear_components(components)
        n, k = components.shape
        mod = cls(k, n, bias=bias is not None, fp8_dtype=components.fp8_dtype, activation=activation,
                  device=components.device, compute_dtype=compute_dtype)
        mod.load_components(components)
        if bias is not None:
            if tuple(bias.shape) != (n,):
                raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
            mod.bias = nn.Parameter(bias.detach().clone().to(compute_dtype or bias.dtype),
                                    requires_grad=False)
        return mod

    def components(self) -> MXFP8Components:
        """The weight as rowwise :class:`MXFP8Components` whose ``data`` / ``scale_inv`` are the buffers
        themselves (views: writing them writes the module)."""
        return MXFP8Components(self.weight, self.weight_scale, "rowwise")

    @torch.no_grad()
    def load_components(self, components: MXFP8Components) -> None:
        """Copy ``components`` into the buffers in place (``copy_``: the buffers keep their storage and
        ``data_ptr``, so CUDA graphs and refit receivers holding them stay valid); the decoded cache goes
        stale through the buffers' version counters.

        Raises:
            TypeError: not an :class:`MXFP8Components`, or its FP8 element dtype differs from ``weight``'s.
            ValueError: not rowwise, or a shape other than ``[out_features, in_features]``.
        """
        _check_linear_components(components)
        if tuple(components.shape) != (self.out_features, self.in_features):
            raise ValueError(f"components of shape {tuple(components.shape)} do not fit MXFP8Linear "
                             f"[{self.out_features}, {self.in_features}]")
        if components.fp8_dtype != self.weight.dtype:
            raise TypeError(f"components hold {components.fp8_dtype} values but this module's weight is "
                            f"{self.weight.dtype}")
        self.weight.copy_(components.data)
        self.weight_scale.copy_(components.scale_inv)

    def refresh(self) -> None:
        """Drop the cached decoded weight and swizzled scales (needed only after writes that bypass PyTorch's
        version counters, e.g. from another process through shared memory or ``inference_mode`` tensors)."""
        self._cache.clear()

    # -- forward
    # ------------------------------------------------------------------------------------------------
    def _key(self, tag: str, dtype: torch.dtype | None):
        kw, ks = _version_key(self.weight), _version_key(self.weight_scale)
        if kw is None or ks is None:
            return None
        return (tag, dtype, kw, ks)

    def _cached(self, tag: str, dtype: torch.dtype | None, build):
        key = self._key(tag, dtype)
        # one entry per dtype: fp32 SQNR decodes don't evict bf16 forwards
        hit = self._cache.get((tag, dtype))
        if key is not None and hit is not None and hit[0] == key:
            return hit[1]
        value = build()
        if key is not None:
            self._cache[(tag, dtype)] = (key, value)
        return value

    def decoded_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight decoded to ``dtype`` (``[N, K]``), ``mxport.dequantize(self.components(), dtype)``,
        cached."""
        return self._cached("dequant", dtype, lambda: self.components().dequantize(dtype))

    def _hardware_ok(self, x2: torch.Tensor) -> bool:
        if self.activation != "mxfp8" or self.use_mx_gemm is False or self._mx_gemm_failed is not None:
            if self.use_mx_gemm is True:
                raise RuntimeError(f"use_mx_gemm=True but the MX GEMM path is off "
                                   f"(activation={self.activation!r}, failure={self._mx_gemm_failed})")
            return False
        ok = (x2.is_cuda and self.weight.is_cuda and mx_gemm_available(x2.device)
              and self.fp8_dtype == torch.float8_e4m3fn and self.in_features % BLOCK_SIZE == 0
              and self.out_features % 16 == 0 and x2.shape[0] % 16 == 0
              and os.environ.get("MXPORT_DISABLE_MX_GEMM", "") in ("", "0"))
        if self.use_mx_gemm is True and not ok:
            raise RuntimeError("use_mx_gemm=True but torch._scaled_mm MX GEMM cannot run here (needs a CUDA "
                               "SM100+ GPU, E4M3 weights, K a multiple of 32, M and N multiples of 16)")
        return ok

    def _forward_mx_gemm(self, x2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``torch._scaled_mm`` MXFP8 GEMM: A = quantized activations [M, K] row-major, B = weight.T [K, N]
        column-major, scales swizzled (128x4 tiles) and bit-viewed as ``float8_e8m0fnu``. Untested here."""
        a = quantize(x2, self.fp8_dtype)
        a_scale = swizzle(a.scale_inv).flatten().view(_E8M0)
        b_scale = self._cached("swizzled", None, lambda: swizzle(self.weight_scale).flatten().view(_E8M0))
        # bf16 output, as torchao's MX linear asks for (mx_ops.py); cast to the compute dtype after
        return torch._scaled_mm(a.data, self.weight.t(), a_scale, b_scale,
                                out_dtype=torch.bfloat16).to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` float32/bfloat16/float16 -> ``[..., N]`` in the compute dtype (``x.dtype``
        unless ``compute_dtype`` is set). Raises ValueError when ``x.shape[-1] != in_features``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, MXFP8Linear expects {self.in_features}")
        dtype = self.compute_dtype or x.dtype
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"input must be float32/bfloat16/float16, got {x.dtype}")
        x = x.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        if self.activation == "mxfp8":
            lead = x.shape[:-1]
            x2 = x.reshape(-1, self.in_features)
            if x2.shape[0] > 0 and self._hardware_ok(x2):
                try:
                    y = self._forward_mx_gemm(x2, dtype).to(dtype)
                    y = y if bias is None else y + bias
                    return y.reshape(*lead, self.out_features)
                except Exception as exc:  # noqa: BLE001 - any kernel refusal falls back to emulation
                    self._mx_gemm_failed = f"{type(exc).__name__}: {exc}"[:300]
                    warnings.warn(f"mxport: MX GEMM failed, emulating W8A8 instead ({self._mx_gemm_failed})",
                                  stacklevel=2)
            if x2.shape[0] > 0:
                x = quantize(x2, self.fp8_dtype).dequantize(dtype).reshape(x.shape)
        return F.linear(x, self.decoded_weight(dtype), bias)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) casts every floating buffer, FP8 included: put the FP8 values back (exact).
        super()._apply(fn, recurse)
        if self.weight.dtype != self.fp8_dtype:
            self.weight = self.weight.to(self.fp8_dtype)
        self._cache.clear()
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8={element_format(self.fp8_dtype).name}, "
                f"activation={self.activation}")


def _check_linear_components(components) -> None:
    if not isinstance(components, MXFP8Components):
        raise TypeError(f"components must be an MXFP8Components, got {type(components).__name__}")
    if components.direction != "rowwise":
        raise ValueError(f"MXFP8Linear needs rowwise components (blocks along K), got {components.direction}")
    if components.data.dim() != 2:
        raise ValueError(f"MXFP8Linear needs 2-D [N, K] components, got shape {tuple(components.shape)}")


# -- fused 3-D experts ---------------------------------------------------------------------------------------
class MXFP8Experts(nn.Module):
    """Mixin of the quantized form of a fused-experts module (transformers' ``MixtralExperts``,
    ``Qwen3MoeExperts``, ``DeepseekV3Experts``, ...: 3-D parameters ``gate_up_proj`` ``[E, 2I, H]`` and
    ``down_proj`` ``[E, H, I]``, read as ``self.gate_up_proj[expert]`` by the family's own forward).

    :func:`quantize_experts` swaps the module's class, in place, for a generated subclass of (this mixin, the
    original class) named ``MXFP8<Original>``: each quantized weight ``X`` [E, N, K] leaves ``_parameters``
    and becomes two buffers, ``X`` (FP8 values, ``[E, N, K]``) and ``X_scale`` (uint8 E8M0,
    ``[E, N, ceil(K/32)]``, rowwise along K, per expert), the modelopt checkpoint names, so ``state_dict()``,
    refit plans and checkpoints name them alike. Reading ``module.X`` (a class property) returns the weight
    decoded (:meth:`MXFP8Components.dequantize`) to the original parameter's dtype, which ``module.to(dtype)``
    / ``.half()`` update; FP8 values are restored after such a cast (exact). The decoded weight is cached,
    keyed on the buffers' ``_version`` and ``data_ptr`` as in :class:`MXFP8Linear`, so in-place writes (a
    refit, :meth:`load_weight`) invalidate it; :meth:`refresh` drops it explicitly. The module's own forward
    runs unchanged. Deep copies and pickling (``torch.save(module)``) rebuild the generated class.
    """

    _mx_weights: tuple[str, ...] = ()
    _mx_base: type = nn.Module

    def mx_components(self, name: str) -> MXFP8Components:
        """Weight ``name`` as rowwise :class:`MXFP8Components` viewing the module's buffers."""
        if name not in self._mx_weights:
            raise KeyError(f"{type(self).__name__} has no MXFP8 weight {name!r} "
                           f"(has {list(self._mx_weights)})")
        return MXFP8Components(self._buffers[name], self._buffers[_expert_scale_name(name)], "rowwise")

    def decoded_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Weight ``name`` decoded to ``dtype`` (default: the compute dtype), cached (see the class doc)."""
        dtype = self._mx_dtypes[name] if dtype is None else dtype
        values, scales = self._buffers[name], self._buffers[_expert_scale_name(name)]
        kv, ks = _version_key(values), _version_key(scales)
        key = None if kv is None or ks is None else (kv, ks)
        hit = self._mx_cache.get((name, dtype))
        if key is not None and hit is not None and hit[0] == key:
            return hit[1]
        value = MXFP8Components(values, scales, "rowwise").dequantize(dtype)
        if key is not None:
            self._mx_cache[(name, dtype)] = (key, value)
        return value

    @torch.no_grad()
    def load_weight(self, name: str, components: MXFP8Components) -> None:
        """Copy ``components`` into weight ``name``'s buffers in place (pointers kept; the cache goes stale).

        Raises:
            TypeError: not MXFP8Components, or another FP8 element dtype.
            ValueError: not rowwise, or another shape.
        """
        own = self.mx_components(name)
        _check_expert_components(components, name)
        if tuple(components.shape) != tuple(own.shape):
            raise ValueError(f"{name}: components of shape {tuple(components.shape)} do not fit "
                             f"{tuple(own.shape)}")
        if components.fp8_dtype != own.fp8_dtype:
            raise TypeError(f"{name}: components hold {components.fp8_dtype} values, the module "
                            f"{own.fp8_dtype}")
        own.data.copy_(components.data)
        own.scale_inv.copy_(components.scale_inv)

    def refresh(self) -> None:
        """Drop the decoded weights (needed only after writes that bypass PyTorch's version counters)."""
        self._mx_cache.clear()

    def __reduce_ex__(self, protocol):
        # the generated class is not importable by name: pickle (torch.save of a module) rebuilds it
        return _new_experts, (self._mx_base, self._mx_weights), self.__dict__

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) casts FP8 buffers too: the cast's dtype becomes the compute dtype, the FP8
        # values are put back (FP8 -> any wider float -> FP8 is exact)
        fp8 = {n: self._buffers[n].dtype for n in self._mx_weights}
        super()._apply(fn, recurse)
        for n, dt in fp8.items():
            now = self._buffers[n]
            if now.dtype != dt:
                if now.dtype in _DECODE_DTYPES:
                    self._mx_dtypes[n] = now.dtype
                self._buffers[n] = now.to(dt)
        self._mx_cache.clear()
        return self


def _expert_scale_name(name: str) -> str:
    from .checkpoint.naming import scale_name

    return scale_name(name, "modelopt")


def _check_expert_components(components, name: str) -> None:
    if not isinstance(components, MXFP8Components):
        raise TypeError(f"{name}: components must be an MXFP8Components, got {type(components).__name__}")
    if components.direction != "rowwise":
        raise ValueError(f"{name}: expert weights need rowwise components (blocks along K), got "
                         f"{components.direction}")


def _decoded_property(name: str) -> property:
    return property(lambda self: self.decoded_weight(name),
                    doc=f"``{name}`` decoded from its MXFP8 buffers (cached; see MXFP8Experts).")


_EXPERT_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _experts_class(base: type, names: tuple[str, ...]) -> type:
    """The generated ``MXFP8<base>`` class whose ``names`` are MXFP8 weights (one class per (base, names))."""
    key = (base, names)
    if key not in _EXPERT_CLASSES:
        attrs = {n: _decoded_property(n) for n in names}
        attrs.update(_mx_weights=names, _mx_base=base, __module__=__name__, __doc__=MXFP8Experts.__doc__)
        _EXPERT_CLASSES[key] = type(f"MXFP8{base.__name__}", (MXFP8Experts, base), attrs)
    return _EXPERT_CLASSES[key]


def _new_experts(base: type, names: tuple[str, ...]) -> MXFP8Experts:
    cls = _experts_class(base, names)
    return cls.__new__(cls)


def expert_weight_names(module: nn.Module) -> list[str]:
    """The fused expert weights of ``module`` a quantization converts: its own 3-D floating parameters (not
    biases), plus its weights that already are MXFP8 (:class:`MXFP8Experts`)."""
    done = list(getattr(module, "_mx_weights", ()))
    return done + [n for n, p in module._parameters.items()
                   if p is not None and p.dim() == 3 and p.is_floating_point() and not n.endswith("bias")]


@torch.no_grad()
def quantize_experts(module: nn.Module, weights: dict[str, MXFP8Components]) -> MXFP8Experts:
    """Turn the fused 3-D parameters ``weights`` names of ``module`` into MXFP8 buffers, in place (the
    module's class becomes the generated ``MXFP8<Original>``, see :class:`MXFP8Experts`); names already MXFP8
    are loaded in place (:meth:`MXFP8Experts.load_weight`). Components are copied. Everything is checked
    before anything changes. Returns ``module``.

    Raises:
        KeyError: a name that is neither a parameter nor an MXFP8 weight of ``module``.
        ValueError / TypeError: components of another shape than the parameter, not rowwise, not MXFP8.
    """
    names = list(getattr(module, "_mx_weights", ()))
    for name, comps in weights.items():
        _check_expert_components(comps, name)
        param = module._parameters.get(name)
        if name not in names and param is None:
            raise KeyError(f"{type(module).__name__} has no parameter {name!r} to quantize")
        if name not in names and tuple(param.shape) != tuple(comps.shape):
            raise ValueError(f"{name}: components of shape {tuple(comps.shape)} do not fit the parameter "
                             f"{tuple(param.shape)}")
    dtypes = dict(getattr(module, "_mx_dtypes", {}))
    for name, comps in weights.items():
        if name in names:
            module.load_weight(name, comps)
            continue
        param = module._parameters.pop(name)
        dtypes[name] = param.dtype if param.dtype in _DECODE_DTYPES else torch.float32
        module._buffers[name] = comps.data.detach().clone().to(param.device)
        module._buffers[_expert_scale_name(name)] = comps.scale_inv.detach().clone().to(param.device)
        module._non_persistent_buffers_set.difference_update((name, _expert_scale_name(name)))
        names.append(name)
    module.__class__ = _experts_class(getattr(module, "_mx_base", type(module)), tuple(sorted(names)))
    module._mx_dtypes = dtypes
    module._mx_cache = {}
    return module


def mxfp8_experts(model: nn.Module) -> dict[str, MXFP8Experts]:
    """``{name: module}`` for every quantized fused-experts module (:class:`MXFP8Experts`), in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MXFP8Experts)}


# -- model conversion
# -----------------------------------------------------------------------------------------
def plain_float(w: torch.Tensor) -> bool:
    """Whether ``w`` (a tensor or parameter) is a plain float tensor that :func:`mxport.quantize` takes, not
    MXFP8 storage of a producer (TE, torchao, Megatron) nor a tensor subclass."""
    raw = w.data if isinstance(w, nn.Parameter) else w
    return type(raw) is torch.Tensor and raw.dtype in (*_FLOAT_DTYPES, torch.float64)


def weight_components(weight: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                      rounding: str = "rceil") -> MXFP8Components:
    """Rowwise MXFP8 components of a linear weight ``[N, K]``: quantized with :func:`mxport.quantize` when it
    is a plain float tensor, exported as is (:func:`mxport.export_components`, native reuse: no dequantize
    / requantize, the producer's element format kept) when it already is MXFP8 storage (TE, torchao,
    Megatron)."""
    if plain_float(weight):
        return quantize(weight.detach(), fp8_dtype, rounding=rounding)
    from .export import export_components

    raw = weight.data if isinstance(weight, nn.Parameter) else weight
    return export_components(raw, direction="rowwise")


def planned_experts(model: nn.Module, policy=None) -> dict[str, list[str]]:
    """``{module name: [local names]}`` of the fused 3-D expert parameters of ``model`` (``mlp.experts`` ->
    ``["gate_up_proj", "down_proj"]``) that ``policy`` (default policy when None) quantizes, in model order.
    The policy gives every expert weight of one MoE layer one precision (its rule 5)."""
    from .policy import PrecisionPolicy

    policy = PrecisionPolicy() if policy is None else policy
    out: dict[str, list[str]] = {}
    for d in policy.decide_model(model).values():
        mod_name, _, attr = d.name.rpartition(".")
        if d.quantize and len(d.shape) == 3 and attr in model.get_submodule(mod_name)._parameters:
            out.setdefault(mod_name, []).append(attr)
    return out


def planned_linears(model: nn.Module, policy=None) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` that ``policy`` (a
    :class:`mxport.policy.PrecisionPolicy`; default policy when None) quantizes, in model order."""
    from .policy import PrecisionPolicy

    policy = PrecisionPolicy() if policy is None else policy
    decisions = policy.decide_module_names(model)
    return [name for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name in decisions and decisions[name].quantize]


def planned_modules(model: nn.Module, policy=None) -> list[str]:
    """The modules :func:`quantize_model` converts under ``policy``: :func:`planned_linears` and the
    fused-experts modules of :func:`planned_experts`, in model order."""
    wanted = set(planned_linears(model, policy)) | set(planned_experts(model, policy))
    return [name for name, _ in model.named_modules() if name in wanted]


def _experts_to_convert(model: nn.Module, names: list[str], policy, explicit: bool) -> dict[str, list[str]]:
    """Per experts module among ``names``: the weights to quantize (all of its expert weights when the names
    are explicit, else the policy's)."""
    if not explicit:
        return planned_experts(model, policy)
    out = {}
    for name in names:
        mod = model.get_submodule(name)
        if not isinstance(mod, (nn.Linear, MXFP8Linear)):
            weights = [w for w in expert_weight_names(mod) if w in mod._parameters]
            if not weights and not isinstance(mod, MXFP8Experts):
                raise TypeError(f"module {name!r} is a {type(mod).__name__}, neither an nn.Linear nor a "
                                f"fused-experts module with 3-D weights")
            out[name] = weights
    return out


@torch.no_grad()
def quantize_model(model: nn.Module, policy=None, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                   activation: str = "none", rounding: str = "rceil", modules: Iterable[str] | None = None,
                   progress=None) -> nn.Module:
    """Quantize, in place, what ``policy`` quantizes: ``nn.Linear`` layers become :class:`MXFP8Linear`; fused
    3-D expert weights (``mlp.experts.gate_up_proj`` ``[E, N, K]``) become MXFP8 buffers of their experts
    module (:func:`quantize_experts`, the module turns into an :class:`MXFP8Experts`).

    Args:
        model: any ``nn.Module`` (e.g. a ``transformers`` causal LM).
        policy: a :class:`mxport.policy.PrecisionPolicy`; ``None`` = the default policy (linear and expert
            weights quantized; embeddings, lm_head, norms, routers kept).
        fp8_dtype: element format for weights that are quantized here (native MXFP8 weights keep theirs).
        activation: ``"none"`` or ``"mxfp8"`` for the new linear modules (see :class:`MXFP8Linear`); expert
            weights are weight-only.
        rounding: ``"rceil"`` or ``"floor"`` (see :func:`mxport.quantize`).
        modules: explicit module names to convert instead of asking the policy (an experts module is converted
            whole: every 3-D expert weight of it).
        progress: optional callable ``progress(name)`` called after each module.

    Weights are quantized with :func:`weight_components` (native export when the weight already is MXFP8
    storage): rowwise along K, per expert for 3-D weights, the bytes of :func:`mxport.quantize` of the tensor.
    Compute dtype of a new linear: the input's; of expert weights: the parameter's dtype. Tied weights: only
    modules the policy quantizes are converted, so a tied ``lm_head`` (kept by the policy) stays tied.

    Returns ``model``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'none' or 'mxfp8', got {activation!r}")
    element_format(fp8_dtype)
    names = list(modules) if modules is not None else planned_modules(model, policy)
    experts = _experts_to_convert(model, names, policy, modules is not None)
    for name in names:
        mod = model.get_submodule(name)
        if name in experts:
            if not experts[name]:
                continue
            quantize_experts(mod, {w: weight_components(mod._parameters[w], fp8_dtype, rounding)
                                   for w in experts[name]})
        elif isinstance(mod, MXFP8Linear):
            continue
        elif not isinstance(mod, nn.Linear):
            raise TypeError(f"module {name!r} is a {type(mod).__name__}, not an nn.Linear")
        else:
            comps = weight_components(mod.weight, fp8_dtype, rounding)
            model.set_submodule(name, MXFP8Linear.from_components(comps, mod.bias, activation=activation))
        if progress is not None:
            progress(name)
    return model


def mxfp8_modules(model: nn.Module) -> dict[str, MXFP8Linear]:
    """``{name: module}`` for every :class:`MXFP8Linear` in ``model``, in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MXFP8Linear)}


@torch.no_grad()
def load_checkpoint(model: nn.Module, path, *, strict: bool = True, activation: str | None = None) -> dict:
    """Fill ``model`` from an MXFP8 checkpoint written by ``mxport export`` (modelopt, compressed-tensors or
    sglang
    naming), read with :func:`mxport.checkpoint.open_checkpoint`, which pairs values and scales by name and
    refuses unsafe or inconsistent files (FP8 values without a scale, values of another element type than the
    quantization config declares, an index that omits shards or tensors, NaN scales, ...).

    For each ``<m>.weight`` held as 2-D MXFP8 components: an :class:`MXFP8Linear` ``<m>`` is filled in place
    (:meth:`MXFP8Linear.load_components`); a plain ``nn.Linear`` ``<m>`` is replaced by a new
    :class:`MXFP8Linear` (with ``activation`` or "none"). For each 3-D expert weight ``<m>.<w>``
    (``mlp.experts.gate_up_proj``): an :class:`MXFP8Experts` ``<m>`` is filled in place, a high-precision
    fused parameter becomes MXFP8 (:func:`quantize_experts`; reported under ``replaced``); both names
    ``<m>.<w>`` and ``<m>.<w>_scale`` count as filled. Per-expert checkpoint weights (``mxport export``
    writes them so, as ``save_pretrained`` does: ``block_sparse_moe.experts.{e}.w1/w3/w2``,
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``; :mod:`mxport.checkpoint.experts`) are gathered into
    the model's fused tensor and loaded as one under its name; Mixtral's ``block_sparse_moe`` is the model's
    ``mlp``. Plain tensors (embeddings, norms, biases, kept layers) are copied into the parameter or buffer
    of the same name (looked up when copied, so a bias after its replaced weight lands in the new module).

    Returns ``{"mxfp8": [...], "replaced": [...], "tensors": [...], "unexpected": [...], "missing": [...]}``
    (``mxfp8``: MXFP8 modules filled in place; ``replaced``: plain modules made MXFP8, so the MXFP8 weights
    loaded are ``mxfp8 + replaced``; ``missing``: ``state_dict`` entries of the model the checkpoint did not
    fill; tied aliases count as one).

    Raises:
        ValueError: a checkpoint that cannot be read or is inconsistent
            (:class:`mxport.checkpoint.CheckpointError`); a shape mismatch; with ``strict``, a checkpoint
            tensor with no counterpart in the model or a model tensor the checkpoint does not fill; a
            checkpoint that is not MXFP8 (``format`` None).
        TypeError: an FP8 element dtype different from the module's.
    """
    from .checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:  # closes the shard files, on errors too
        return _load_from_reader(model, reader, path, strict=strict, activation=activation)


def _tensor_at(model: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer ``name`` of ``model`` as it is now (None when there is none)."""
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        return None
    if attr in mod._parameters:
        return mod._parameters[attr]
    return mod._buffers.get(attr)


def _load_mx(model: nn.Module, name: str, value: MXFP8Components, activation: str | None,
             filled: set[str]) -> str:
    """Load one MXFP8 pair; returns the report key it belongs under."""
    if value.data.dim() == 3:
        return _load_mx_experts(model, name, value, filled)
    mod_name = name[: -len(".weight")] if name.endswith(".weight") else name
    try:
        mod = model.get_submodule(mod_name) if value.data.dim() == 2 else None
    except AttributeError:
        mod = None
    if isinstance(mod, (MXFP8Linear, nn.Linear)):
        if isinstance(mod, MXFP8Linear):
            mod.load_components(value)
            kind = "mxfp8"
        else:
            if tuple(mod.weight.shape) != tuple(value.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model "
                                 f"{tuple(mod.weight.shape)}")
            model.set_submodule(mod_name, MXFP8Linear.from_components(value, mod.bias,
                                                                      activation=activation or "none"))
            kind = "replaced"
        filled.update((f"{mod_name}.weight", f"{mod_name}.weight_scale"))
        return kind
    target = _tensor_at(model, name)
    if target is not None and tuple(target.shape) == tuple(value.shape):
        target.copy_(value.dequantize(target.dtype))
        filled.add(name)
        return "tensors"
    return "unexpected"


def _load_mx_experts(model: nn.Module, name: str, value: MXFP8Components, filled: set[str]) -> str:
    """A 3-D expert weight ``<m>.<attr>``: loaded in place into an :class:`MXFP8Experts` ``<m>`` that holds it
    as MXFP8, or the high-precision parameter ``<m>.<attr>`` becomes MXFP8 (:func:`quantize_experts`)."""
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        return "unexpected"
    if isinstance(mod, MXFP8Experts) and attr in mod._mx_weights:
        mod.load_weight(attr, value)
        kind = "mxfp8"
    elif isinstance(mod._parameters.get(attr), torch.Tensor) and mod._parameters[attr].dim() == 3:
        if tuple(mod._parameters[attr].shape) != tuple(value.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model "
                             f"{tuple(mod._parameters[attr].shape)}")
        quantize_experts(mod, {attr: value})
        kind = "replaced"
    else:
        return "unexpected"
    filled.update((name, f"{mod_name}.{_expert_scale_name(attr)}"))
    return kind


def _load_plain(model: nn.Module, name: str, value: torch.Tensor, filled: set[str]) -> str:
    target = _tensor_at(model, name)
    if target is None:
        return "unexpected"
    if tuple(target.shape) != tuple(value.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(target.shape)}")
    target.copy_(value.to(target.dtype))
    filled.add(name)
    return "tensors"


def _not_filled(model: nn.Module, filled: set[str]) -> list[str]:
    """``state_dict`` names of ``model`` not in ``filled``; names of one shared tensor (tied weights) count as
    filled when any of them is."""
    state = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for n, t in state.items():
        aliases.setdefault(id(t), []).append(n)
    done = {n for names in aliases.values() if any(a in filled for a in names) for n in names}
    return [n for n in state if n not in done]


class _ExpertFuser:
    """Per-expert checkpoint weights (``...experts.{e}.w1.weight``, ``...experts.{e}.gate_proj.weight``:
    :mod:`mxport.checkpoint.experts`) gathered into the fused 3-D tensor of the model's experts module
    (transformers 5 holds experts fused; Mixtral's ``block_sparse_moe`` is its ``mlp``), gate rows before up
    rows. A name the model holds as it is passes through."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.parts: dict[str, dict[tuple[int, int | None], object]] = {}

    def _fused(self, prefix: str, attr: str) -> tuple[str, tuple[int, ...]] | None:
        for mod_name in dict.fromkeys((prefix, prefix.replace(".block_sparse_moe.", ".mlp."))):
            try:
                mod = self.model.get_submodule(mod_name)
            except AttributeError:
                continue
            t = mod._parameters.get(attr)  # high precision, or MXFP8 (a buffer of an MXFP8Experts)
            t = mod._buffers.get(attr) if t is None and isinstance(mod, MXFP8Experts) else t
            if isinstance(t, torch.Tensor) and t.dim() == 3:
                return f"{mod_name}.{attr}", tuple(t.shape)
        return None

    def take(self, name: str, value) -> list[tuple[str, object]]:
        """``[(name, value)]`` to load now: the tensor itself, nothing (a piece kept until its fused tensor is
        complete), or the fused tensor once its last piece came."""
        from .checkpoint.experts import per_expert_part

        if _tensor_at(self.model, name) is not None:
            return [(name, value)]
        part = per_expert_part(name)
        found = self._fused(*part[:2]) if part else None
        if found is None:  # Mixtral's checkpoint module block_sparse_moe is transformers 5's mlp (its router)
            renamed = name.replace(".block_sparse_moe.", ".mlp.")
            return [(renamed if _tensor_at(self.model, renamed) is not None else name, value)]
        (fused, shape), (_, attr, e, half) = found, part
        if e >= shape[0]:
            raise ValueError(f"{name}: expert {e}, but the model's {fused} holds {shape[0]} experts")
        got = self.parts.setdefault(fused, {})
        got[(e, half)] = value
        halves = (0, 1) if attr == "gate_up_proj" else (None,)
        if len(got) < shape[0] * len(halves):
            return []
        del self.parts[fused]
        return [(fused, _stack_experts([got[(i, h)] for i in range(shape[0]) for h in halves], shape[0]))]

    def incomplete(self) -> list[str]:
        """The fused tensors some but not all of whose per-expert pieces were in the checkpoint."""
        return list(self.parts)


def _stack_experts(pieces: list, experts: int):
    """Per-expert pieces (2-D, in fused row order) -> one ``[E, N, K]`` tensor or MXFP8 components."""
    if all(isinstance(p, MXFP8Components) for p in pieces):
        fp8 = pieces[0].fp8_dtype
        data = torch.cat([p.data.view(torch.uint8) for p in pieces]).reshape(experts, -1, pieces[0].shape[-1])
        scales = torch.cat([p.scale_inv for p in pieces])
        return MXFP8Components(data.view(fp8), scales.reshape(experts, -1, scales.shape[-1]), "rowwise")
    if any(isinstance(p, MXFP8Components) for p in pieces):
        raise ValueError("the experts of one MoE layer mix MXFP8 and high-precision weights")
    return torch.cat(list(pieces)).reshape(experts, -1, pieces[0].shape[-1])


def _load_from_reader(model: nn.Module, reader, path, *, strict: bool, activation: str | None) -> dict:
    if reader.format is None:
        raise ValueError(f"{path} is not an MXFP8 checkpoint (no quantization_config of a known format)")
    report = {"mxfp8": [], "replaced": [], "tensors": [], "unexpected": [], "missing": []}
    filled: set[str] = set()
    experts = _ExpertFuser(model)
    try:
        for ckpt_name, ckpt_value in reader.iter_tensors():
            for name, value in experts.take(ckpt_name, ckpt_value):
                if isinstance(value, MXFP8Components):
                    report[_load_mx(model, name, value, activation, filled)].append(name)
                else:
                    report[_load_plain(model, name, value, filled)].append(name)
        report["unexpected"] += [f"{n} (some experts only)" for n in experts.incomplete()]
    except ValueError as exc:
        if type(exc) is not ValueError:  # CheckpointError: names its file already
            raise
        raise ValueError(f"checkpoint {path}: {exc}") from None
    report["missing"] = _not_filled(model, filled)
    if strict and (report["unexpected"] or report["missing"]):
        raise ValueError(f"checkpoint {path} does not match the model: unexpected "
                         f"{report['unexpected'][:5]}, model tensors not in the checkpoint "
                         f"{report['missing'][:5]}")
    return report
