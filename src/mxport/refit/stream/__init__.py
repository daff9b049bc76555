"""A byte stream from one sender to the receivers of its transport: :class:`StreamSender` transmits,
:class:`StreamReceiver` stages, gives its verdict and settles by the vote it is given (it holds none)."""

from .receiver import Staged, StreamReceiver
from .sender import PendingSend, StreamSender

__all__ = ["PendingSend", "Staged", "StreamReceiver", "StreamSender"]
