"""RefitPlan: the manifest of one refit, the ordered tensors it moves as one virtual byte stream (checkpoint
name, role, dtype, shape, bytes, ``offset``: a multiple of :data:`ALIGN`) and a digest, built by sender and
receiver independently and compared before any payload moves. The bucket size is the stream's."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, get_args

import torch

#: how a tensor travels: MXFP8 element values, their E8M0 scales, or a tensor kept as it is
Role = Literal["values", "scales", "kept"]
ROLES: tuple[str, ...] = get_args(Role)
#: one plan item: ``(name, role, dtype or dtype name, shape)``
Item = tuple[str, Role, torch.dtype | str, Sequence[int]]
#: every tensor starts at a multiple of this many bytes in the stream (keeps bucket payloads 8-byte aligned)
ALIGN = 16
#: version 2: the manifest only (version 1 also held the bucket size, now the stream's)
PLAN_FORMAT = "mxport-refit-plan/2"


class RefitPlanMismatch(ValueError):
    """Sender and receiver plans differ; nothing was sent. ``differences`` lists the first ones (strings)."""

    def __init__(self, differences: Sequence[str], *, local_digest: str = "", remote_digest: str = ""):
        self.differences = list(differences)
        self.local_digest, self.remote_digest = local_digest, remote_digest
        head = "; ".join(self.differences[:8]) or "digests differ"
        more = f" (+{len(self.differences) - 8} more)" if len(self.differences) > 8 else ""
        super().__init__(f"refit plans differ, nothing was sent: {head}{more}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ValueError for an unknown name."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


#: dtype names a plan received from a peer may name (:meth:`RefitPlan.from_canonical`): what refit moves
WIRE_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "uint8", "int8", "int16", "int32",
                         "int64", "bool", "float16", "bfloat16", "float32", "float64"})
_CANONICAL_KEYS = {"format", "align", "entries"}


def _is_count(x) -> bool:
    """A non-negative int (bool excluded)."""
    return type(x) is int and x >= 0


def _entry_item(i: int, e) -> tuple[str, str, str, tuple[int, ...]]:
    """Validate one canonical entry ``[name, role, dtype, shape, nbytes, offset]`` -> a plan item."""
    if type(e) is not list or len(e) != 6:
        raise ValueError(f"plan entry {i} must be a list of 6 fields, got {type(e).__name__}")
    name, role, dt, shape, *counts = e
    if type(name) is not str or not name:
        raise ValueError(f"plan entry {i}: name must be a non-empty string")
    if role not in ROLES:
        raise ValueError(f"plan entry {i} ({name!r}): role must be one of {ROLES}")
    if type(dt) is not str or dt not in WIRE_DTYPES:
        raise ValueError(f"plan entry {i} ({name!r}): dtype must be one of {sorted(WIRE_DTYPES)}")
    if type(shape) is not list or not all(_is_count(s) for s in shape):
        raise ValueError(f"plan entry {i} ({name!r}): shape must be a list of non-negative ints")
    if not all(_is_count(c) for c in counts):
        raise ValueError(f"plan entry {i} ({name!r}): nbytes and offset must be non-negative ints")
    return name, role, dt, tuple(shape)


@dataclass(frozen=True)
class PlanEntry:
    """One tensor of the refit stream; ``offset``: its first byte in the stream."""

    name: str
    role: Role
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int

    def canonical(self) -> list:
        return [self.name, self.role, self.dtype, list(self.shape), self.nbytes, self.offset]


class RefitPlan:
    """The ordered refit plan, the manifest, from ``items`` ``(name, role, dtype or dtype name, shape)`` in
    stream order. ValueError for an unknown role, a duplicate name or an empty plan; TypeError for a dtype
    that is not a torch dtype (name)."""

    def __init__(self, items: Iterable[Item]):
        entries: list[PlanEntry] = []
        seen: set[str] = set()
        offset = 0
        for name, role, dtype, shape in items:
            if role not in ROLES:
                raise ValueError(f"role of {name!r} must be one of {ROLES}, got {role!r}")
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice in the refit plan")
            seen.add(name)
            if isinstance(dtype, str):
                dtype = dtype_from_name(dtype)
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"dtype of {name!r} must be a torch.dtype, got {type(dtype).__name__}")
            shape = tuple(int(s) for s in shape)
            nbytes = math.prod(shape) * dtype.itemsize
            entries.append(PlanEntry(name, role, dtype_name(dtype), shape, nbytes, offset))
            offset = (offset + nbytes + ALIGN - 1) // ALIGN * ALIGN  # the next entry starts aligned
        if not entries:
            raise ValueError("a refit plan needs at least one tensor")
        self.entries: tuple[PlanEntry, ...] = tuple(entries)
        self.total_bytes = offset
        self._index = {e.name: i for i, e in enumerate(self.entries)}

    @classmethod
    def from_canonical(cls, obj) -> RefitPlan:
        """Rebuild a plan from its :meth:`canonical` form (e.g. a peer's JSON); same digest. ValueError naming
        the first field that is not strictly canonical (keys, format, alignment, non-negative non-bool ints,
        :data:`WIRE_DTYPES`, roles, ``nbytes`` / ``offset`` that follow from the shapes)."""
        if type(obj) is dict and obj.get("format", PLAN_FORMAT) != PLAN_FORMAT:  # another version's plan
            raise ValueError(f"plan format must be {PLAN_FORMAT!r}, got {obj['format']!r}")
        if type(obj) is not dict or set(obj) != _CANONICAL_KEYS:
            raise ValueError(f"a canonical plan is a dict with exactly the keys {sorted(_CANONICAL_KEYS)}")
        if obj["align"] != ALIGN or type(obj["align"]) is not int:
            raise ValueError(f"plan align must be {ALIGN}, got {obj['align']!r}")
        if type(obj["entries"]) is not list:
            raise ValueError("plan entries must be a list")
        plan = cls([_entry_item(i, e) for i, e in enumerate(obj["entries"])])
        for e, given in zip(plan.entries, obj["entries"], strict=True):
            if e.canonical() != given:
                raise ValueError(f"plan entry {e.name!r}: nbytes / offset {given[4:]} do not follow from its "
                                 f"dtype and shape ({[e.nbytes, e.offset]})")
        return plan

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"RefitPlan({len(self)} tensors, {self.total_bytes} bytes, digest {self.digest[:12]})"

    def index(self, name: str) -> int:
        return self._index[name]

    def canonical(self) -> dict:
        """JSON-able canonical form (what the digest covers)."""
        return {"format": PLAN_FORMAT, "align": ALIGN, "entries": [e.canonical() for e in self.entries]}

    @cached_property
    def digest(self) -> str:
        """sha256 (hex) of the canonical JSON (sorted keys, no spaces)."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def nbytes_by_role(self) -> dict[str, int]:
        out = dict.fromkeys(ROLES, 0)
        for e in self.entries:
            out[e.role] += e.nbytes
        return out

    def summary(self) -> dict:
        return {"tensors": len(self), "bytes": self.total_bytes, "digest": self.digest,
                "bytes_by_role": self.nbytes_by_role}

    @cached_property
    def _expected(self) -> list[tuple[torch.dtype, torch.Size]]:
        """Each entry's torch dtype and shape (comparing dtype objects halves :meth:`check_tensor`'s cost)."""
        return [(dtype_from_name(e.dtype), torch.Size(e.shape)) for e in self.entries]

    def check_tensor(self, i: int, t: torch.Tensor) -> None:
        """Per-refit check of tensor ``i``: a ``torch.Tensor`` with data, contiguous, of exactly the planned
        dtype and shape; TypeError (not a tensor) or ValueError (meta, non-contiguous, another dtype / shape)
        naming it."""
        e = self.entries[i]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {e.name!r} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_meta:
            raise ValueError(f"tensor {e.name!r} is on the meta device (it has no data to send)")
        dtype, shape = self._expected[i]
        if t.dtype != dtype or t.shape != shape:
            raise ValueError(f"tensor {e.name!r} is {dtype_name(t.dtype)} {tuple(t.shape)} "
                             f"but the refit plan says {e.dtype} {e.shape}")
        if not t.is_contiguous():
            raise ValueError(f"tensor {e.name!r} must be contiguous to be moved as bytes")


def diff_canonical(local: dict, remote: dict, *, limit: int = 10) -> list[str]:
    """The first differences between two canonical plans (``local`` vs ``remote``), as readable strings:
    ``missing`` (remote only), ``extra`` (local only), ``reordered``, ``shape``, ``dtype``, ``role``."""
    out: list[str] = []
    if local.get("format") != remote.get("format"):
        out.append(f"plan format: local {local.get('format')!r} vs remote {remote.get('format')!r}")
    le = {e[0]: (i, e) for i, e in enumerate(local.get("entries", []))}
    re_ = {e[0]: (i, e) for i, e in enumerate(remote.get("entries", []))}
    for name in re_:
        if name not in le:
            out.append(f"missing: {name!r} (remote has it, local does not)")
    for name in le:
        if name not in re_:
            out.append(f"extra: {name!r} (local has it, remote does not)")
    common_l = [n for n in le if n in re_]
    common_r = [n for n in re_ if n in le]
    for pos, (a, b) in enumerate(zip(common_l, common_r, strict=False)):
        if a != b:
            out.append(f"reordered: position {pos} holds {a!r} locally but {b!r} remotely")
            break
    for name in common_l:
        (_, a), (_, b) = le[name], re_[name]
        if a[1] != b[1]:
            out.append(f"role: {name!r} local {a[1]} vs remote {b[1]}")
        if a[2] != b[2]:
            out.append(f"dtype: {name!r} local {a[2]} vs remote {b[2]}")
        if a[3] != b[3]:
            out.append(f"shape: {name!r} local {tuple(a[3])} vs remote {tuple(b[3])}")
        if len(out) >= limit:
            break
    return out[:limit]
