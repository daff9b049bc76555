"""What an engine rank needs, and where a refit lands in it: :mod:`.plain` (a whole inference model) and
:mod:`.slices` (one rank of a tensor / expert-parallel engine, vLLM's fused buffers)."""

from .plain import checkpoint_tensors, receiver_plan
from .slices import engine_boxes, engine_buffers, engine_holdings

__all__ = ["checkpoint_tensors", "engine_boxes", "engine_buffers", "engine_holdings", "receiver_plan"]
