"""4-bit checkpoints (MXFP4, NVFP4): which tensors hold a weight's packed values, block scales and global
scale, and what can be wrong with them, from the headers and then from the bytes.

Names follow :func:`~mxport.checkpoint.naming.quant_names`: ModelOpt ``<m>.weight`` (uint8, two E2M1 codes a
byte) / ``<m>.weight_scale`` / ``<m>.weight_scale_2``; compressed-tensors ``<m>.weight_packed`` /
``<m>.weight_scale`` / ``<m>.weight_global_scale`` (the divisor ``1 / g``). A weight of logical shape
``(*lead, K)`` stores values ``(*lead, K/2)`` and scales ``(*lead, K/block)``: uint8 E8M0 bytes for MXFP4
(block 32), ``float8_e4m3fn`` for NVFP4 (block 16) plus one float32 global scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fp4 import FP4Components
from ..quants import get_quant
from .naming import input_scale_name, quant_names


@dataclass(frozen=True)
class FP4Weight:
    """One 4-bit weight of a checkpoint: its tensors' names and its logical shape (K = twice the packed
    values' last dimension)."""

    name: str
    values: str
    scale: str
    global_scale: str | None
    shape: tuple[int, ...]


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _weight_problems(w: FP4Weight, quant, shapes, dtypes) -> list[str]:
    """What the headers say is wrong with one weight's scale and global scale."""
    out = []
    if dtypes[w.scale] != quant.scale_dtype:
        out.append(f"{w.scale}: {_dt(dtypes[w.scale])} scales; {quant.name} stores {_dt(quant.scale_dtype)}")
    want = quant.scale_shape(w.shape)
    if tuple(shapes[w.scale]) != want or w.shape[-1] % quant.block:
        out.append(f"{w.scale}: scale shape {list(shapes[w.scale])} for a weight of logical shape "
                   f"{list(w.shape)}; expected {list(want)} (K a multiple of {quant.block})")
    if w.global_scale is not None:
        if w.global_scale not in shapes:
            out.append(f"{w.values}: no global scale (expected {w.global_scale})")
        elif dtypes[w.global_scale] != torch.float32 or torch.Size(shapes[w.global_scale]).numel() != 1:
            out.append(f"{w.global_scale}: a global scale must be one float32 value, got "
                       f"{_dt(dtypes[w.global_scale])} {list(shapes[w.global_scale])}")
    return out


def fp4_weights(entries, fmt: str, quant_name: str) -> tuple[list[FP4Weight], dict[str, str], list[str]]:
    """``(weights, roles, problems)`` of a 4-bit checkpoint's tensors from their headers: every
    ``*.weight_scale`` with its packed values (uint8) and global scale; roles "values" / "scales" / "kept";
    problems for a scale without values, values that are not uint8, a scale of the wrong dtype or shape, a
    missing or malformed global scale, and uint8 values named as a weight's without a scale."""
    quant = get_quant(quant_name)
    shapes = {n: tuple(s) for n, s, _ in entries}
    dtypes = {n: t for n, _, t in entries}
    roles = {n: "kept" for n in shapes}
    weights, problems = [], []
    for n in shapes:
        if not n.endswith(".weight_scale"):
            continue
        base = n.removesuffix("_scale")
        values, scale, glob = quant_names(base, fmt, quant.name)
        roles[scale] = "scales"
        if values not in shapes or dtypes[values] != torch.uint8 or not shapes[values]:
            got = f"{_dt(dtypes[values])}" if values in shapes else "no tensor"
            problems.append(f"{scale}: scale without packed uint8 values ({values}: {got})")
            continue
        lead, half = shapes[values][:-1], shapes[values][-1]
        w = FP4Weight(base, values, scale, glob, (*lead, 2 * half))
        roles[values] = "values"
        if glob is not None and glob in shapes:
            roles[glob] = "scales"
        bad = _weight_problems(w, quant, shapes, dtypes)
        act = input_scale_name(base)
        if act in shapes:  # W4A4: the activation's calibrated scale
            roles[act] = "scales"
            if dtypes[act] != torch.float32 or torch.Size(shapes[act]).numel() != 1:
                bad.append(f"{act}: an input scale must be one float32 value, got {_dt(dtypes[act])} "
                           f"{list(shapes[act])}")
        problems += bad
        if not bad:
            weights.append(w)
    for n in shapes:
        packed = n.endswith(".weight_packed") or (fmt == "modelopt" and n.endswith(".weight"))
        if packed and dtypes[n] == torch.uint8 and roles[n] == "kept":
            problems.append(f"{n}: packed 4-bit values without a scale")
    return weights, roles, problems


def read_fp4(get, w: FP4Weight, fmt: str, quant_name: str) -> FP4Components:
    """One weight's :class:`~mxport.fp4.FP4Components` read through ``get(name)`` (the global scale as ``g``:
    compressed-tensors' stored divisor inverted)."""
    quant = get_quant(quant_name)
    g = None
    if w.global_scale is not None:
        g = get(w.global_scale).to(torch.float32).reshape(())
        g = g if fmt == "modelopt" else 1.0 / g
    return FP4Components(quant.fp4_format, get(w.values), get(w.scale), g)


def fp4_data_problems(c: FP4Components, w: FP4Weight, stored: torch.Tensor | None = None) -> list[str]:
    """What the bytes say is wrong: NaN scale bytes (E8M0 255; E4M3 S.1111.111), negative NVFP4 block scales,
    a global scale (``stored``: as the file holds it; ``c``'s is the one it means) that is not finite and
    above 0, every scale zero while values are not (never written)."""
    out = []
    bits = c.scale.view(torch.uint8)
    nan = int((bits == 255).sum()) if c.format.scale_codec == "e8m0" else int(((bits & 0x7F) == 0x7F).sum())
    if nan:
        out.append(f"{w.scale}: {nan} NaN scale byte(s)")
    if c.format.scale_codec == "e4m3" and int((bits & 0x80).sum()):
        out.append(f"{w.scale}: negative NVFP4 block scales")
    g = c.global_scale
    if g is not None and not (bool(torch.isfinite(g)) and float(g) > 0):
        held = float(stored.reshape(-1)[0]) if stored is not None and stored.numel() else float(g)
        meaning = "" if held == float(g) else f" (as a divisor: global scale {float(g)})"
        out.append(f"{w.global_scale}: {held}{meaning} is not a finite global scale above 0")
    if bits.numel() and bool((bits == 0).all()) and bool((c.data != 0).any()):
        out.append(f"{w.scale}: every scale is 0 but the values are not zero: scales never written?")
    return out


def fp4_by_names(entries) -> tuple[str, str] | None:
    """``(format, quant)`` of a checkpoint without a quantization config whose tensors are named and typed
    like 4-bit weights: a uint8 ``<m>.weight_packed`` with its ``<m>.weight_scale`` (compressed-tensors), or a
    uint8 ``<m>.weight`` with a ``<m>.weight_scale`` of the packed values' rank (ModelOpt; MXFP8's values are
    FP8, never uint8); NVFP4 when the scale is E4M3, else MXFP4. None otherwise."""
    dtypes = {n: t for n, _, t in entries}
    for n, dt in dtypes.items():
        if dt != torch.uint8:
            continue
        for suffix, fmt in ((".weight_packed", "compressed-tensors"), (".weight", "modelopt")):
            scale = n.removesuffix(suffix) + ".weight_scale"
            if n.endswith(suffix) and scale in dtypes:
                return fmt, "nvfp4" if dtypes[scale] == torch.float8_e4m3fn else "mxfp4"
    return None
