"""Checkpoint formats: tensor names of the scales and the ``quantization_config`` each consumer reads.

Sources (summed up in docs/format.md, "What each consumer expects"): vLLM ``modelopt.py``
(``ModelOptMxFp8Config``: ``hf_quant_config.json`` ``quantization`` must hold ``quant_algo``,
``kv_cache_quant_algo`` and ``exclude_modules``; the flat ``config.json`` form reads ``quant_algo``,
``group_size``, ``ignore``, ``kv_cache_scheme``; exclude entries are fnmatch patterns over module prefixes),
vLLM compressed-tensors (``CompressedTensorsW8A8Mxfp8``: group strategy, group_size 32, float 8 bits;
``ignore`` lists module names), SGLang ``fp8.py`` ``Fp8Config`` (``quant_method`` containing ``mxfp8``,
``activation_scheme`` required, ``ignored_layers``, ``weight_block_size [1, 32]``).

| format | values | scales | E5M2 |
|---|---|---|---|
| ``modelopt`` | ``<m>.weight`` F8_E4M3 | ``<m>.weight_scale`` U8 | no (quant_algo MXFP8 means E4M3) |
| ``compressed-tensors`` | ``<m>.weight`` F8_E4M3 | ``<m>.weight_scale`` U8 | no (8-bit float args: E4M3) |
| ``sglang`` | ``<m>.weight`` F8_E4M3 | ``<m>.weight_scale_inv`` U8 | no (see below) |

SGLang 0.5.23 registers MXFP8 values as E4M3 whatever the config's ``fmt`` says, so E5M2 values in an sglang
checkpoint load there as garbage: export refuses it. mxport's own readers still read older E5M2 sglang
checkpoints whose config says ``fmt: "e5m2"`` (and ``mxport inspect`` flags them).

Fused 3-D expert tensors without a ``.weight`` suffix (``mlp.experts.gate_up_proj``) get the suffix appended:
``mlp.experts.gate_up_proj_scale`` (modelopt, compressed-tensors) / ``..._scale_inv`` (sglang).
"""

from __future__ import annotations

import torch

FORMATS = ("modelopt", "compressed-tensors", "sglang")
DEFAULT_FORMAT = "modelopt"

#: the scale-name suffix of each format (replaces ``.weight``'s ``weight`` with ``weight<suffix>``)
SCALE_SUFFIX = {"modelopt": "_scale", "compressed-tensors": "_scale", "sglang": "_scale_inv"}

#: FP8 element dtypes each format can declare
ALLOWED_FP8 = {
    "modelopt": (torch.float8_e4m3fn,),
    "compressed-tensors": (torch.float8_e4m3fn,),
    "sglang": (torch.float8_e4m3fn,),  # SGLang 0.5.23 registers MXFP8 values as E4M3 whatever ``fmt`` says
}

#: why each format cannot hold E5M2 values
_E4M3_ONLY_WHY = {
    "modelopt": "quant_algo MXFP8 means E4M3",
    "compressed-tensors": "8-bit float arguments mean E4M3",
    "sglang": "SGLang 0.5.23 registers MXFP8 values as E4M3 whatever the config's fmt says, so E5M2 values "
              "would load there as garbage",
}

#: why no format takes E5M2 values, in one line
E5M2_REFUSED = ("every format stores MXFP8 values as E4M3 only (vLLM's modelopt and compressed-tensors "
                "loaders read E4M3; SGLang 0.5.23 registers E4M3 whatever the config says)")

PRODUCER = "mxport"


def exportable_fp8(fp8_dtypes: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """The entries of ``fp8_dtypes`` (name -> dtype) that at least one format can declare."""
    return {name: dt for name, dt in fp8_dtypes.items()
            if any(dt in allowed for allowed in ALLOWED_FP8.values())}


def check_format(fmt: str) -> str:
    """Raise ValueError unless ``fmt`` is one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")
    return fmt


def check_fp8_dtype(fmt: str, fp8_dtype: torch.dtype) -> torch.dtype:
    """Raise ValueError when ``fmt`` cannot declare ``fp8_dtype`` (see :data:`ALLOWED_FP8`)."""
    check_format(fmt)
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    if fp8_dtype not in ALLOWED_FP8[fmt]:
        raise ValueError(f"format {fmt!r} stores MXFP8 values as E4M3 only ({_E4M3_ONLY_WHY[fmt]}); "
                         "export E4M3 (--fp8-dtype e4m3)")
    return fp8_dtype


def scale_name(weight_name: str, fmt: str) -> str:
    """The scale tensor's name for the values tensor ``weight_name`` in format ``fmt``.

    ``model.layers.0.mlp.down_proj.weight`` -> ``...down_proj.weight_scale`` (modelopt, compressed-tensors) or
    ``...down_proj.weight_scale_inv`` (sglang). A name without ``.weight`` gets the suffix appended.
    """
    check_format(fmt)
    if not isinstance(weight_name, str) or not weight_name:
        raise TypeError(f"weight_name must be a non-empty str, got {weight_name!r}")
    return weight_name + SCALE_SUFFIX[fmt]


def quant_names(weight_name: str, fmt: str, quant: str = "mxfp8") -> tuple[str, str, str | None]:
    """The names ``(values, scale, global scale or None)`` of a weight quantized as ``quant`` in checkpoint
    format ``fmt`` (docs/format.md, "4-bit checkpoints"): MXFP8 as :func:`scale_name` says; 4-bit ModelOpt
    ``weight`` / ``weight_scale`` / ``weight_scale_2`` (NVFP4); compressed-tensors ``weight_packed`` /
    ``weight_scale`` / ``weight_global_scale`` (NVFP4). ValueError for a format that has no 4-bit form."""
    if quant == "mxfp8":
        return weight_name, scale_name(weight_name, fmt), None
    check_quant_format(fmt, quant)
    nv = quant == "nvfp4"
    if fmt == "modelopt":
        return weight_name, weight_name + "_scale", weight_name + "_scale_2" if nv else None
    return weight_name + "_packed", weight_name + "_scale", weight_name + "_global_scale" if nv else None


#: the checkpoint formats that hold each 4-bit format, and why the others do not
_FP4_FORMATS = {"modelopt": ("nvfp4", "mxfp4"), "compressed-tensors": ("nvfp4", "mxfp4"), "sglang": ()}


def check_quant_format(fmt: str, quant: str) -> None:
    """ValueError when checkpoint format ``fmt`` cannot hold weights quantized as ``quant``."""
    check_format(fmt)
    if quant != "mxfp8" and quant not in _FP4_FORMATS[fmt]:
        raise ValueError(f"format {fmt!r} holds MXFP8 only (SGLang's mxfp8 quant_method); write {quant} as "
                         "--format modelopt or compressed-tensors")


def input_scale_name(weight_name: str) -> str:
    """ModelOpt's activation scale of the module of ``weight_name``: ``<m>.weight`` -> ``<m>.input_scale``."""
    return weight_name.removesuffix("weight") + "input_scale"


#: activation formats a checkpoint can declare: weight-only ("none") or NVFP4 inputs (W4A4, calibrated)
ACTIVATIONS = ("none", "nvfp4")


def check_activation(activation: str, quant: str, fmt: str) -> None:
    """ValueError unless ``activation`` is "none", or "nvfp4" with NVFP4 weights in a ModelOpt checkpoint
    (the W4A4 form vLLM's ModelOpt loader reads, ``quant_algo: NVFP4``)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if activation == "nvfp4" and (quant != "nvfp4" or fmt != "modelopt"):
        raise ValueError(f"activation 'nvfp4' (W4A4, calibrated input scales) needs --quant nvfp4 --format "
                         f"modelopt, got --quant {quant} --format {fmt}")


def values_name(scale_tensor_name: str, fmt: str) -> str | None:
    """Inverse of :func:`scale_name`: the values tensor's name, or None if ``scale_tensor_name`` is not a
    scale name of ``fmt``."""
    suffix = SCALE_SUFFIX[check_format(fmt)]
    if scale_tensor_name.endswith(suffix) and len(scale_tensor_name) > len(suffix):
        return scale_tensor_name[: -len(suffix)]
    return None


def declared_fp8(fmt: str | None, quant_config: dict | None) -> torch.dtype | None:
    """The FP8 element type the quantization config of format ``fmt`` declares: E4M3 for modelopt and
    compressed-tensors, the ``fmt`` entry ("e4m3" by default, or "e5m2") for sglang; None without a config.

    Raises ValueError for an sglang ``fmt`` that is neither."""
    if fmt not in FORMATS or not isinstance(quant_config, dict):
        return None
    if fmt != "sglang":
        return torch.float8_e4m3fn
    element = quant_config.get("fmt", "e4m3")
    if element not in ("e4m3", "e5m2"):
        raise ValueError(f"quantization_config fmt must be 'e4m3' or 'e5m2', got {element!r}")
    return torch.float8_e5m2 if element == "e5m2" else torch.float8_e4m3fn


def _element(fp8_dtype: torch.dtype) -> str:
    return "e5m2" if fp8_dtype == torch.float8_e5m2 else "e4m3"


def quantization_config(fmt: str, exclude_modules, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                        quant: str = "mxfp8", activation: str = "none") -> dict:
    """The ``quantization_config`` dict for ``config.json`` in format ``fmt`` (see docs/format.md,
    "What each consumer expects").

    Args:
        fmt: one of :data:`FORMATS`.
        exclude_modules: module names left unquantized (see :func:`mxport.policy.exclude_modules`); written as
            ``ignore`` (modelopt, compressed-tensors) / ``ignored_layers`` (sglang).
        fp8_dtype: torch.float8_e4m3fn (every format: see :data:`ALLOWED_FP8`).
        quant: the weights' format, "mxfp8", "mxfp4" or "nvfp4" (:func:`fp4_quantization_config`).
        activation: "none", or "nvfp4" for W4A4 NVFP4 (:func:`check_activation`).

    Raises:
        ValueError: unknown format, or an FP8 dtype the format cannot declare.
    """
    check_fp8_dtype(fmt, fp8_dtype)
    excl = [str(m) for m in exclude_modules]
    if quant != "mxfp8":
        return fp4_quantization_config(fmt, excl, quant, activation)
    if fmt == "modelopt":
        # vLLM ModelOptQuantConfigBase.from_config, flat config.json form: quant_algo, group_size, ignore
        # (fnmatch patterns over module prefixes), kv_cache_scheme (a dict; None = KV cache not quantized)
        return {"quant_method": "modelopt", "quant_algo": "MXFP8", "producer": {"name": PRODUCER},
                "group_size": 32, "kv_cache_scheme": None, "ignore": excl}
    if fmt == "compressed-tensors":
        args = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": False, "scale_dtype": "uint8", "observer": None}
        acts = dict(args, dynamic=True)
        return {"quant_method": "compressed-tensors", "format": "mxfp8-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                              "input_activations": acts, "output_activations": None,
                                              "format": "mxfp8-quantized"}},
                "ignore": excl, "kv_cache_scheme": None}
    return {"quant_method": "mxfp8", "activation_scheme": "dynamic", "fmt": _element(fp8_dtype),
            "weight_block_size": [1, 32], "scale_fmt": "ue8m0", "ignored_layers": excl}


def hf_quant_config(exclude_modules, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                    quant: str = "mxfp8", activation: str = "none") -> dict:
    """ModelOpt's ``hf_quant_config.json`` (vLLM requires ``group_size``, ``kv_cache_quant_algo`` and
    ``exclude_modules``)."""
    check_fp8_dtype("modelopt", fp8_dtype)
    check_activation(activation, quant, "modelopt")
    algo, group = MODELOPT_ALGO[quant] if activation == "none" else ("NVFP4", 16)
    sizes = {"group_size": group} if group else {}  # ModelOpt 0.47 writes none for MXFP4
    return {"producer": {"name": PRODUCER},
            "quantization": {"quant_algo": algo, **sizes, "kv_cache_quant_algo": None,
                             "exclude_modules": [str(m) for m in exclude_modules]}}


#: ModelOpt's ``quant_algo`` and ``group_size`` per weight format, as ModelOpt 0.47's export writes them (run
#: here: ``mtq.W4A16_NVFP4_CFG`` / ``MXFP4_DEFAULT_CFG`` then ``export_hf_checkpoint``). The 4-bit exports are
#: weight-only (no activation calibration): ``W4A16_NVFP4``; ``mxfp4`` lower-case and without a group size.
MODELOPT_ALGO = {"mxfp8": ("MXFP8", 32), "nvfp4": ("W4A16_NVFP4", 16), "mxfp4": ("mxfp4", None)}

#: compressed-tensors' weight arguments and checkpoint format per 4-bit weight format (weight-only: no
#: ``input_activations``, llmcompressor's ``NVFP4A16`` / ``MXFP4A16`` schemes)
CT_FP4 = {
    "nvfp4": ({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
               "group_size": 16, "dynamic": False, "scale_dtype": "float8_e4m3fn"}, "nvfp4-pack-quantized"),
    "mxfp4": ({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
               "dynamic": False, "scale_dtype": "uint8"}, "mxfp4-pack-quantized"),
}


def fp4_quantization_config(fmt: str, excl: list[str], quant: str, activation: str = "none") -> dict:
    """``quantization_config`` of a 4-bit export: ModelOpt's flat form (``quant_algo`` :data:`MODELOPT_ALGO`,
    or ``NVFP4`` with NVFP4 ``input_activations`` for W4A4) or compressed-tensors' (:data:`CT_FP4`,
    weight-only)."""
    check_quant_format(fmt, quant)
    check_activation(activation, quant, fmt)
    if fmt == "modelopt":
        algo, group = MODELOPT_ALGO[quant] if activation == "none" else ("NVFP4", 16)
        if not group:
            return {"quant_method": "modelopt", "quant_algo": algo, "producer": {"name": PRODUCER},
                    "ignore": excl}
        weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group}
        inputs = {"input_activations": dict(weights)} if activation == "nvfp4" else {}
        return {"quant_method": "modelopt", "quant_algo": algo, "producer": {"name": PRODUCER},
                "config_groups": {"group_0": {**inputs, "weights": weights, "targets": ["Linear"]}},
                "group_size": group, "kv_cache_scheme": None, "ignore": excl}
    args, ct_format = CT_FP4[quant]
    return {"quant_method": "compressed-tensors", "format": ct_format, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(args, observer=None),
                                          "input_activations": None, "output_activations": None,
                                          "format": ct_format}},
            "ignore": excl, "kv_cache_scheme": None}


def detect_fp4(quant_config: dict | None) -> tuple[str, str] | None:
    """``(format, quant)`` when a quantization config describes 4-bit weights: ModelOpt ``quant_algo``
    NVFP4 / W4A16_NVFP4 / MXFP4 (flat or under ``quantization``), compressed-tensors ``nvfp4-pack-quantized``
    / ``mxfp4-pack-quantized``; None otherwise."""
    if not isinstance(quant_config, dict):
        return None
    q = quant_config.get("quantization")
    algo = str(quant_config.get("quant_algo") or (q.get("quant_algo") if isinstance(q, dict) else "") or "")
    algo = algo.upper()
    if str(quant_config.get("quant_method", "")).lower() == "modelopt" or isinstance(q, dict):
        if "NVFP4" in algo:
            return "modelopt", "nvfp4"
        return ("modelopt", "mxfp4") if algo == "MXFP4" else None
    if str(quant_config.get("quant_method", "")).lower() == "compressed-tensors":
        groups = quant_config.get("config_groups")
        fmts = [str(quant_config.get("format", ""))] + [
            str(g.get("format", "")) for g in (groups.values() if isinstance(groups, dict) else ())
            if isinstance(g, dict)]
        for quant in ("nvfp4", "mxfp4"):
            if any(f == f"{quant}-pack-quantized" for f in fmts):
                return "compressed-tensors", quant
    return None


def detect_format(quant_config: dict | None) -> str | None:
    """The format a ``config.json`` ``quantization_config`` (or ``hf_quant_config.json``) describes, or None
    when it is absent or not MXFP8. ValueError when ``quantization`` or ``config_groups`` is not an object."""
    if not isinstance(quant_config, dict):
        return None
    method = str(quant_config.get("quant_method", "")).lower()
    q = quant_config.get("quantization")
    if q is not None and not isinstance(q, dict):
        raise ValueError(f"'quantization' must be an object, got {type(q).__name__}")
    algo = str(quant_config.get("quant_algo") or (q.get("quant_algo") if isinstance(q, dict) else "") or "")
    if method == "modelopt" or (isinstance(q, dict) and "quant_algo" in q):
        return "modelopt" if "MXFP8" in algo.upper() else None
    if method == "compressed-tensors":
        fmt = str(quant_config.get("format", ""))
        groups = quant_config.get("config_groups") or {}
        if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
            raise ValueError(f"'config_groups' must be an object of objects, got {type(groups).__name__}")
        fmts = [fmt] + [str(g.get("format", "")) for g in groups.values()]
        return "compressed-tensors" if any("mxfp8" in f for f in fmts) else None
    if "mxfp8" in method:
        return "sglang"
    return None
