"""Streaming sharded safetensors writer: the layout is planned from names, dtypes and shapes before any data
exists, so each shard's header is written first and tensors are then streamed in one at a time (peak memory is
one tensor, not one shard).

File layout follows the safetensors format (8-byte little-endian header length, JSON header padded with spaces
to 8 bytes, tensor bytes back to back in header order) and ``transformers``' sharding convention:
``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .readers import INDEX_NAME, st_dtype_name

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(size: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (KB/MB/GB/TB decimal, KiB/MiB/GiB binary, as ``transformers``); ints pass.

    Raises ValueError for anything else or a size < 1.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str) and (m := _SIZE_RE.match(size)) and m.group(2).upper() in _UNITS:
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise ValueError(f"max_shard_size must be a size like '5GB', '500MB' or an int of bytes, "
                         f"got {size!r}")
    if n < 1:
        raise ValueError(f"max_shard_size must be >= 1 byte, got {size!r}")
    return n


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: name, dtype, shape (its byte size follows)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class _Shard:
    specs: list[TensorSpec] = field(default_factory=list)
    nbytes: int = 0


def plan_shards(groups: list[list[TensorSpec]], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split ``groups`` (tensors that stay in one shard together, e.g. values + scale) into shards of at
    most ``max_shard_bytes`` data bytes; a group larger than that gets a shard of its own (as
    ``transformers`` does)."""
    shards: list[_Shard] = [_Shard()]
    for group in groups:
        size = sum(s.nbytes for s in group)
        if shards[-1].specs and shards[-1].nbytes + size > max_shard_bytes:
            shards.append(_Shard())
        shards[-1].specs.extend(group)
        shards[-1].nbytes += size
    return [s.specs for s in shards if s.specs] or [[]]


def shard_file_names(n: int) -> list[str]:
    return (["model.safetensors"] if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])


class ShardedSafetensorsWriter:
    """Write planned tensors into ``out_dir`` in order, streaming.

    Call :meth:`write` once per planned tensor, in the planned order, then :meth:`close` (writes the
    index when there are several shards). ``out_dir`` should be a temporary directory that the
    caller renames into place.

    Raises ValueError when a written tensor is not the next planned one (name, dtype or shape differ) or when
    :meth:`close` is called before every planned tensor was written.
    """

    def __init__(self, out_dir: str | Path, shards: list[list[TensorSpec]], metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        self.shards = shards
        self.files = shard_file_names(len(shards))
        self.metadata = {"format": "pt", **(metadata or {})}
        self._order = [(i, spec) for i, specs in enumerate(shards) for spec in specs]
        self._pos = 0
        self._done = 0  # bytes of the current tensor written so far
        self._fh = None
        self._open_shard = -1
        if not self._order:
            self._start(0)

    def _start(self, i: int) -> None:
        if self._fh is not None:
            self._fh.close()
        header: dict = {"__metadata__": {k: str(v) for k, v in self.metadata.items()}}
        offset = 0
        for spec in self.shards[i]:
            header[spec.name] = {"dtype": st_dtype_name(spec.dtype), "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._fh = open(self.out_dir / self.files[i], "wb")  # noqa: SIM115 - closed in _start / close
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._open_shard = i

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor's bytes (the whole tensor)."""
        spec = self._next(name)
        if tuple(tensor.shape) != spec.shape or self._done:
            raise ValueError(f"write: expected {spec.name!r} {spec.dtype} {list(spec.shape)}, got {name!r} "
                             f"{tensor.dtype} {list(tensor.shape)}")
        self.write_part(name, tensor)

    def write_part(self, name: str, part: torch.Tensor) -> None:
        """Append consecutive rows of the next planned tensor: ``part`` holds whole rows of its ``(M, K)``
        view (same dtype, same last dimension). The tensor is complete once all its bytes arrived."""
        spec = self._next(name)
        k = spec.shape[-1] if spec.shape else 1
        if part.dtype != spec.dtype or (spec.shape and (part.dim() == 0 or part.shape[-1] != k)):
            raise ValueError(f"write: expected rows of {spec.name!r} {spec.dtype} {list(spec.shape)}, "
                             f"got {name!r} {part.dtype} {list(part.shape)}")
        t = part.detach().to("cpu").contiguous().reshape(-1)
        nbytes = t.numel() * t.element_size()
        if self._done + nbytes > spec.nbytes:
            raise ValueError(f"write: {name!r} gets more than its {spec.nbytes} planned bytes")
        i = self._order[self._pos][0]
        if spec.nbytes == 0:  # nothing to stream: the header already describes it
            self._pos += 1
            return
        if i != self._open_shard:
            self._start(i)
        if nbytes:
            self._fh.write(t.view(torch.uint8).numpy().data)
        self._done += nbytes
        if self._done == spec.nbytes:
            self._pos += 1
            self._done = 0

    def _next(self, name: str) -> TensorSpec:
        if self._pos >= len(self._order):
            raise ValueError(f"write({name!r}): every planned tensor was already written")
        spec = self._order[self._pos][1]
        if name != spec.name:
            raise ValueError(f"write: expected {spec.name!r} {spec.dtype} {list(spec.shape)} next, "
                             f"got {name!r}")
        return spec

    def close(self) -> dict[str, str]:
        """Finish the last shard and write ``model.safetensors.index.json`` when sharded.

        Returns the weight map.
        """
        if self._pos != len(self._order):
            raise ValueError(f"close: {len(self._order) - self._pos} planned tensor(s) were not written")
        for i in range(len(self.shards)):  # shards whose tensors were all empty still need their file
            if not (self.out_dir / self.files[i]).exists():
                self._start(i)
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        weight_map = {spec.name: self.files[i] for i, spec in self._order}
        if len(self.shards) > 1:
            total = sum(spec.nbytes for _, spec in self._order)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
