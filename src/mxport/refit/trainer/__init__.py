"""What a trainer rank holds, and its bytes after every optimizer step: :mod:`.whole` (a whole model),
:mod:`.dtensor` (one rank of a ``DTensor`` model), :mod:`.held` (named tensors, or ranges of them)."""

from .dtensor import ShardedTrainerSource
from .held import HeldTensorsSource
from .whole import TrainerSource, kept_wire_dtype

__all__ = ["HeldTensorsSource", "ShardedTrainerSource", "TrainerSource", "kept_wire_dtype"]
