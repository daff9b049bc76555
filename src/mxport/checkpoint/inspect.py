"""Inspect an MXFP8 checkpoint, or a 4-bit one (:mod:`~mxport.checkpoint.fp4_pairs`), ours or another
producer's: roles, pairs, scale exponents, value statistics,
totals, and the problems an engine would trip on.

Roles: ``values`` (an FP8 tensor), ``scales`` (``<values>_scale`` / ``<values>_scale_inv``, or any
``*.weight_scale`` / ``*.weight_scale_inv``), ``kept`` (everything else). The format comes from
``config.json`` ``quantization_config`` or ``hf_quant_config.json``, else from the scale names (see
:func:`~mxport.checkpoint.readers.format_by_names`).

Problems (each makes ``mxport inspect`` exit 1): values without a scale; a scale without values, or for values
that are not FP8; a scale that is not ``uint8`` E8M0 bytes (e.g. stored as float: ``F32`` / ``BF16``); a scale
shape that is not compact ``(*shape[:-1], ceil(K/32))`` (e.g. TE's padded ``[128, 4]`` for a ``[3, 64]``
weight); a scale name that does not follow the detected format; E5M2 values in a format that declares E4M3;
NaN scale bytes (255); a config that declares MXFP8 with no MXFP8 tensor in the files; no MXFP8 values/scale
pair at all (nothing to serve as MXFP8); E5M2 values in an sglang checkpoint (SGLang 0.5.23 registers MXFP8
values as E4M3 whatever the config says: they load there as garbage). A ``float8_e8m0fnu`` (``F8_E8M0``) scale
is the same bytes: a warning, not a problem. MXFP8 values whose K (last dimension) is not a multiple of 32:
one problem per consumer that refuses them (vLLM, SGLang, TE; :data:`K_RULES`), also in the report's
``consumers``. Files that cannot be read safely (see
:class:`~mxport.checkpoint.readers.SafetensorsDir`) raise :class:`~mxport.checkpoint.readers.CheckpointError`
(a ValueError) instead.
The result is an :class:`InspectReport` (typed); :func:`inspect_checkpoint` returns its ``to_dict()``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..components import MXFP8Components
from ..formats import BLOCK_SIZE, e8m0_to_float
from .fp4_pairs import fp4_by_names, fp4_data_problems, fp4_weights, read_fp4
from .naming import detect_fp4, input_scale_name
from .readers import SafetensorsDir, analyse_pairs, data_problems, describe_quantization, dtype_str

#: what each consumer does with an MXFP8 weight whose K is not a multiple of 32 (docs/format.md, "Who
#: refuses a K that is not a multiple of 32")
K_RULES = {
    "vllm": ("vLLM", "cannot serve them (modelopt refuses to load: 'MXFP8 requires input size divisible by "
                     "32'; compressed-tensors loads them into K // 32 scale columns, then fails on the first "
                     "forward)"),
    "sglang": ("SGLang", "its MXFP8 kernels read K // 32 scale columns, and a row-parallel layer refuses a K "
                         "per rank that is not a multiple of 32"),
    "te": ("TE", "MXFP8 tensors need K % 32 == 0 (MXFP8Quantizer.is_quantizable / get_scale_shape)"),
}


def consumer_problems(pairs) -> dict[str, list[str]]:
    """Per consumer of :data:`K_RULES`: one problem line naming the MXFP8 pairs (``{"values", "shape"}``)
    whose K is not a multiple of 32, or an empty list."""
    bad = [f"{p['values']} (K={p['shape'][-1]})" for p in pairs if p["shape"] and p["shape"][-1] % BLOCK_SIZE]
    if not bad:
        return {key: [] for key in K_RULES}
    names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    what = f"{len(bad)} MXFP8 tensor{'s' if len(bad) > 1 else ''} with K not a multiple of 32 ({names})"
    return {key: [f"{who}: {what}: {rule}"] for key, (who, rule) in K_RULES.items()}


def scale_stats(scale: torch.Tensor) -> dict:
    """Statistics of E8M0 scale bytes alone (cheap: 1/32 of the values): exponent range E - 127 (NaN bytes
    skipped), the count of NaN bytes (E = 255) and of zero bytes (E = 0, i.e. 2**-127)."""
    e = scale.to(torch.int32)
    finite = e[e != 255]
    return {"scale_exp_min": int(finite.min()) - 127 if finite.numel() else None,
            "scale_exp_max": int(finite.max()) - 127 if finite.numel() else None,
            "nan_scales": int((e == 255).sum()), "zero_scales": int((e == 0).sum())}


def pair_stats(c: MXFP8Components) -> dict:
    """Statistics of one rowwise MXFP8 pair: :func:`scale_stats`, decoded absmax and mean |x| (FP32, NaN
    values skipped), the fraction of blocks whose 32 (or fewer, at a row's end) values are all zero."""
    out = scale_stats(c.scale_inv)
    a = c.dequantize(torch.float32).abs()
    # values under a NaN scale (E = 255) decode to NaN: counted in nan_scales, skipped here
    a = a[~torch.isnan(a)]
    out["absmax"] = float(a.max()) if a.numel() else 0.0
    out["mean_abs"] = float(a.mean()) if a.numel() else 0.0
    k = c.shape[-1]
    nb = -(-k // BLOCK_SIZE)
    zero = (c.data.view(torch.uint8) & 0x7F) == 0
    zero = torch.nn.functional.pad(zero.reshape(-1, k), (0, nb * BLOCK_SIZE - k), value=True)
    blocks = zero.reshape(-1, nb, BLOCK_SIZE).all(dim=-1)
    out["zero_block_fraction"] = float(blocks.float().mean()) if blocks.numel() else 0.0
    return out


@dataclass(frozen=True)
class InspectReport:
    """What :func:`inspect` found. ``to_dict()`` is the JSON report (``mxport inspect --json``);
    ``report[key]`` reads the same keys.

    Attributes:
        path: as given. format: one of FORMATS or None. format_source: "config" | "names" | None.
        tensors: per tensor {name, shape, dtype, role, pair}. pairs: per MXFP8 pair {values, scale, shape,
            element, scale_shape, scale_dtype, ok, and the :func:`pair_stats` / :func:`scale_stats` figures
            when decoded}.
        totals: {tensors, bytes, values_bytes, scales_bytes, kept_bytes, bf16_bytes, ratio_to_bf16}.
        problems / warnings: one-line strings; any problem makes ``mxport inspect`` exit 1.
        consumers: {"vllm", "sglang", "te"} -> the problems that consumer has with the checkpoint's shapes
            (:func:`consumer_problems`, MXFP8's K rule; each is in ``problems`` too). Empty lists for 4-bit
            weights: their packed form cannot hold a K that is not whole blocks (a scale of the wrong shape
            is a problem of its own).
        quant: the weights' format, "mxfp8" (FP8 pairs found), "mxfp4" / "nvfp4" (the config declares 4-bit
            weights: pairs are then per weight {values, scale, global_scale_tensor, shape (logical), element
            "e2m1", quant, scale_shape, scale_dtype, ok, scale_exp_min/max, global_scale, and the decoded
            figures}), or None.
    """

    path: str
    format: str | None
    format_source: str | None
    tensors: tuple[dict, ...]
    pairs: tuple[dict, ...]
    totals: dict
    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    consumers: dict = field(default_factory=dict)
    quant: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"path": self.path, "format": self.format, "format_source": self.format_source,
                "tensors": [dict(t) for t in self.tensors], "pairs": [dict(p) for p in self.pairs],
                "totals": dict(self.totals), "problems": list(self.problems), "warnings": list(self.warnings),
                "consumers": {k: list(v) for k, v in self.consumers.items()}, "quant": self.quant}

    def __getitem__(self, key: str):
        return self.to_dict()[key]


def _decode_pairs(d: SafetensorsDir, a, fmt, stats: bool, problems: list, warnings: list,
                  on_progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """One entry per pair; pairs whose scale header is right are read and checked (:func:`data_problems`).
    ``on_progress(done, total)`` is called before the first pair and after each one."""
    shapes = {n: s for n, s, _ in d.entries()}
    dtypes = {n: t for n, _, t in d.entries()}
    pairs = []
    if on_progress is not None:
        on_progress(0, len(a.pair_of))
    for base, sname in a.pair_of.items():
        entry = {"values": base, "scale": sname, "shape": list(shapes[base]),
                 "element": "e5m2" if dtypes[base] == torch.float8_e5m2 else "e4m3",
                 "scale_shape": list(shapes[sname]), "scale_dtype": dtype_str(dtypes[sname]),
                 "ok": base not in a.bad}
        if entry["ok"]:
            scale = d.get(sname)
            c = MXFP8Components(d.get(base), scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale,
                                "rowwise")
            entry.update(pair_stats(c) if stats else scale_stats(c.scale_inv))
            p, w = data_problems(c, sname, base)
            problems.extend(p)
            warnings.extend(w)
            del c
        pairs.append(entry)
        if on_progress is not None:
            on_progress(len(pairs), len(a.pair_of))
    if fmt == "sglang" and any(p["element"] == "e5m2" for p in pairs):
        problems.append("E5M2 values in an sglang checkpoint: SGLang 0.5.23 registers MXFP8 values as E4M3 "
                        "whatever the config says, so they load there as garbage (export E4M3)")
    return pairs


def _totals(d: SafetensorsDir, roles: dict[str, str], per_value_byte: int = 1) -> dict:
    """Bytes by role and against BF16 (``per_value_byte``: elements a values byte, 2 for packed E2M1)."""
    by_role = {"values": 0, "scales": 0, "kept": 0}
    bf16 = 0
    for n, shape, _ in d.entries():
        by_role[roles[n]] += d.nbytes(n)
        if roles[n] != "scales":
            bf16 += 2 * math.prod(shape) * (per_value_byte if roles[n] == "values" else 1)
    total = sum(by_role.values())
    return {"tensors": len(roles), "bytes": total, "values_bytes": by_role["values"],
            "scales_bytes": by_role["scales"], "kept_bytes": by_role["kept"], "bf16_bytes": bf16,
            "ratio_to_bf16": total / bf16 if bf16 else 0.0}


def inspect(path: str | os.PathLike, *, stats: bool = True,
            on_progress: Callable[[int, int], None] | None = None) -> InspectReport:
    """Inspect the checkpoint at ``path`` (a model directory or one ``.safetensors`` file); see the module
    docstring for the problems it reports. ``on_progress(done, total)`` is called before the first MXFP8 pair
    is read and after each one.

    Raises FileNotFoundError for a missing path; CheckpointError (a ValueError) for files that cannot be read
    safely (no safetensors, a corrupt header or index, a FIFO, a symlink out of the folder, malformed JSON).
    """
    with SafetensorsDir(path) as d:
        q = describe_quantization(d)
        fp4, source = detect_fp4(q.config), "config"
        if fp4 is None and q.format is None:
            fp4, source = fp4_by_names(d.entries()), "names"
        if fp4 is not None:
            return _inspect_fp4(d, path, *fp4, source, stats=stats, on_progress=on_progress)
        a = analyse_pairs(d.entries(), q.format, q.declared)
        problems, warnings = list(a.problems), list(a.warnings)
        pairs = _decode_pairs(d, a, q.format, stats, problems, warnings, on_progress)
    if not a.pair_of:
        if q.source == "config":
            problems.append(f"config declares {q.format!r} MXFP8 quantization but no FP8 values/scale pair "
                            "is in the files")
        else:
            problems.append("nothing MXFP8 in this checkpoint: no FP8 values/scale pair (not quantized?)")
    consumers = consumer_problems(pairs)
    problems += [line for lines in consumers.values() for line in lines]
    values_of = {s: b for b, s in a.pair_of.items()}  # scale name -> values name
    tensors = tuple({"name": n, "shape": list(s), "dtype": dtype_str(t), "role": a.roles[n],
                     "pair": a.pair_of.get(n) or values_of.get(n)} for n, s, t in d.entries())
    return InspectReport(str(path), q.format, q.source, tensors, tuple(pairs), _totals(d, a.roles),
                         tuple(problems), tuple(warnings), consumers, "mxfp8" if a.pair_of else None)


def _fp4_stats(c, stats: bool) -> dict:
    """A 4-bit weight's figures (of a weight without problems): block-scale exponents (floor log2 of the
    nonzero finite decoded block scales), and with ``stats`` the decoded |max|, mean |x| and the fraction of
    all-zero blocks."""
    scale = (e8m0_to_float(c.scale) if c.format.scale_codec == "e8m0"
             else c.scale.to(torch.float32) * c.global_scale)
    nz = scale[(scale > 0) & torch.isfinite(scale)]
    out = {"scale_exp_min": int(torch.floor(torch.log2(nz.min()))) if nz.numel() else 0,
           "scale_exp_max": int(torch.floor(torch.log2(nz.max()))) if nz.numel() else 0,
           "global_scale": float(c.global_scale) if c.global_scale is not None else None}
    if stats and c.data.numel():
        x = c.dequantize()
        blocks = (c.data == 0).reshape(*c.data.shape[:-1], -1, c.format.block // 2).all(-1)
        out.update(absmax=float(x.abs().max()) if x.numel() else 0.0,
                   mean_abs=float(x.abs().mean()) if x.numel() else 0.0,
                   zero_block_fraction=float(blocks.float().mean()) if blocks.numel() else 0.0)
    return out


def _inspect_fp4(d: SafetensorsDir, path, fmt: str, quant: str, source: str = "config", *, stats: bool,
                 on_progress) -> InspectReport:
    """:func:`inspect` of a 4-bit checkpoint (:mod:`mxport.checkpoint.fp4_pairs`)."""
    entries = d.entries()
    weights, roles, problems = fp4_weights(entries, fmt, quant)
    pairs = []
    for i, w in enumerate(weights):
        if on_progress is not None:
            on_progress(i, len(weights))
        c = read_fp4(d.get, w, fmt, quant)
        bad = fp4_data_problems(c, w, d.get(w.global_scale) if w.global_scale else None)
        problems += bad
        pairs.append({"values": w.values, "scale": w.scale, "global_scale_tensor": w.global_scale,
                      "shape": list(w.shape), "element": "e2m1", "quant": quant,
                      "scale_shape": list(c.scale.shape), "scale_dtype": dtype_str(c.scale.dtype),
                      "ok": not bad, **(_fp4_stats(c, stats) if not bad else {})})
    if on_progress is not None:
        on_progress(len(weights), len(weights))
    if not weights and not problems:
        problems.append(f"config declares {quant.upper()} ({fmt}) but no 4-bit weight is in the files")
    if source == "names":
        problems.append(f"no quantization config: the tensors look like {fmt} {quant.upper()} weights, but an"
                        " engine reads them as plain tensors (config.json's quantization_config is missing)")
    names = {n for n, _, _ in entries}
    pair_of = {t: w.name for w in weights
               for t in (w.values, w.scale, w.global_scale, input_scale_name(w.name)) if t in names}
    tensors = tuple({"name": n, "shape": list(s), "dtype": dtype_str(t), "role": roles[n],
                     "pair": pair_of.get(n)} for n, s, t in entries)
    return InspectReport(str(path), fmt, source, tensors, tuple(pairs), _totals(d, roles, 2),
                         tuple(problems), (), {key: [] for key in K_RULES}, quant)


def inspect_checkpoint(path: str | os.PathLike, *, stats: bool = True,
                       on_progress: Callable[[int, int], None] | None = None) -> dict:
    """:func:`inspect` as a JSON-able dict (``InspectReport.to_dict()``): ``path``, ``format``,
    ``format_source``, ``tensors``, ``pairs``, ``totals``, ``problems``, ``warnings``.

    Raises FileNotFoundError / CheckpointError (a ValueError) as :func:`inspect`.
    """
    return inspect(path, stats=stats, on_progress=on_progress).to_dict()
