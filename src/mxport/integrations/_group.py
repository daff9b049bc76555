"""A refit transport over a process group that is not torch.distributed's default group.

Inference engines already own the default group (vLLM's workers, SGLang's schedulers), so the trainer <-> engine
link is a *separate* group built from a TCP store: :func:`open_group` (gloo on CPU, NCCL on GPU) and
:class:`GroupTransport` over it (``GroupTransport.from_group(pg)`` wraps any existing ``ProcessGroup``). The
group object is used directly (``pg.broadcast`` / ``pg.allgather``), so it works for groups that
``torch.distributed`` does not know about (vLLM's ``stateless_init_torch_distributed_process_group`` makes such
groups too). The handshake's small objects travel as length-prefixed JSON, never pickle.

Meant to move to ``mxport.refit`` (``TorchDistTransport.from_group``); kept here until then.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from ..refit import Transport

#: largest JSON object accepted from a peer in the handshake
MAX_OBJECT_BYTES = 64 << 20


def open_group(host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
               timeout_s: float = 60.0, prefix: str = "mxport-refit"):
    """A new ``ProcessGroup`` of ``world_size`` processes meeting at ``host:port`` (rank 0 serves the TCP store).

    Args:
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors, on the current CUDA device).
        timeout_s: the store rendezvous and every collective fail after this many seconds without a peer.
    Raises:
        ValueError: a bad rank / world size / backend. RuntimeError (from torch): no rendezvous in time.
    """
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 2 and 0 <= rank < world_size, got rank {rank} of {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=True)
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return pg


class GroupTransport(Transport):
    """A :class:`~mxport.refit.Transport` on an existing ``ProcessGroup`` (rank and size read from it)."""

    def __init__(self, pg, src: int = 0):
        self.pg = pg
        self.rank, self.world_size = pg.rank(), pg.size()
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be a rank in [0, {self.world_size}), got {src}")
        self.src = src

    @classmethod
    def from_group(cls, pg, src: int = 0) -> GroupTransport:
        return cls(pg, src)

    def broadcast(self, buf: torch.Tensor, async_op: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.src, 0
        work = self.pg.broadcast([buf], opts)
        if async_op:
            return work
        work.wait()
        return None

    def _allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([out], [t]).wait()
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-able: tuples come back as lists), as JSON bytes over the group."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        if len(data) > MAX_OBJECT_BYTES:
            raise ValueError(f"handshake object of {len(data)} bytes exceeds {MAX_OBJECT_BYTES}")
        dev = "cuda" if self.pg.name() == "nccl" else "cpu"
        sizes = [int(s) for s in self._allgather(torch.tensor([len(data)], dtype=torch.int64, device=dev))]
        if max(sizes) > MAX_OBJECT_BYTES or min(sizes) < 0:
            raise ValueError(f"a peer announced a handshake object of {max(sizes)} bytes")
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        return [json.loads(bytes(t[:n].cpu().numpy())) for t, n in zip(self._allgather(buf), sizes, strict=True)]

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
