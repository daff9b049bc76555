"""What an engine rank needs, and where a refit lands in it.

- :mod:`.plain`: a whole inference model: :func:`receiver_plan` (its plan and live targets, e.g. of
  :class:`~mxport.nn.MXFP8Linear` s) and :func:`checkpoint_tensors` (checkpoint-format pairs for engines' own
  loaders);
- :mod:`.slices`: one rank of a tensor / expert-parallel engine: :func:`engine_holdings` (vLLM's slicing,
  fused qkv / gate_up / w13) and :func:`engine_buffers`.
"""

from .plain import checkpoint_tensors, receiver_plan
from .slices import engine_boxes, engine_buffers, engine_holdings

__all__ = ["checkpoint_tensors", "engine_boxes", "engine_buffers", "engine_holdings", "receiver_plan"]
