"""The fixed sets of values the command line takes, as Enums.

Typer checks them and lists them in ``--help``.
"""

from __future__ import annotations

import enum

import typer

from ..bench import BENCHMARKS
from ..checkpoint.export import DTYPES, FP8_DTYPES
from ..checkpoint.naming import E5M2_REFUSED, FORMATS, exportable_fp8


def _choices(name: str, values) -> type[enum.Enum]:
    return enum.Enum(name, [(v, v) for v in values], type=str)


Format = _choices("Format", FORMATS)  #: checkpoint formats of ``mxport export``
Fp8Dtype = _choices("Fp8Dtype", FP8_DTYPES)  #: FP8 element types (e4m3, e5m2)
Dtype = _choices("Dtype", DTYPES)  #: what kept floating tensors may be cast to
Benchmark = _choices("Benchmark", BENCHMARKS)  #: ``mxport bench --only``
Activation = _choices("Activation", ("none", "mxfp8"))  #: ``mxport verify --activation``
Quant = _choices("Quant", ("mxfp8", "mxfp4", "nvfp4"))  #: ``mxport verify --quant``: the weights' format


#: the FP8 element types ``mxport export`` offers: those some format can declare (e4m3)
EXPORT_FP8 = tuple(exportable_fp8(FP8_DTYPES))


def export_fp8(value):
    """Option callback of ``mxport export --fp8-dtype``: an element type no format takes (e5m2) is refused
    while parsing, in one line (the choices stay those of :data:`Fp8Dtype`, so a typo is told the same)."""
    if value is not None and Fp8Dtype(value).value not in EXPORT_FP8:
        raise typer.BadParameter(f"{Fp8Dtype(value).value}: {E5M2_REFUSED}; export E4M3 (--fp8-dtype e4m3)")
    return value


def positive(value: float | None) -> float | None:
    """Option callback: a number > 0 (``min=`` is inclusive; NaN is refused too)."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"must be > 0, got {value}")
    return value
