"""Inspect an MXFP8 checkpoint (ours or another producer's): roles, pairs, scale exponents, value statistics,
totals, and the problems an engine would trip on.

Roles: ``values`` (an FP8 tensor), ``scales`` (``<values>_scale`` / ``<values>_scale_inv``, or any
``*.weight_scale`` / ``*.weight_scale_inv``), ``kept`` (everything else). The format comes from ``config.json``
``quantization_config`` or ``hf_quant_config.json``, else from the scale names (see
:func:`~mxport.checkpoint.readers.format_by_names`).

Problems (each makes ``mxport inspect`` exit 1): values without a scale; a scale without values, or for values that
are not FP8; a scale that is not ``uint8`` E8M0 bytes (e.g. stored as float: ``F32`` / ``BF16``); a scale shape
that is not compact ``(*shape[:-1], ceil(K/32))`` (e.g. TE's padded ``[128, 4]`` for a ``[3, 64]`` weight); a scale
name that does not follow the detected format; E5M2 values in a format that declares E4M3; NaN scale bytes (255);
a config that declares MXFP8 with no MXFP8 tensor in the files. A ``float8_e8m0fnu`` (``F8_E8M0``) scale is the same
bytes: a warning, not a problem.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..components import MXFP8Components, compact_scale_shape
from ..formats import BLOCK_SIZE, is_fp8_dtype
from .naming import ALLOWED_FP8, FORMATS, SCALE_SUFFIX, detect_format
from .readers import SafetensorsDir, format_by_names, read_quant_config

_ALL_SUFFIXES = ("_scale_inv", "_scale")


def _dtype_str(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _scale_owner(name: str, present: set[str]) -> tuple[str, str] | None:
    """(values name, suffix) when ``name`` is named like a scale: ``X_scale_inv`` / ``X_scale`` with ``X`` present,
    or ``*.weight_scale(_inv)`` regardless of ``X``."""
    for suf in _ALL_SUFFIXES:
        if name.endswith(suf):
            base = name[: -len(suf)]
            if base in present or base.endswith(".weight"):
                return base, suf
    return None


def scale_stats(scale: torch.Tensor) -> dict:
    """Statistics of E8M0 scale bytes alone (cheap: 1/32 of the values): exponent range E - 127 (NaN bytes
    skipped), the count of NaN bytes (E = 255) and of zero bytes (E = 0, i.e. 2**-127)."""
    e = scale.to(torch.int32)
    finite = e[e != 255]
    return {"scale_exp_min": int(finite.min()) - 127 if finite.numel() else None,
            "scale_exp_max": int(finite.max()) - 127 if finite.numel() else None,
            "nan_scales": int((e == 255).sum()), "zero_scales": int((e == 0).sum())}


def pair_stats(c: MXFP8Components) -> dict:
    """Statistics of one rowwise MXFP8 pair: :func:`scale_stats`, decoded absmax and mean |x| (FP32, NaN values
    skipped), the fraction of blocks whose 32 (or fewer, at a row's end) values are all zero."""
    out = scale_stats(c.scale_inv)
    a = c.dequantize(torch.float32).abs()
    a = a[~torch.isnan(a)]  # values under a NaN scale (E = 255) decode to NaN: counted in nan_scales, skipped here
    out["absmax"] = float(a.max()) if a.numel() else 0.0
    out["mean_abs"] = float(a.mean()) if a.numel() else 0.0
    k = c.shape[-1]
    nb = -(-k // BLOCK_SIZE)
    zero = (c.data.view(torch.uint8) & 0x7F) == 0
    zero = torch.nn.functional.pad(zero.reshape(-1, k), (0, nb * BLOCK_SIZE - k), value=True)
    blocks = zero.reshape(-1, nb, BLOCK_SIZE).all(dim=-1)
    out["zero_block_fraction"] = float(blocks.float().mean()) if blocks.numel() else 0.0
    return out


def inspect_checkpoint(path: str | os.PathLike, *, stats: bool = True,
                       on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Inspect the checkpoint at ``path`` (a model directory or one ``.safetensors`` file).

    Returns a JSON-able dict: ``path``, ``format`` (one of FORMATS or None), ``format_source`` ("config" | "names"
    | None), ``tensors`` (list of {name, shape, dtype, role, pair}), ``pairs`` (list of {values, scale, shape,
    element, scale_shape, scale_dtype, ok, and with ``stats`` the :func:`pair_stats` figures}), ``totals``
    ({tensors, bytes, values_bytes, scales_bytes, kept_bytes, bf16_bytes, ratio_to_bf16}), ``problems`` and
    ``warnings`` (lists of one-line strings).

    ``on_progress(done, total)`` is called before the first MXFP8 pair is read and after each one.

    Raises FileNotFoundError / ValueError for a missing path, no safetensors, a corrupt header.
    """
    d = SafetensorsDir(path)
    entries = d.entries()
    shapes = {n: s for n, s, _ in entries}
    dtypes = {n: t for n, _, t in entries}
    names = [n for n, _, _ in entries]
    present = set(names)
    problems: list[str] = []
    warnings: list[str] = []

    qc = read_quant_config(d.path, d.config) if Path(path).expanduser().is_dir() else None
    fmt, fmt_src = detect_format(qc), "config"
    if fmt is None:
        fmt, fmt_src = format_by_names(names, dtypes), "names"
        if fmt is None:
            fmt_src = None

    roles = {n: "kept" for n in names}
    pair_of: dict[str, str] = {}
    for n in names:  # scales first: names like X_scale whose X exists, or *.weight_scale(_inv)
        owner = _scale_owner(n, present)
        if owner is None:
            continue
        base, suf = owner
        if base not in present:
            roles[n] = "scales"
            problems.append(f"{n}: scale without values (no tensor {base!r})")
            continue
        if not is_fp8_dtype(dtypes[base]):
            if dtypes[n] == torch.uint8:
                roles[n] = "scales"
                problems.append(f"{n}: scale for {base!r}, which is {_dtype_str(dtypes[base])}, not FP8 values")
            continue
        roles[n] = "scales"
        if base in pair_of:
            problems.append(f"{base}: two scale tensors ({pair_of[base]!r} and {n!r})")
            continue
        pair_of[base] = n
        if fmt in FORMATS and suf != SCALE_SUFFIX[fmt]:
            problems.append(f"{n}: scale name does not follow format {fmt!r} (expected {base + SCALE_SUFFIX[fmt]!r})")
    for n in names:
        if is_fp8_dtype(dtypes[n]):
            roles[n] = "values"
            if n not in pair_of:
                want = n + SCALE_SUFFIX[fmt] if fmt in FORMATS else f"{n}_scale or {n}_scale_inv"
                problems.append(f"{n}: FP8 values without a scale (expected {want})")
            if fmt in FORMATS and dtypes[n] not in ALLOWED_FP8[fmt]:
                problems.append(f"{n}: {_dtype_str(dtypes[n])} values, but format {fmt!r} declares E4M3")

    pairs = []
    if on_progress is not None:
        on_progress(0, len(pair_of))
    for base, sname in pair_of.items():
        shape, sshape, sdt = shapes[base], shapes[sname], dtypes[sname]
        want = compact_scale_shape(shape) if shape else None
        entry = {"values": base, "scale": sname, "shape": list(shape),
                 "element": "e5m2" if dtypes[base] == torch.float8_e5m2 else "e4m3",
                 "scale_shape": list(sshape), "scale_dtype": _dtype_str(sdt), "ok": True}
        if sdt not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
            problems.append(f"{sname}: scale stored as {_dtype_str(sdt)}; expected uint8 E8M0 bytes (bit patterns, "
                            "not values)")
            entry["ok"] = False
        elif sdt != torch.uint8:
            warnings.append(f"{sname}: float8_e8m0fnu scale (same bytes as uint8; engines expect U8)")
        if want is None or tuple(sshape) != tuple(want):
            hint = ""
            if want is not None and len(sshape) == 2 and sshape[0] % 128 == 0 and sshape[1] % 4 == 0 and (
                    sshape[0] >= want[0] and sshape[-1] >= want[-1]):
                hint = " (looks padded to 128x4 as TE stores it: slice it to the compact shape)"
            problems.append(f"{sname}: scale shape {list(sshape)} for values {list(shape)}; expected compact "
                            f"{list(want) if want else '?'}{hint}")
            entry["ok"] = False
        if entry["ok"]:
            c = MXFP8Components(d.get(base), d.get(sname), "rowwise")
            entry.update(pair_stats(c) if stats else scale_stats(c.scale_inv))
            if entry["nan_scales"]:
                problems.append(f"{sname}: {entry['nan_scales']} NaN scale byte(s) (E = 255)")
            if c.scale_inv.numel() and entry["zero_scales"] == c.scale_inv.numel():
                if bool(((c.data.view(torch.uint8) & 0x7F) != 0).any()):
                    problems.append(f"{sname}: every scale byte is 0 (2**-127) but the values are not zero: "
                                    "scales never written?")
                else:
                    warnings.append(f"{base}: an all-zero weight (values and scales all 0)")
            del c
        pairs.append(entry)
        if on_progress is not None:
            on_progress(len(pairs), len(pair_of))
    d.close()

    if qc is not None and fmt_src == "config" and not pair_of:
        problems.append(f"config declares {fmt!r} MXFP8 quantization but no FP8 values/scale pair is in the files")

    values_of = {s: b for b, s in pair_of.items()}  # scale name -> values name
    tensors = [{"name": n, "shape": list(shapes[n]), "dtype": _dtype_str(dtypes[n]), "role": roles[n],
                "pair": pair_of.get(n) or values_of.get(n)} for n in names]
    by_role = {"values": 0, "scales": 0, "kept": 0}
    bf16 = 0
    for n in names:
        by_role[roles[n]] += d.nbytes(n)
        if roles[n] != "scales":
            numel = 1
            for s in shapes[n]:
                numel *= s
            bf16 += 2 * numel
    total = sum(by_role.values())
    totals = {"tensors": len(names), "bytes": total, "values_bytes": by_role["values"],
              "scales_bytes": by_role["scales"], "kept_bytes": by_role["kept"], "bf16_bytes": bf16,
              "ratio_to_bf16": total / bf16 if bf16 else 0.0}
    return {"path": str(path), "format": fmt, "format_source": fmt_src, "tensors": tensors, "pairs": pairs,
            "totals": totals, "problems": problems, "warnings": warnings}
