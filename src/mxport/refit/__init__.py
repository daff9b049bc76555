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
- sharded refit (T trainer ranks, E engine ranks, one pair stream per pair, one vote):
  :class:`ShardedSender` / :class:`ShardedReceiver`, :func:`pair_order`;
- the trainer side: :class:`TrainerSource` (policy + quantize); the inference side: :func:`receiver_plan` (an
  ``MXFP8Linear`` model's live buffers), :func:`checkpoint_tensors` (``(hf_name, tensor)`` pairs for vLLM /
  SGLang loaders); the arena: :func:`allocate_targets`, :func:`stream_arena`.

The modules are described in docs/guide-refit.md.
"""

from .arena import allocate_targets, stream_arena
from .inference import checkpoint_tensors, model_tensors, receiver_plan
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
from .trainer import TrainerSource
from .transport import InProcessChannel, PairTransport, TorchDistTransport, Transport

__all__ = [
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
    "model_tensors",
    "pair_order",
    "receiver_plan",
    "stream_arena",
]
