"""Transports: a sender (rank ``src``) and its receivers share an ``all_gather`` of one small tensor per rank
and a (possibly asynchronous) ``broadcast`` of 1-D uint8 from the sender; no Python object, no pickle crosses
the wire."""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


class _Done:
    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - same signature as torch Work.wait
        return True


class Transport(ABC):
    """One endpoint: ``rank`` in ``world_size``, the sender rank ``src``; ``ranks``: for a stream of a larger
    world, the world rank of each of its ranks."""

    rank: int
    world_size: int
    src: int
    ranks: tuple[int, ...] | None = None
    _device = torch.device("cpu")

    @property
    def is_sender(self) -> bool:
        return self.rank == self.src

    @property
    def device(self) -> torch.device:
        """Where this transport's collectives take tensors (CPU unless the backend is NCCL)."""
        return self._device

    @abstractmethod
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t``, indexed by rank, as new CPU tensors."""

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, async_op: bool = False):
        """Send ``buf`` (1-D uint8) from ``src`` into the same-sized ``buf`` of every receiver; with
        ``async_op`` return a handle whose ``wait()`` completes it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (no-op by default)."""


class TorchDistTransport(Transport):
    """``torch.distributed`` collectives on a process group (the default group unless ``group`` is given;
    :meth:`from_group` takes any ``ProcessGroup``, also vLLM's stateless ones, with group-local ranks). gloo
    for CPU tensors, NCCL for CUDA tensors (call ``torch.cuda.set_device`` first). A dead peer or a timeout
    raises ``RuntimeError``; the group must then be re-created."""

    def __init__(self, group=None, src: int = 0):
        if group is None and not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call TorchDistTransport.init(...) first")
        self._dist = dist
        self.group = group
        self._pg = dist.group.WORLD if group is None else group
        self.rank, self.world_size = self._pg.rank(), self._pg.size()
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be a rank in [0, {self.world_size}), got {src}")
        self.src = src
        if (str(self._pg.name()).lower() == "nccl"
                or (dist.is_initialized() and _backend(dist, group) == "nccl")):
            self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def process_group(self):
        """The ``ProcessGroup`` the collectives run on (pair streams share it)."""
        return self._pg

    @classmethod
    def from_group(cls, pg, src: int = 0) -> TorchDistTransport:
        """A transport over an existing process group ``pg`` (``src``: the sender's rank in ``pg``)."""
        return cls(group=pg, src=src)

    @classmethod
    def init(cls, *, rank: int, world_size: int, init_method: str, backend: str = "gloo",
             timeout_s: float = 60.0, src: int = 0) -> TorchDistTransport:
        """Initialize the default process group and return a transport on it.

        Args:
            rank, world_size: this process's rank and the number of processes (1 sender + receivers).
            init_method: ``tcp://127.0.0.1:PORT``, ``file:///path`` or ``env://``.
            backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
            timeout_s: seconds after which a collective waiting on a peer fails.
        """
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 (one sender, at least one receiver), got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                 timeout=datetime.timedelta(seconds=timeout_s))
        return cls(src=src)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.to(self._device).contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._pg.allgather([out], [t]).wait()
        return [x.cpu() for x in out]

    def broadcast(self, buf: torch.Tensor, async_op: bool = False):
        opts = self._dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.src, 0
        work = self._pg.broadcast([buf], opts)
        if async_op:
            return work
        work.wait()
        return None

    def close(self) -> None:
        """Destroy this transport's group (shut down one ``torch.distributed`` does not know), so its threads
        end now; using the transport afterwards raises RuntimeError."""
        group, self.group, self._pg = self.group, None, _ClosedGroup()
        if group is None:
            if self._dist.is_initialized():
                self._dist.destroy_process_group()
            return
        try:
            self._dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # not registered with torch.distributed
            shutdown = getattr(group, "shutdown", None)
            if callable(shutdown):
                shutdown()


class _ClosedGroup:
    """The process group of a closed transport: every use raises RuntimeError."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"this refit transport is closed (its process group was destroyed): cannot "
                           f"{name}; create a new one")


def open_group(host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
               timeout_s: float = 60.0, prefix: str = "mxport-refit"):
    """A new ``ProcessGroup`` of ``world_size`` processes meeting at ``host:port`` (rank 0 serves the TCP
    store), apart from the default group that engines own, for :meth:`TorchDistTransport.from_group`;
    ``backend`` "gloo" or "nccl", ``timeout_s`` for the rendezvous and every collective. ValueError for a bad
    rank / world size / backend; RuntimeError (torch's) when no rendezvous comes in time."""
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 2 and 0 <= rank < world_size, got rank {rank} of {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=True)
    store = dist.PrefixStore(prefix, store)
    pg = _new_group(store, rank, world_size, backend, timeout)
    _GROUP_STORES[pg] = (store, backend, timeout)
    return pg


def _new_group(store, rank: int, size: int, backend: str, timeout: datetime.timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


#: the store, backend and timeout of each group :func:`open_group` made (its subgroups meet on that store)
_GROUP_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: subgroups made so far per (group, ranks): every member makes them in the same order, so the count names
#: the rendezvous of the next one alike on every member
_SUBGROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def subgroup(pg, ranks):
    """A process group of the ranks ``ranks`` of ``pg`` (group-local, this process among them, ``ranks[0]``
    its rank 0): a multicast stream's group, met on the store of a group :func:`open_group` made or of the
    default group (TypeError for another). Collective over ``ranks``, each calling it in the same order as its
    other subgroups of ``pg``; ValueError when this process is not one of them or a rank repeats."""
    ranks = [int(r) for r in ranks]
    me = pg.rank()
    if me not in ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"subgroup: rank {me} must be one of {ranks}, each rank once")
    store, backend, timeout = _store_of(pg)
    made = _SUBGROUPS.setdefault(pg, {})
    key = tuple(ranks)
    made[key] = n = made.get(key, 0) + 1
    prefix = f"mxport-sub{n}-" + "-".join(map(str, ranks))
    return _new_group(dist.PrefixStore(prefix, store), ranks.index(me), len(ranks), backend, timeout)


def _store_of(pg) -> tuple:
    """``(store, backend, timeout)`` of an :func:`open_group` group or of the default group, else
    TypeError."""
    if pg in _GROUP_STORES:
        return _GROUP_STORES[pg]
    if dist.is_initialized() and pg is dist.group.WORLD:
        backend = dist.get_backend()
        device = torch.device("cuda" if backend == "nccl" else "cpu")
        return c10d._get_default_store(), backend, pg._get_backend(device).options._timeout
    raise TypeError("a multicast stream needs a group made by mxport.refit.transport.open_group, or "
                    "torch.distributed's default group (its subgroups meet on that group's store)")


#: the default tag of a :class:`PairTransport`'s messages ("MX")
PAIR_TAG = 0x4D58


class PairTransport(Transport):
    """A transport between two ranks of an existing process group (a pair stream of a sharded refit): ``send``
    / ``recv`` with group-local ranks, local rank 0 the ``sender``, 1 the ``receiver`` (this process is one of
    them). ``broadcast`` sends into the peer's same-sized ``buf``; ``all_gather`` posts a send and a recv.
    Messages of one (peer, ``tag`` below 2**31) arrive in order, so streams with different tags never mix. A
    dead peer or a timeout raises ``RuntimeError``. ``pg`` None: the default group; ``close`` leaves it to its
    owner."""

    def __init__(self, pg, sender: int, receiver: int, *, tag: int = PAIR_TAG):
        if pg is None:
            if not dist.is_initialized():
                raise ValueError("pg is None and torch.distributed is not initialized")
            pg = dist.group.WORLD
        me, size = pg.rank(), pg.size()
        if sender == receiver or not (0 <= sender < size and 0 <= receiver < size):
            raise ValueError(f"sender and receiver must be two different ranks in [0, {size}), got {sender} "
                             f"and {receiver}")
        if me not in (sender, receiver):
            raise ValueError(f"rank {me} is neither the sender ({sender}) nor the receiver ({receiver})")
        if not 0 <= tag < 2**31:
            raise ValueError(f"tag must be in [0, 2**31), got {tag}")
        self._pg, self.tag = pg, int(tag)
        self.rank, self.world_size, self.src = (0 if me == sender else 1), 2, 0
        self.ranks = (sender, receiver)
        self._peer = receiver if me == sender else sender
        if str(pg.name()).lower() == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        mine = t.to(self._device).contiguous()
        theirs = torch.empty_like(mine)
        works = [self._pg.send([mine], self._peer, self.tag), self._pg.recv([theirs], self._peer, self.tag)]
        for w in works:
            w.wait()
        out = [mine, theirs] if self.rank == 0 else [theirs, mine]
        return [x.cpu().clone() for x in out]

    def broadcast(self, buf: torch.Tensor, async_op: bool = False):
        if self.is_sender:
            work = self._pg.send([buf], self._peer, self.tag)
        else:
            work = self._pg.recv([buf], self._peer, self.tag)
        if async_op:
            return work
        work.wait()
        return None


def _backend(dist, group) -> str:
    try:
        return str(dist.get_backend(group)).lower()
    except (ValueError, RuntimeError):  # a group torch.distributed does not know
        return ""


class InProcessChannel:
    """A colocated sender and ``receivers`` receivers in one process, each endpoint on its own thread.
    ``endpoint(0)`` is the sender. A broadcast hands each receiver a copy of the bytes; a receiver waiting
    longer than ``timeout_s`` raises ``TimeoutError``."""

    def __init__(self, receivers: int = 1, timeout_s: float = 60.0):
        if receivers < 1:
            raise ValueError(f"receivers must be >= 1, got {receivers}")
        self.world_size = receivers + 1
        self.timeout_s = timeout_s
        self._queues = [queue.Queue() for _ in range(self.world_size)]
        self._barrier = threading.Barrier(self.world_size, timeout=timeout_s)
        self._gather: list[torch.Tensor | None] = [None] * self.world_size
        self._lock = threading.Lock()

    def endpoint(self, rank: int) -> InProcessTransport:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return InProcessTransport(self, rank)


class _InProcessRecv:
    def __init__(self, ep: InProcessTransport, buf: torch.Tensor):
        self.ep, self.buf, self.done = ep, buf, False

    def wait(self, timeout=None) -> bool:  # noqa: ARG002
        if not self.done:
            ch = self.ep.channel
            try:
                data = ch._queues[self.ep.rank].get(timeout=ch.timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"in-process refit: no bucket from the sender within {ch.timeout_s} s") from None
            if data.numel() != self.buf.numel():
                raise RuntimeError(f"in-process refit: got {data.numel()} bytes, expected {self.buf.numel()}")
            self.buf.copy_(data)
            self.done = True
        return True


class InProcessTransport(Transport):
    """An endpoint of an :class:`InProcessChannel`."""

    def __init__(self, channel: InProcessChannel, rank: int):
        self.channel, self.rank, self.world_size, self.src = channel, rank, channel.world_size, 0

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        ch = self.channel
        with ch._lock:
            ch._gather[self.rank] = t.detach().cpu().clone()
        ch._barrier.wait()
        out = [x.clone() for x in ch._gather]
        ch._barrier.wait()
        if any(x.dtype != t.dtype or x.shape != t.shape for x in out):
            raise RuntimeError("in-process all_gather: the ranks passed tensors of different dtypes or "
                               "shapes")
        return out

    def broadcast(self, buf: torch.Tensor, async_op: bool = False):
        if self.is_sender:
            data = buf.clone()
            for r in range(self.world_size):
                if r != self.rank:
                    self.channel._queues[r].put(data)
            return _Done() if async_op else None
        h = _InProcessRecv(self, buf)
        if async_op:
            return h
        h.wait()
        return None
