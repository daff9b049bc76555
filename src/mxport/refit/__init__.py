"""Refit: move a trainer's MXFP8 weights into a running inference model after every step — planned, bucketed,
checked, in place, all or nothing. The coordinators :class:`RefitSender` / :class:`RefitReceiver` serve every
layout: one trainer rank (``RefitSender(transport, plan)``) or T trainer ranks (``RefitSender.from_mesh``, the
:class:`MeshPlan` from :func:`agree`). The modules are described in docs/guide-refit.md."""

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
