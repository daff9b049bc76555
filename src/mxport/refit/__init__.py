"""Refit: move a trainer's MXFP8 weights into a running inference model after every step — planned, bucketed,
checked, in place, all or nothing.

- :class:`RefitPlan` (ordered tensors, bytes, buckets, digest) and :class:`RefitPlanMismatch`;
- :class:`RefitSender` / :class:`RefitReceiver` (fixed-size byte buckets, overlapped packing, per-bucket
  checksums, stable pointers, a version counter; staging then ``copy_`` commit, or direct receive into an
  arena from :func:`allocate_targets` with a rollback copy), :class:`RefitError` and each receiver's
  :class:`ReceiverResult` / :class:`Status`;
- transports: :class:`Transport` (what a refit needs of one), :class:`TorchDistTransport` (gloo / NCCL),
  :class:`InProcessChannel` (colocated);
- the trainer side: :class:`TrainerSource` (policy + quantize); the inference side: :func:`receiver_plan` (an
  ``MXFP8Linear`` model's live buffers), :func:`checkpoint_tensors` (``(hf_name, tensor)`` pairs for vLLM /
  SGLang loaders);
- sharded refit (T trainer, E engine ranks): the global plan :class:`MeshPlan` (boxes each rank holds or
  needs, :class:`Box` / :class:`Holding`, routes per (trainer, engine) pair, :func:`agree`); one pair stream
  per pair and one vote, :class:`ShardedSender` / :class:`ShardedReceiver`; sharded trainers
  :class:`ShardedTrainerSource` (DTensor models) and :class:`HeldTensorsSource` (named tensors a rank holds),
  engine ranks' :func:`engine_holdings` / :func:`engine_buffers`.

Everything else (plan entries, votes, per-pair stats, the pair transport, arenas laid out as a stream) is in
the submodule that holds it. The modules are described in docs/guide-refit.md.
"""

from .arena import allocate_targets
from .engine import checkpoint_tensors, engine_buffers, engine_holdings, receiver_plan
from .mesh import Box, Holding, MeshPlan, agree
from .plan import RefitPlan, RefitPlanMismatch
from .receiver import RefitReceiver
from .results import ReceiverResult, RefitError, Status
from .sender import RefitSender
from .sharded import ShardedReceiver, ShardedSender
from .trainer import HeldTensorsSource, ShardedTrainerSource, TrainerSource
from .transport import InProcessChannel, TorchDistTransport, Transport

__all__ = [
    "Box",
    "Holding",
    "MeshPlan",
    "agree",
    "HeldTensorsSource",
    "InProcessChannel",
    "ReceiverResult",
    "RefitError",
    "RefitPlan",
    "RefitPlanMismatch",
    "RefitReceiver",
    "RefitSender",
    "ShardedTrainerSource",
    "ShardedReceiver",
    "ShardedSender",
    "Status",
    "TorchDistTransport",
    "TrainerSource",
    "Transport",
    "allocate_targets",
    "checkpoint_tensors",
    "engine_buffers",
    "engine_holdings",
    "receiver_plan",
]
