"""Refit: move a trainer's MXFP8 weights into a running inference model after every step — planned, bucketed,
checked, in place, all or nothing.

- :class:`RefitPlan` (ordered tensors, bytes, buckets, digest) and :class:`RefitPlanMismatch`;
- :class:`RefitSender` / :class:`RefitReceiver` (fixed-size byte buckets, overlapped packing, per-bucket checksums,
  stable pointers, a version counter; staging then ``copy_`` commit, or direct receive into an arena from
  :func:`allocate_targets` with a rollback copy) and :class:`RefitError`;
- transports: :class:`TorchDistTransport` (gloo / NCCL broadcast), :class:`InProcessChannel` (colocated);
- consumers: :class:`TrainerSource` (policy + quantize), :func:`receiver_plan` (an ``MXFP8Linear`` model's live
  buffers), :func:`checkpoint_tensors` (``(hf_name, tensor)`` pairs for vLLM / SGLang loaders).
"""

from .consumers import TrainerSource, allocate_targets, checkpoint_tensors, model_tensors, receiver_plan
from .plan import PlanEntry, RefitPlan, RefitPlanMismatch
from .receiver import RefitReceiver
from .results import ReceiverResult, RefitError, Status
from .sender import RefitSender
from .transport import InProcessChannel, TorchDistTransport, Transport

__all__ = [
    "InProcessChannel",
    "PlanEntry",
    "ReceiverResult",
    "RefitError",
    "RefitPlan",
    "RefitPlanMismatch",
    "RefitReceiver",
    "RefitSender",
    "Status",
    "TorchDistTransport",
    "TrainerSource",
    "Transport",
    "allocate_targets",
    "checkpoint_tensors",
    "model_tensors",
    "receiver_plan",
]
