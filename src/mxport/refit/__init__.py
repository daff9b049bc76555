"""Refit: move a trainer's MXFP8 weights into a running inference model after every step — planned, bucketed,
checked, in place, all or nothing.

:class:`RefitSender` / :class:`RefitReceiver` are the coordinators, one per side for every layout:
``RefitSender(transport, plan)`` (one trainer, R engine ranks) or ``RefitSender.from_mesh(world, mesh)`` (T
trainer, E engine ranks, the :class:`MeshPlan` from :func:`agree`). What a trainer rank holds:
:class:`TrainerSource`, :class:`ShardedTrainerSource`, :class:`HeldTensorsSource`; what an engine rank needs:
:func:`receiver_plan`, :func:`checkpoint_tensors`, :func:`engine_holdings`, :func:`engine_buffers`. The
modules are described in docs/guide-refit.md.
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
