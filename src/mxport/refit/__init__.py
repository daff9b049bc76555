"""Refit: move a trainer's MXFP8 weights into a running inference model after every step — planned, bucketed,
checked, in place, all or nothing.

- :class:`RefitPlan` (the manifest: ordered tensors, bytes, digest) and :class:`RefitPlanMismatch`;
- :class:`RefitSender` / :class:`RefitReceiver`, one coordinator per side for every layout: they agree the
  plan and the version, run this rank's byte streams (:mod:`mxport.refit.stream`: fixed-size buckets,
  overlapped packing, per-bucket checksums, staging or direct receive into an arena from
  :func:`allocate_targets` with a rollback copy), hold ONE vote for the whole world and settle every stream by
  it. ``RefitSender(transport, plan)`` is a world of one multicast stream (one trainer, R engine ranks);
  ``RefitSender.from_mesh(world, mesh)`` one rank of a sharded refit (T trainer, E engine
  ranks, one pair stream per route of the global plan :class:`MeshPlan`, agreed with :func:`agree`;
  :class:`Box` / :class:`Holding`); :class:`RefitError` and each receiver's :class:`ReceiverResult` /
  :class:`Status`;
- transports: :class:`Transport` (what a refit needs of one), :class:`TorchDistTransport` (gloo / NCCL),
  :class:`InProcessChannel` (colocated);
- what a trainer rank holds (:mod:`mxport.refit.trainer`): :class:`TrainerSource` (a whole model),
  :class:`ShardedTrainerSource` (DTensor models), :class:`HeldTensorsSource` (named tensors a rank holds);
  what an engine rank needs (:mod:`mxport.refit.engine`): :func:`receiver_plan` (an ``MXFP8Linear`` model's
  live buffers), :func:`checkpoint_tensors` (``(hf_name, tensor)`` pairs for vLLM / SGLang loaders),
  :func:`engine_holdings` / :func:`engine_buffers` (one rank of a TP / EP engine).

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
