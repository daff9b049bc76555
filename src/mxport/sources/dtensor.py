"""Sharded trainer weights (PyTorch ``DTensor``: FSDP2 ``fully_shard``, tensor parallel
``parallelize_module``) -> the MXFP8 bytes of each rank's own slice, identical to quantizing the full tensor
and slicing.

MXFP8 blocks run along the last dimension K (32 elements; 32x32 with ``block_2d``). A rank can quantize its
local shard alone exactly when no block straddles two shards:

- shards of a dimension other than K (FSDP2's ``Shard(0)``, ``ColwiseParallel``): always, since blocks never
  cross rows; with ``block_2d`` only when every shard starts on a multiple of 32 rows of the 2-D ``(M, K)``
  view and ends on one or at the tensor's end;
- shards of K (``RowwiseParallel``'s ``Shard(1)``, ``Shard(0)`` of a 1-D tensor): when every shard starts on a
  multiple of 32 and ends on a multiple of 32 or at K;
- ``Replicate``: always.

Otherwise the offending mesh dimensions are all-gathered first (``DTensor.redistribute`` to ``Replicate``),
the gathered tensor is quantized and the rank's slice cut out of it. The decision is a pure function of the
global shape, the mesh shape and the placements (never of this rank's coordinate), so every rank of a
collective takes the same branch. ``Partial`` placements (pending reductions) are refused.

Shard offsets come from ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``, the pure
form (explicit mesh coordinate) of ``compute_local_shape_and_global_offset``, which torch's distributed
checkpoint uses; torch 2.13 has no public function for a shard's global offset. It applies torch.chunk
semantics (uneven shards, empty last shards) and ``_StridedShard`` (FSDP2 over tensor parallel). The local
shape it gives is checked against ``to_local()`` on every call.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..components import MXFP8Components
from ..formats import BLOCK_SIZE, ceil_div, e8m0_to_float
from ..quantize import quantize


def _dtensor_api():
    """(Partial, Replicate, shard types, torch's pure local-shape-and-offset function)."""
    try:
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    except ImportError as exc:  # pragma: no cover - torch without DTensor
        raise ImportError(
            f"mxport.sources.dtensor needs torch.distributed.tensor (torch >= 2.4): {exc}") from exc
    try:  # FSDP2 over tensor parallel; not a Shard subclass (and is_shard() is False) in torch 2.13
        from torch.distributed.tensor.placement_types import _StridedShard
        shards = (Shard, _StridedShard)
    except ImportError:  # pragma: no cover
        shards = (Shard,)
    return Partial, Replicate, shards, _compute_local_shape_and_global_offset


def _shard_dim(p) -> int | None:
    """The tensor dimension a ``Shard`` / ``_StridedShard`` placement splits; None for ``Replicate``."""
    return p.dim if isinstance(p, _dtensor_api()[2]) else None


def is_dtensor(obj) -> bool:
    """True for a ``DTensor`` (including an ``nn.Parameter`` holding one, as FSDP2 makes)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, DTensor)


@dataclass(frozen=True)
class LocalMXFP8:
    """The MXFP8 bytes of exactly the slice of a (possibly sharded) tensor that this rank holds.

    ``data`` has the local shard's shape; ``scale_inv`` holds the compact rowwise scales of every block that
    overlaps the slice. Both equal ``quantize(full)`` cut with :meth:`values_index` / :meth:`scales_index`.
    When the slice starts mid-block along K (a gathered K shard), ``scale_inv`` can hold one block more than
    ``ceil(k_local / 32)``: :meth:`components` refuses that case, :meth:`dequantize` handles it.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    global_shape: tuple[int, ...]
    #: index of the local slice in the full tensor, per dimension (torch's offset: an empty shard sits at the
    #: dimension's size)
    global_offset: tuple[int, ...]
    #: the placements, one per mesh dimension, as ``repr(placement)`` (empty for a plain tensor)
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    #: True when this rank all-gathered before quantizing (a block would straddle shards)
    gathered: bool
    #: the mesh dimensions gathered (empty when ``gathered`` is False)
    gathered_mesh_dims: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def block_aligned(self) -> bool:
        """True when the slice's blocks along K are whole blocks of the full tensor (then :meth:`components`
        is an ordinary MXFP8 tensor of the slice)."""
        off, k, size = self.global_offset[-1], self.shape[-1], self.global_shape[-1]
        return k == 0 or (off % BLOCK_SIZE == 0 and ((off + k) % BLOCK_SIZE == 0 or off + k == size))

    def values_index(self) -> tuple[slice, ...]:
        """Where ``data`` sits in the full tensor's values: ``full_values[values_index()] == data``."""
        return _value_box(self.global_offset, self.shape)

    def scales_index(self) -> tuple[slice, ...]:
        """Where ``scale_inv`` sits in the full tensor's compact scales (along K: the blocks overlapping the
        slice, ``[offset // 32, ceil((offset + k_local) / 32))``)."""
        return _scale_box(self.global_offset, self.shape)

    def components(self) -> MXFP8Components:
        """The slice as :class:`~mxport.MXFP8Components` (rowwise).

        Raises:
            ValueError: the slice starts or ends mid-block along K (see :attr:`block_aligned`).
        """
        if not self.block_aligned:
            off = self.global_offset[-1]
            raise ValueError(
                f"the local slice [{off}, {off + self.shape[-1]}) of K = {self.global_shape[-1]} cuts blocks "
                f"of {BLOCK_SIZE}: its scales are not an MXFP8 tensor of its own (use dequantize(), or "
                "shard K on multiples of 32)"
            )
        return MXFP8Components(self.data, self.scale_inv, "rowwise")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The slice's values decoded (FP32 math), equal to the full tensor's dequantized values there."""
        k = self.shape[-1]
        block = (self.global_offset[-1] % BLOCK_SIZE + torch.arange(k, device=self.data.device)) // BLOCK_SIZE
        scale = e8m0_to_float(self.scale_inv.index_select(-1, block) if k else self.scale_inv[..., :0])
        return (self.data.float() * scale).to(dtype)

    def to_dict(self) -> dict:
        return {
            "element": "e4m3" if self.data.dtype == torch.float8_e4m3fn else "e5m2",
            "block_size": BLOCK_SIZE,
            "global_shape": list(self.global_shape),
            "global_offset": list(self.global_offset),
            "local_shape": list(self.shape),
            "scale_shape": list(self.scale_inv.shape),
            "block_aligned": self.block_aligned,
            "placements": list(self.placements),
            "mesh_shape": list(self.mesh_shape),
            "gathered": self.gathered,
            "gathered_mesh_dims": list(self.gathered_mesh_dims),
        }


def _value_box(offset: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _scale_box(offset: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    """The compact-scale slice of a value box: rows as the values; along K the blocks overlapping it."""
    k_off, k = offset[-1], shape[-1]
    first = k_off // BLOCK_SIZE
    last = ceil_div(k_off + k, BLOCK_SIZE) if k else first
    return (*_value_box(offset[:-1], shape[:-1]), slice(first, last))


def _check_placements(placements, argname: str) -> None:
    Partial, Replicate, shards, _ = _dtensor_api()
    for i, p in enumerate(placements):
        if isinstance(p, Partial) or p.is_partial():
            raise ValueError(
                f"{argname} has a Partial placement on mesh dimension {i} ({p}): its local tensors are "
                "pending a reduction, not slices of the weight; reduce it first "
                "(e.g. dt.redistribute(mesh, [Replicate()]))"
            )
        if not isinstance(p, (*shards, Replicate)):
            raise ValueError(f"{argname} has an unsupported placement on mesh dimension {i}: {p}")


def _slices_along(dim: int, global_shape, mesh_shape, placements) -> list[tuple[int, int]]:
    """``(offset, size)`` along tensor dimension ``dim`` of every rank's shard, over the mesh dimensions that
    shard ``dim`` (the other mesh coordinates do not move it)."""
    local_shape_and_offset = _dtensor_api()[3]
    mesh_dims = [i for i, p in enumerate(placements) if _shard_dim(p) == dim]
    out = []
    for coords in itertools.product(*(range(mesh_shape[i]) for i in mesh_dims)):
        coord = [0] * len(mesh_shape)
        for i, c in zip(mesh_dims, coords, strict=True):
            coord[i] = c
        shape, offset = local_shape_and_offset(global_shape, mesh_shape, coord, placements)
        out.append((int(offset[dim]), int(shape[dim])))
    return out


def _check_contiguous(dim: int, slices: list[tuple[int, int]], size: int, argname: str) -> None:
    """Shards whose ``[offset, offset + size)`` ranges tile ``[0, size)`` are each exactly that range (they
    partition the dimension, and each range is as long as its shard)."""
    end = 0
    for off, n in sorted(s for s in slices if s[1]):
        if off != end:
            break
        end = off + n
    else:
        if end == size:
            return
    raise ValueError(
        f"{argname}: the shards of dimension {dim} are not contiguous ranges of the full tensor ({slices}); "
        "quantize_local supports Shard / _StridedShard layouts whose shards are ranges "
        "(FSDP2, tensor parallel)"
    )


def _aligned(slices: list[tuple[int, int]], size: int, unit: int) -> bool:
    """Every non-empty shard starts on a multiple of ``unit`` and ends on one or at ``size``."""
    return all(n == 0 or (off % unit == 0 and ((off + n) % unit == 0 or off + n == size))
               for off, n in slices)


def _dim_is_local(dim: int, slices, global_shape, block_2d: bool) -> bool:
    """Whether blocks stay inside the shards of tensor dimension ``dim``."""
    last = len(global_shape) - 1
    if dim == last:
        return _aligned(slices, global_shape[dim], BLOCK_SIZE)
    if not block_2d:
        return True  # rowwise blocks never cross rows
    if math.prod(global_shape[:dim]) != 1:
        return False  # the shard's rows are not one range of the (M, K) view: 32-row groups would mix
    inner = math.prod(global_shape[dim + 1:last])
    rows = [(off * inner, n * inner) for off, n in slices]
    return _aligned(rows, math.prod(global_shape[:last]), BLOCK_SIZE)


def gather_dims(global_shape: Sequence[int], mesh_shape: Sequence[int], placements, *,
                block_2d: bool = False) -> tuple[int, ...]:
    """The mesh dimensions :func:`quantize_local` all-gathers for a tensor of ``global_shape`` placed with
    ``placements`` on a mesh of ``mesh_shape``: those sharding a tensor dimension whose shards a block would
    straddle (empty: every rank quantizes its own shard). A pure function: the same answer on every rank.

    Raises:
        ValueError: a ``Partial`` or unknown placement; not one placement per mesh dimension; shards that
            are not ranges of the full tensor.
    """
    global_shape, mesh_shape, placements = tuple(global_shape), tuple(mesh_shape), tuple(placements)
    if len(placements) != len(mesh_shape):
        raise ValueError(f"placements must have one entry per mesh dimension ({len(mesh_shape)}), "
                         f"got {len(placements)}")
    _check_placements(placements, "placements")
    placements = tuple(normalized_placement(p, len(global_shape)) for p in placements)
    out: set[int] = set()
    for dim in sorted({_shard_dim(p) for p in placements} - {None}):
        if not 0 <= dim < len(global_shape):
            raise ValueError(f"placements shard dimension {dim} of a {len(global_shape)}-d tensor")
        placements_d = [p if _shard_dim(p) == dim else _replicate() for p in placements]
        slices = _slices_along(dim, global_shape, mesh_shape, placements_d)
        _check_contiguous(dim, slices, global_shape[dim], "placements")
        if not _dim_is_local(dim, slices, global_shape, block_2d):
            out.update(i for i, p in enumerate(placements) if _shard_dim(p) == dim)
    return tuple(sorted(out))


def _replicate():
    return _dtensor_api()[1]()


def normalized_placement(p, ndim: int):
    """``Shard(-1)`` -> ``Shard(ndim - 1)``; other placements as they are (DTensor stores them normalized)."""
    shard = _dtensor_api()[2][0]
    return shard(p.dim % ndim) if type(p) is shard and p.dim < 0 else p


def _check_float(t: torch.Tensor, argname: str) -> None:
    if not t.dtype.is_floating_point or t.dtype.itemsize == 1:
        raise TypeError(f"{argname} must be a float32/bfloat16/float16 tensor, got {t.dtype}")
    if t.dim() == 0:
        raise ValueError(
            f"{argname} must have at least one dimension (blocks run along the last one), got a 0-d tensor")


def local_and_offset(dt, placements) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's local tensor and its global offset, checked against torch's own local shape."""
    *_, local_shape_and_offset = _dtensor_api()
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("dt: this rank is not part of the DTensor's device mesh")
    shape, offset = local_shape_and_offset(tuple(dt.shape), tuple(mesh.shape), list(coord), placements)
    local = dt.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(
            f"dt: local shard of shape {tuple(local.shape)} where its placements {tuple(placements)} give "
            f"{tuple(shape)}; refusing to guess where it sits in the full tensor"
        )
    return local, tuple(int(o) for o in offset)


def quantize_local(dt: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, rounding: str = "rceil",
                   block_2d: bool = False, kernel: str | None = None) -> LocalMXFP8:
    """Quantize this rank's slice of a (possibly sharded) weight to MXFP8, rowwise, byte-identical to
    ``quantize(dt.full_tensor())`` cut as the rank holds it.

    Args:
        dt: a ``DTensor`` (or an ``nn.Parameter`` holding one: FSDP2, ``parallelize_module``) or a plain
            tensor (quantized whole: offset zeros, ``gathered`` False). float32 / bfloat16 / float16, at
            least 1-D.
        fp8_dtype, rounding, block_2d, kernel: as for :func:`mxport.quantize` (every kernel gives the same
            bytes).

    Where blocks stay inside the shards (see :func:`gather_dims`) the rank quantizes its local shard with no
    communication. Otherwise it all-gathers the offending mesh dimensions (a collective: every rank of the
    mesh must call ``quantize_local`` for this tensor, in the same order), quantizes the gathered tensor and
    slices.

    Returns:
        :class:`LocalMXFP8`.

    Raises:
        TypeError: ``dt`` not a tensor, or not a float tensor (integer, bool, FP8).
        ValueError: 0-d ``dt``; a ``Partial`` placement; shards that are not ranges of the full tensor; bad
            ``fp8_dtype`` / ``rounding`` (from :func:`mxport.quantize`).
    """
    if not isinstance(dt, torch.Tensor):
        raise TypeError(f"dt must be a torch.Tensor or DTensor, got {type(dt).__name__}")
    _check_float(dt, "dt")
    with torch.no_grad():
        if not is_dtensor(dt):
            c = quantize(dt.detach(), fp8_dtype, rounding=rounding, block_2d=block_2d, kernel=kernel)
            shape = tuple(dt.shape)
            return LocalMXFP8(c.data, c.scale_inv, shape, (0,) * len(shape), (), (), False)
        return _quantize_dtensor(dt.detach(), fp8_dtype, rounding, block_2d, kernel)


def _quantize_dtensor(dt, fp8_dtype, rounding: str, block_2d: bool, kernel: str | None = None) -> LocalMXFP8:
    mesh = dt.device_mesh
    placements = tuple(normalized_placement(p, dt.dim()) for p in dt.placements)
    _check_placements(placements, "dt")
    gathered = gather_dims(tuple(dt.shape), tuple(mesh.shape), placements, block_2d=block_2d)
    local, offset = local_and_offset(dt, placements)
    kw = {"rounding": rounding, "block_2d": block_2d, "kernel": kernel}
    if not gathered:
        c = quantize(local, fp8_dtype, **kw)
        data, scale_inv = c.data, c.scale_inv
    else:
        wide = tuple(_replicate() if i in gathered else p for i, p in enumerate(placements))
        g_local, g_offset = local_and_offset(dt.redistribute(mesh, wide), wide)
        full = quantize(g_local, fp8_dtype, **kw)
        # along K, g_offset is 0 (K gathered) or block-aligned (K shards are whole blocks)
        rel = tuple(o - g for o, g in zip(offset, g_offset, strict=True))
        data = full.data[_value_box(rel, local.shape)].contiguous()
        scale_inv = full.scale_inv[_scale_box(rel, local.shape)].contiguous()
    return LocalMXFP8(data, scale_inv, tuple(dt.shape), offset, tuple(repr(p) for p in dt.placements),
                      tuple(mesh.shape), bool(gathered), gathered)


__all__ = ["LocalMXFP8", "gather_dims", "is_dtensor", "local_and_offset", "normalized_placement",
           "quantize_local"]
