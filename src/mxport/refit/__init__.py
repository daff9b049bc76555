"""Refit: move a trainer's MXFP8 weights into a running inference model after every step — planned, bucketed,
checked, in place, all or nothing.

- :class:`RefitPlan` (ordered tensors, bytes, buckets, digest) and :class:`RefitPlanMismatch`;
- :class:`RefitSender` / :class:`RefitReceiver` (fixed-size byte buckets, overlapped packing, per-bucket
  checksums, stable pointers, a version counter; staging then ``copy_`` commit, or direct receive into an
  arena from
  :func:`allocate_targets` with a rollback copy), :class:`RefitError` and each receiver's
  :class:`ReceiverResult` / :class:`Status`;
- transports: :class:`TorchDistTransport` (gloo / NCCL broadcast), :class:`InProcessChannel` (colocated),
  :class:`PairTransport` (point-to-point between two ranks of a group);
- the trainer side: :class:`TrainerSource` (policy + quantize); the inference side: :func:`receiver_plan` (an
  ``MXFP8Linear`` model's live buffers), :func:`checkpoint_tensors` (``(hf_name, tensor)`` pairs for vLLM /
  SGLang loaders); the arena: :func:`allocate_targets`, :func:`stream_arena`;
- sharded refit (T trainer, E engine ranks): the global plan :class:`MeshPlan` (:mod:`mxport.refit.mesh`:
  boxes each rank holds or needs, routes per (trainer, engine) pair, :func:`agree`); one pair stream per pair
  and one vote, :class:`ShardedSender` / :class:`ShardedReceiver`, :func:`pair_order`; sharded trainers
  :class:`ShardedTrainerSource` (DTensor models) and :class:`HeldTensorsSource` (named tensors a rank holds),
  engine ranks' :func:`engine_holdings` / :func:`engine_buffers` (:mod:`mxport.refit.shards`).

The modules are described in docs/guide-refit.md.
"""

from .arena import allocate_targets, stream_arena
from .inference import checkpoint_tensors, model_tensors, receiver_plan
from .mesh import Box, Holding, MeshPlan, TensorInfo, agree
from .plan import PlanEntry, RefitPlan, RefitPlanMismatch
from .receiver import RefitReceiver, Staged
from .results import ReceiverResult, RefitError, Status, Vote
from .sender import PendingSend, RefitSender
from .sharded import (
    PairStats,
    ShardedReceiver,
    ShardedReceiveStats,
    ShardedSender,
    ShardedSendStats,
    pair_order,
)
from .shards import HeldTensorsSource, ShardedTrainerSource, engine_buffers, engine_holdings
from .trainer import TrainerSource
from .transport import InProcessChannel, PairTransport, TorchDistTransport, Transport

__all__ = [
    "Box",
    "Holding",
    "MeshPlan",
    "TensorInfo",
    "agree",
    "HeldTensorsSource",
    "InProcessChannel",
    "PairStats",
    "PairTransport",
    "PendingSend",
    "PlanEntry",
    "ReceiverResult",
    "RefitError",
    "RefitPlan",
    "RefitPlanMismatch",
    "RefitReceiver",
    "RefitSender",
    "ShardedTrainerSource",
    "ShardedReceiveStats",
    "ShardedReceiver",
    "ShardedSendStats",
    "ShardedSender",
    "Staged",
    "Status",
    "TorchDistTransport",
    "TrainerSource",
    "Transport",
    "Vote",
    "allocate_targets",
    "checkpoint_tensors",
    "engine_buffers",
    "engine_holdings",
    "model_tensors",
    "pair_order",
    "receiver_plan",
    "stream_arena",
]
