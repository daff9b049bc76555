"""MXFP8 checkpoints for inference engines: readers, the streaming sharded writer, naming per format, export
and inspection (formats: docs/format.md, "What each consumer expects").

Public: :func:`open_checkpoint` / :class:`CheckpointReader` (read an exported checkpoint back as
``(name, MXFP8Components | Tensor)``), :data:`FORMATS`, :func:`scale_name`, :func:`quantization_config`,
:func:`export_checkpoint`, :func:`inspect_checkpoint`; :class:`CheckpointError` (a ValueError naming the file)
for files that cannot be read safely or correctly.
"""

from .export import ExportResult, export_checkpoint
from .inspect import inspect_checkpoint
from .naming import FORMATS, quantization_config, scale_name
from .readers import CheckpointError, CheckpointReader, SafetensorsDir, StateDictSource, open_checkpoint

__all__ = [
    "FORMATS",
    "CheckpointError",
    "CheckpointReader",
    "ExportResult",
    "SafetensorsDir",
    "StateDictSource",
    "export_checkpoint",
    "inspect_checkpoint",
    "open_checkpoint",
    "quantization_config",
    "scale_name",
]
