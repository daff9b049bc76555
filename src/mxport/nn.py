"""Inference-side MXFP8: :class:`MXFP8Linear`, model conversion (:func:`quantize_model`) and checkpoint loading
(:func:`load_checkpoint`).

``MXFP8Linear`` keeps its weight as MXFP8 components in two buffers, ``weight`` (FP8 values ``[N, K]``) and
``weight_scale`` (uint8 E8M0 bytes ``[N, ceil(K/32)]``, compact rowwise), so its ``state_dict()`` names are the
ModelOpt checkpoint names (design.md §4). Forward paths:

- weight-only (``activation="none"``): the weight is decoded (``float(q) * 2**(E-127)`` in float32, cast to the
  compute dtype) and multiplied with ``F.linear``. The decoded weight is cached; the cache key holds the buffers'
  ``_version`` counters and ``data_ptr``, so any in-place write (``copy_`` during a refit, ``load_components``)
  or a move invalidates it without a call; :meth:`MXFP8Linear.refresh` drops it explicitly.
- W8A8 emulation (``activation="mxfp8"``): the input is quantized rowwise along K (blocks of 32, ``rceil``, the
  weight's FP8 element format) with :func:`mxport.quantize`, decoded, then multiplied as above — what an MXFP8
  GEMM computes, up to accumulation order.
- hardware (``activation="mxfp8"`` on a CUDA GPU with MX GEMM, SM100+, see :func:`mxport._env.mx_gemm_available`):
  ``torch._scaled_mm`` with both operands FP8 and swizzled ``float8_e8m0fnu`` scales (:func:`mxport.layouts.swizzle`,
  the cuBLAS ``VEC32_UE8M0`` layout), as torchao's MX linear calls it (``mx_formats/mx_ops.py``). Chosen
  automatically for E4M3 weights when K is a multiple of 32 and N, M are multiples of 16; any failure falls back
  to emulation for good (with a warning). ``MXPORT_DISABLE_MX_GEMM=1`` or ``module.use_mx_gemm = False`` forces
  emulation. **Untested here**: the development machines have no SM100 GPU.
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


def _version_key(t: torch.Tensor):
    """(version, data_ptr, device) of a tensor, or None when it has no version counter (inference tensors)."""
    try:
        return (t._version, t.data_ptr(), t.device)
    except RuntimeError:
        return None


class MXFP8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as MXFP8 (FP8 values + one E8M0 shared scale per block of 32 along K).

    Args:
        in_features: K.
        out_features: N.
        bias: add a ``bias`` parameter ``[N]`` (dtype ``compute_dtype`` or float32).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, the element format of ``weight``.
        activation: ``"none"`` (weight-only: activations stay in the compute dtype) or ``"mxfp8"`` (activations
            quantized rowwise along K on the fly, W8A8; the hardware path where available).
        device: where the buffers live.
        compute_dtype: dtype of the matmul; ``None`` = the input's dtype.

    Buffers: ``weight`` (``fp8_dtype``, ``[N, K]``), ``weight_scale`` (uint8 E8M0, ``[N, ceil(K/32)]``). A fresh
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
            raise ValueError(f"in_features and out_features must be positive, got ({in_features}, {out_features})")
        fmt = element_format(fp8_dtype)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be 'none' or 'mxfp8', got {activation!r}")
        if compute_dtype is not None and compute_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"compute_dtype must be None, float32, bfloat16 or float16, got {compute_dtype!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.fp8_dtype = fmt.dtype
        self.activation = activation
        self.compute_dtype = compute_dtype
        #: None = choose the hardware path automatically; False = never; True = require it (error if unavailable)
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

    # -- construction and in-place updates --------------------------------------------------------------------
    @classmethod
    def from_components(cls, components: MXFP8Components, bias: torch.Tensor | None = None, *,
                        activation: str = "none", compute_dtype: torch.dtype | None = None) -> MXFP8Linear:
        """A module holding (copies of) rowwise 2-D ``components`` ``[N, K]`` and an optional ``bias`` ``[N]``.

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
            mod.bias = nn.Parameter(bias.detach().clone().to(compute_dtype or bias.dtype), requires_grad=False)
        return mod

    def components(self) -> MXFP8Components:
        """The weight as rowwise :class:`MXFP8Components` whose ``data`` / ``scale_inv`` are the buffers themselves
        (views: writing them writes the module)."""
        return MXFP8Components(self.weight, self.weight_scale, "rowwise")

    @torch.no_grad()
    def load_components(self, components: MXFP8Components) -> None:
        """Copy ``components`` into the buffers in place (``copy_``: the buffers keep their storage and
        ``data_ptr``, so CUDA graphs and refit receivers holding them stay valid); the decoded cache goes stale
        through the buffers' version counters.

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

    # -- forward ------------------------------------------------------------------------------------------------
    def _key(self, tag: str, dtype: torch.dtype | None):
        kw, ks = _version_key(self.weight), _version_key(self.weight_scale)
        if kw is None or ks is None:
            return None
        return (tag, dtype, kw, ks)

    def _cached(self, tag: str, dtype: torch.dtype | None, build):
        key = self._key(tag, dtype)
        hit = self._cache.get((tag, dtype))  # one entry per dtype: fp32 SQNR decodes don't evict bf16 forwards
        if key is not None and hit is not None and hit[0] == key:
            return hit[1]
        value = build()
        if key is not None:
            self._cache[(tag, dtype)] = (key, value)
        return value

    def decoded_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight decoded to ``dtype`` (``[N, K]``), ``mxport.dequantize(self.components(), dtype)``, cached."""
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
            raise RuntimeError("use_mx_gemm=True but torch._scaled_mm MX GEMM cannot run here (needs a CUDA SM100+ "
                               "GPU, E4M3 weights, K a multiple of 32, M and N multiples of 16)")
        return ok

    def _forward_mx_gemm(self, x2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``torch._scaled_mm`` MXFP8 GEMM: A = quantized activations [M, K] row-major, B = weight.T [K, N]
        column-major, scales swizzled (128x4 tiles) and bit-viewed as ``float8_e8m0fnu``. Untested here."""
        a = quantize(x2, self.fp8_dtype)
        a_scale = swizzle(a.scale_inv).flatten().view(_E8M0)
        b_scale = self._cached("swizzled", None, lambda: swizzle(self.weight_scale).flatten().view(_E8M0))
        # bf16 output, as torchao's MX linear asks for (mx_ops.py); cast to the compute dtype after
        return torch._scaled_mm(a.data, self.weight.t(), a_scale, b_scale, out_dtype=torch.bfloat16).to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` float32/bfloat16/float16 -> ``[..., N]`` in the compute dtype (``x.dtype`` unless
        ``compute_dtype`` is set). Raises ValueError when ``x.shape[-1] != in_features``."""
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8={element_format(self.fp8_dtype).name}, activation={self.activation}")


def _check_linear_components(components) -> None:
    if not isinstance(components, MXFP8Components):
        raise TypeError(f"components must be an MXFP8Components, got {type(components).__name__}")
    if components.direction != "rowwise":
        raise ValueError(f"MXFP8Linear needs rowwise components (blocks along K), got {components.direction}")
    if components.data.dim() != 2:
        raise ValueError(f"MXFP8Linear needs 2-D [N, K] components, got shape {tuple(components.shape)}")


# -- model conversion -----------------------------------------------------------------------------------------
def _plain_float(w: torch.Tensor) -> bool:
    raw = w.data if isinstance(w, nn.Parameter) else w
    return type(raw) is torch.Tensor and raw.dtype in (*_FLOAT_DTYPES, torch.float64)


def weight_components(weight: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                      rounding: str = "rceil") -> MXFP8Components:
    """Rowwise MXFP8 components of a linear weight ``[N, K]``: quantized with :func:`mxport.quantize` when it is a
    plain float tensor, exported as is (:func:`mxport.export_components`, native reuse: no dequantize /
    requantize, the producer's element format kept) when it already is MXFP8 storage (TE, torchao, Megatron)."""
    if _plain_float(weight):
        return quantize(weight.detach(), fp8_dtype, rounding=rounding)
    from .export import export_components

    raw = weight.data if isinstance(weight, nn.Parameter) else weight
    return export_components(raw, direction="rowwise")


def planned_linears(model: nn.Module, policy=None) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` that ``policy`` (a :class:`mxport.policy.PrecisionPolicy`;
    default policy when None) quantizes, in model order."""
    from .policy import PrecisionPolicy

    policy = PrecisionPolicy() if policy is None else policy
    decisions = policy.decide_module_names(model)
    return [name for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name in decisions and decisions[name].quantize]


@torch.no_grad()
def quantize_model(model: nn.Module, policy=None, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                   activation: str = "none", rounding: str = "rceil", modules: Iterable[str] | None = None,
                   progress=None) -> nn.Module:
    """Replace, in place, the ``nn.Linear`` layers that ``policy`` quantizes with :class:`MXFP8Linear`.

    Args:
        model: any ``nn.Module`` (e.g. a ``transformers`` causal LM).
        policy: a :class:`mxport.policy.PrecisionPolicy`; ``None`` = the default policy (linear weights quantized;
            embeddings, lm_head, norms, routers kept).
        fp8_dtype: element format for weights that are quantized here (native MXFP8 weights keep theirs).
        activation: ``"none"`` or ``"mxfp8"`` for the new modules (see :class:`MXFP8Linear`).
        rounding: ``"rceil"`` or ``"floor"`` (see :func:`mxport.quantize`).
        modules: explicit module names to convert instead of asking the policy.
        progress: optional callable ``progress(name)`` called after each module.

    Weights are quantized with :func:`weight_components` (native export when the weight already is MXFP8
    storage). Compute dtype of each new module: the input's. Fused 3-D expert parameters (``[E, N, K]``, not
    ``nn.Linear``) are left in high precision. Tied weights: only ``nn.Linear`` modules the policy quantizes are
    replaced, so a tied ``lm_head`` (kept by the policy) stays tied.

    Returns ``model``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'none' or 'mxfp8', got {activation!r}")
    element_format(fp8_dtype)
    names = list(modules) if modules is not None else planned_linears(model, policy)
    for name in names:
        mod = model.get_submodule(name)
        if isinstance(mod, MXFP8Linear):
            continue
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"module {name!r} is a {type(mod).__name__}, not an nn.Linear")
        comps = weight_components(mod.weight, fp8_dtype, rounding)
        new = MXFP8Linear.from_components(comps, mod.bias, activation=activation)
        model.set_submodule(name, new)
        if progress is not None:
            progress(name)
    return model


def mxfp8_modules(model: nn.Module) -> dict[str, MXFP8Linear]:
    """``{name: module}`` for every :class:`MXFP8Linear` in ``model``, in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MXFP8Linear)}


@torch.no_grad()
def load_checkpoint(model: nn.Module, path, *, strict: bool = True, activation: str | None = None) -> dict:
    """Fill ``model`` from an MXFP8 checkpoint written by ``mxport export`` (modelopt, compressed-tensors or sglang
    naming), read with :func:`mxport.checkpoint.open_checkpoint`, which pairs values and scales by name and
    refuses unsafe or inconsistent files (FP8 values without a scale, values of another element type than the
    quantization config declares, an index that omits shards or tensors, NaN scales, ...).

    For each ``<m>.weight`` held as 2-D MXFP8 components: an :class:`MXFP8Linear` ``<m>`` is filled in place
    (:meth:`MXFP8Linear.load_components`); a plain ``nn.Linear`` ``<m>`` is replaced by a new
    :class:`MXFP8Linear` (with ``activation`` or "none"). 3-D expert components are decoded into the model's
    high-precision fused parameter. Plain tensors (embeddings, norms, biases, kept layers) are copied into the
    parameter or buffer of the same name (looked up when copied, so a bias after its replaced weight lands in the
    new module).

    Returns ``{"mxfp8": [...], "replaced": [...], "tensors": [...], "unexpected": [...], "missing": [...]}``
    (``missing``: ``state_dict`` entries of the model the checkpoint did not fill; tied aliases count as one).

    Raises:
        ValueError: a checkpoint that cannot be read or is inconsistent (:class:`mxport.checkpoint.CheckpointError`);
            a shape mismatch; with ``strict``, a checkpoint tensor with no counterpart in the model or a model
            tensor the checkpoint does not fill; a checkpoint that is not MXFP8 (``format`` None).
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
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(mod.weight.shape)}")
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


def _load_from_reader(model: nn.Module, reader, path, *, strict: bool, activation: str | None) -> dict:
    if reader.format is None:
        raise ValueError(f"{path} is not an MXFP8 checkpoint (no quantization_config of a known format)")
    report = {"mxfp8": [], "replaced": [], "tensors": [], "unexpected": [], "missing": []}
    filled: set[str] = set()
    try:
        for name, value in reader.iter_tensors():
            if isinstance(value, MXFP8Components):
                report[_load_mx(model, name, value, activation, filled)].append(name)
            else:
                report[_load_plain(model, name, value, filled)].append(name)
    except ValueError as exc:
        if type(exc) is not ValueError:  # CheckpointError: names its file already
            raise
        raise ValueError(f"checkpoint {path}: {exc}") from None
    report["missing"] = _not_filled(model, filled)
    if strict and (report["unexpected"] or report["missing"]):
        raise ValueError(f"checkpoint {path} does not match the model: unexpected {report['unexpected'][:5]}, "
                         f"model tensors not in the checkpoint {report['missing'][:5]}")
    return report
