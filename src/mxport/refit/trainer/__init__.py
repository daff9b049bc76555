"""What a trainer rank holds, and its bytes after every optimizer step.

- :mod:`.whole`: :class:`TrainerSource`, a whole model (one rank: the plan, and per refit its tensors,
  quantized lazily, optionally straight into a send buffer laid out as the byte stream);
- :mod:`.dtensor`: :class:`ShardedTrainerSource`, one rank of a ``DTensor`` model (FSDP2, tensor parallel);
- :mod:`.held`: :class:`HeldTensorsSource`, named tensors (or ranges of them) a rank holds.
"""

from .dtensor import ShardedTrainerSource
from .held import HeldTensorsSource
from .whole import TrainerSource, kept_wire_dtype

__all__ = ["HeldTensorsSource", "ShardedTrainerSource", "TrainerSource", "kept_wire_dtype"]
