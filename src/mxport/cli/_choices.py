"""The fixed sets of values the command line takes, as Enums.

Typer checks them and lists them in ``--help``.
"""

from __future__ import annotations

import enum

import typer

from ..bench import BENCHMARKS
from ..checkpoint.export import DTYPES, FP8_DTYPES
from ..checkpoint.naming import FORMATS


def _choices(name: str, values) -> type[enum.Enum]:
    return enum.Enum(name, [(v, v) for v in values], type=str)


Format = _choices("Format", FORMATS)  #: checkpoint formats of ``mxport export``
Fp8Dtype = _choices("Fp8Dtype", FP8_DTYPES)  #: FP8 element types (e4m3, e5m2)
Dtype = _choices("Dtype", DTYPES)  #: what kept floating tensors may be cast to
Benchmark = _choices("Benchmark", BENCHMARKS)  #: ``mxport bench --only``
Activation = _choices("Activation", ("none", "mxfp8"))  #: ``mxport verify --activation``


def positive(value: float | None) -> float | None:
    """Option callback: a number > 0 (``min=`` is inclusive; NaN is refused too)."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"must be > 0, got {value}")
    return value
