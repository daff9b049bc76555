"""A byte stream: one sender to the receivers of its transport (every other rank of a group: multicast; or
one rank: a pair stream). :class:`StreamSender` transmits the buckets and the trailer (or an abort);
:class:`StreamReceiver` stages (receive and validate, nothing written), gives its verdict, and settles by the
vote it is given: commit, or roll back (staging, or direct into one arena with a rollback copy). Streams hold
no vote of their own: the coordinator (:class:`~mxport.refit.RefitSender`,
:class:`~mxport.refit.RefitReceiver`) agrees the plan, runs its streams and holds one vote for the world."""

from .receiver import Staged, StreamReceiver
from .sender import PendingSend, StreamSender

__all__ = ["PendingSend", "Staged", "StreamReceiver", "StreamSender"]
