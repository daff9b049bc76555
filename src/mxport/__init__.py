"""mxport: MXFP8 weights from training to inference — export, convert, sync (refit), verify.

Public names (the table under "The library" in README.md): :class:`MXFP8Components`, :func:`quantize`,
:func:`dequantize`, :func:`export_components`; scale layouts live in :mod:`mxport.layouts`.
"""

from . import layouts
from .components import MXFP8Components, dequantize
from .export import export_components, export_grouped_components
from .quantize import quantize

__version__ = "0.1.0"

__all__ = [
    "MXFP8Components",
    "dequantize",
    "export_components",
    "export_grouped_components",
    "layouts",
    "quantize",
    "__version__",
]
