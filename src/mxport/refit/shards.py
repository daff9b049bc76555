"""Where a sharded refit's holdings and local bytes come from, on both sides (:mod:`mxport.refit.mesh`).

Trainer side (what each trainer rank holds, and the MXFP8 bytes of it after every optimizer step):

* :class:`ShardedTrainerSource`: a model whose parameters are ``DTensor`` s (FSDP2 ``fully_shard``, tensor
  parallel ``parallelize_module``) or plain tensors (held whole). Its plan tensors are exactly those of
  :class:`~mxport.refit.TrainerSource` on the same model unsharded (it builds one: a ``DTensor`` reports its
  full shape), and the bytes of each rank's box are those of quantizing the full tensor, cut with the box
  (:func:`mxport.sources.quantize_local`);
* :class:`HeldTensorsSource`: ``(hf_name, tensor)`` items of the tensors a rank holds whole (pipeline stages,
  Megatron-Bridge ``export_hf_weights``, verl's per-tensor generators) or ``(hf_name, tensor, dim, start,
  full_size)`` items of a range of one dimension (expert-parallel slices of fused 3-D experts).

Engine side (what each engine rank needs, and where it lands):

* :func:`engine_holdings`: the box of every tensor of a :func:`mxport.nn.quantize_model` 'd inference model
  that one rank of a vLLM-style TP / EP engine holds (:func:`mxport.layout.engine_shard`);
* :func:`engine_buffers`: that rank's own zero-filled tensors, q/k/v (gate/up) of one layer as row views of
  one merged ``qkv_proj`` (``gate_up_proj``) buffer, as vLLM's merged column-parallel layers hold them.

Scales follow their values: a box of rows of the values holds the same rows of the compact rowwise scales,
all their blocks; a range ``[k0, k1)`` of K holds the blocks ``[k0 // 32, ceil(k1 / 32))``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..components import compact_scale_shape
from ..formats import BLOCK_SIZE, ceil_div
from ..layout import Layout, attention_problem, engine_shard
from .items import model_tensors, tensor_items
from .mesh import Box, Holding, TensorInfo
from .plan import dtype_from_name
from .trainer import TrainerSource, kept_wire_dtype

__all__ = ["HeldTensorsSource", "ShardedTrainerSource", "engine_boxes", "engine_buffers", "engine_holdings",
           "scales_box"]

#: bucket size of the (global) plans built here only to read their entries; no bytes move by them
_PLAN_BUCKET = 1 << 20

#: a rank's bytes by tensor name: ``(box, tensor)``, or a list of them for a tensor it holds several boxes of
Local = dict[str, tuple[Box, torch.Tensor] | list[tuple[Box, torch.Tensor]]]


def scales_box(values: Box, shape: Sequence[int], *, name: str = "", whole_blocks: bool = False) -> Box:
    """The box of the compact rowwise scales that goes with the box ``values`` of a tensor of full ``shape``:
    the same rows; along K every block that overlaps ``values``' K range.

    With ``whole_blocks`` the K range must start on a block boundary and end on one or at K (else a block
    would be split between two holders): ValueError naming ``name`` otherwise."""
    k0, k1, k = values.start[-1], values.stop[-1], int(shape[-1])
    if whole_blocks and k1 > k0 and (k0 % BLOCK_SIZE or (k1 % BLOCK_SIZE and k1 != k)):
        raise ValueError(f"{name}: the K range [{k0}, {k1}) of K = {k} cuts MXFP8 blocks of {BLOCK_SIZE} "
                         "(a K split must be a multiple of 32)")
    first = k0 // BLOCK_SIZE
    last = ceil_div(k1, BLOCK_SIZE) if k1 > k0 else first
    return Box((*values.start[:-1], first), (*values.stop[:-1], last))


def _infos(items) -> list[TensorInfo]:
    """Plan items ``(name, role, dtype, shape)`` (torch dtypes or names) as :class:`TensorInfo` s."""
    out = []
    for name, role, dtype, shape in items:
        out.append(TensorInfo(name, role, str(dtype).removeprefix("torch."), tuple(int(s) for s in shape)))
    return out


# -- trainer side: DTensor models ---------------------------------------------------------------------------
def _dtensor_box(t) -> Box:
    """This rank's box of a ``DTensor`` (torch's own local shape and global offset), checked to be a range of
    the full tensor per dimension."""
    from ..sources.dtensor import gather_dims, local_and_offset, normalized_placement

    placements = tuple(normalized_placement(p, t.dim()) for p in t.placements)
    gather_dims(tuple(t.shape), tuple(t.device_mesh.shape), placements)  # refuses shards that are not ranges
    local, offset = local_and_offset(t, placements)
    return Box(offset, tuple(o + s for o, s in zip(offset, local.shape, strict=True)))


class ShardedTrainerSource:
    """The trainer side of a sharded refit for one rank of a ``DTensor`` model.

    Args:
        model: the rank's model; parameters ``DTensor`` s (FSDP2 ``fully_shard``, ``parallelize_module`` on a
            ``DeviceMesh``: ``Shard`` / ``_StridedShard`` placements whose shards are ranges, ``Replicate``)
            or plain tensors (held whole by this rank, e.g. an embedding left unsharded). Native MXFP8 storage
            held whole is exported as is, as :class:`~mxport.refit.TrainerSource` does.
        policy, fp8_dtype, kept_dtype, kernel: as for :class:`~mxport.refit.TrainerSource`.

    The plan tensors (names, roles, dtypes, full shapes, in order) are those of
    :class:`~mxport.refit.TrainerSource` on the same model unsharded: the policy decides on the full shapes,
    so every rank, and an engine that needs the whole model, agree.

    Boxes (:attr:`holdings`): values, the local shard's box; kept tensors, the same; scales, the same rows and
    every block overlapping the local K range. Where blocks would straddle K shards (a local K that is not a
    multiple of 32, e.g. RowwiseParallel K = 96 over 2 ranks), :func:`~mxport.sources.quantize_local` gathers
    K and quantizes the gathered tensor: the values are still exactly the local slice, and the block the two
    ranks share is held by both with the same byte (computed from the whole block). Every byte is that of
    quantizing the full tensor, cut with the box.
    """

    def __init__(self, model: nn.Module, policy=None, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 kept_dtype: torch.dtype | None = None, kernel: str | None = None):
        from ..sources.dtensor import is_dtensor

        base = TrainerSource(model, policy, bucket_bytes=_PLAN_BUCKET, fp8_dtype=fp8_dtype,
                             kept_dtype=kept_dtype, kernel=kernel)
        self.fp8_dtype, self.kept_dtype, self.kernel = fp8_dtype, kept_dtype, kernel
        self.plan = base.plan  # the global plan: full shapes
        self._tensors = list(zip(base.tensors_by_name, base.quantized, strict=True))
        infos = _infos((e.name, e.role, e.dtype, e.shape) for e in self.plan.entries)
        held, i = [], 0
        for (_, t), q in self._tensors:
            values = _dtensor_box(t) if is_dtensor(t) else Box.full(infos[i].shape)
            held.append(Holding(infos[i], values))
            if q:
                held.append(Holding(infos[i + 1], scales_box(values, infos[i].shape)))
            i += 2 if q else 1
        self.holdings: list[Holding] = held

    @torch.no_grad()
    def local(self) -> Local:
        """``{name: (box, tensor)}`` of this rank's bytes of the CURRENT weights (call once per refit, after
        the optimizer step). A collective where a ``DTensor`` needs a gather: every rank of its mesh calls
        :meth:`local` at the same time (tensors go in the same order on every rank)."""
        from ..export import export_components
        from ..nn import plain_float
        from ..quantize import quantize
        from ..sources.dtensor import is_dtensor, quantize_local

        out: Local = {}
        held = iter(self.holdings)
        for (_, t), q in self._tensors:
            h = next(held)
            if q:
                s = next(held)
                if is_dtensor(t):
                    c = quantize_local(t, self.fp8_dtype, kernel=self.kernel)
                elif plain_float(t):
                    c = quantize(t.detach(), self.fp8_dtype, kernel=self.kernel)
                else:
                    c = export_components(t.data if isinstance(t, nn.Parameter) else t)
                out[h.tensor.name] = (h.box, _checked(c.data, h))
                out[s.tensor.name] = (s.box, _checked(c.scale_inv, s))
            else:
                x = t.detach()
                x = x.to_local() if is_dtensor(x) else x
                want = kept_wire_dtype(x, self.kept_dtype)
                out[h.tensor.name] = (h.box, _checked(x.to(want).contiguous(), h))
        return out


def _checked(t: torch.Tensor, h: Holding) -> torch.Tensor:
    """``t`` when it has the holding's box shape and dtype, else RuntimeError (a weight whose shape or dtype
    changed since the plan was built, or a placement that moved)."""
    if tuple(t.shape) != h.box.shape or str(t.dtype).removeprefix("torch.") != h.tensor.dtype:
        raise RuntimeError(f"{h.tensor.name}: {tuple(t.shape)} {t.dtype} where the plan holds {h.box.shape} "
                           f"{h.tensor.dtype} (did the weight change shape, dtype or placement?)")
    return t


# -- trainer side: held names --------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldItem:
    """What one item of a rank holds: its ``box`` of the tensor ``name`` of full shape ``full_shape``, in
    ``dtype`` (the whole tensor: the full box)."""

    name: str
    dtype: torch.dtype
    box: Box
    full_shape: tuple[int, ...]


def _held_item(obj, i: int) -> tuple[HeldItem, torch.Tensor]:
    """Check one ``(name, tensor)`` / ``(name, tensor, dim, start, full_size)`` item: what it holds, and the
    tensor."""
    if not isinstance(obj, tuple) or len(obj) not in (2, 5):
        raise ValueError(f"items() item {i}: expected (hf_name, tensor) or (hf_name, tensor, dim, start, "
                         f"full_size), got {type(obj).__name__} {obj!r:.80}")
    name, t = obj[0], obj[1]
    if not isinstance(name, str) or not name:
        raise ValueError(f"items() item {i}: the name must be a non-empty str, got {name!r}")
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        raise TypeError(f"items() {name!r}: expected a tensor of at least one dimension, got "
                        f"{type(t).__name__}")
    if len(obj) == 2:
        return HeldItem(name, t.dtype, Box.full(t.shape), tuple(t.shape)), t
    dim, start, full = obj[2:]
    if not all(type(v) is int for v in (dim, start, full)) or not -t.dim() <= dim < t.dim():
        raise ValueError(f"items() {name!r}: dim, start, full_size must be ints with dim in "
                         f"[{-t.dim()}, {t.dim()}), got {obj[2:]}")
    dim %= t.dim()
    if start < 0 or start + t.shape[dim] > full:
        raise ValueError(f"items() {name!r}: [{start}, {start + t.shape[dim]}) of dimension {dim} lies "
                         f"outside its full size {full}")
    shape = list(t.shape)
    shape[dim] = full
    return HeldItem(name, t.dtype, Box.along(shape, dim, start, start + t.shape[dim]), tuple(shape)), t


def _held_items(items: Callable[[], Iterable]) -> list[HeldItem]:
    """What ``items()`` holds, item by item (the tensors are not kept)."""
    out, seen = [], set()
    for i, obj in enumerate(items()):
        h, _ = _held_item(obj, i)
        if h.name in seen:
            raise ValueError(f"items() yields {h.name!r} twice")
        seen.add(h.name)
        out.append(h)
    return out


def _full_entries(names_and_shapes, held: list[HeldItem], policy) -> list[tuple[str, tuple, torch.dtype]]:
    """The model's full list of ``(name, shape, dtype)`` the policy decides on (see HeldTensorsSource)."""
    if names_and_shapes is None:
        if policy.keep_last or policy.include or policy.exclude:
            raise ValueError("HeldTensorsSource: a policy with keep_last / include / exclude decides on the "
                             "whole model (layer count, shared precision groups): pass names_and_shapes")
        return [(h.name, h.full_shape, h.dtype) for h in held]
    if isinstance(names_and_shapes, nn.Module):
        return [(n, tuple(t.shape), t.dtype) for n, t in model_tensors(names_and_shapes)]
    return [(n, tuple(int(s) for s in shape), dtype) for n, shape, dtype in names_and_shapes]


class HeldTensorsSource:
    """The trainer side of a sharded refit for a rank that holds named tensors (whole, or a range of one
    dimension), not a ``DTensor`` model.

    Args:
        items: a callable returning an iterable of ``(hf_name, tensor)`` (the rank holds the whole tensor:
            pipeline stages, Megatron-Bridge ``export_hf_weights``, verl's per-tensor generators) or
            ``(hf_name, tensor, dim, start, full_size)`` (the rank holds ``[start, start +
            tensor.shape[dim])`` of dimension ``dim`` of a tensor whose full size there is ``full_size``,
            e.g. its experts of a fused 3-D expert weight, ``dim`` 0). Called once here (to learn what the
            rank holds), then once per :meth:`local`; it must yield the same names, shapes and dtypes.
        names_and_shapes: the WHOLE model's tensors, for the policy: ``(name, full shape, dtype)`` entries
            in model order, or an ``nn.Module`` (typically built on the meta device from the model's config,
            ``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``) whose
            :func:`~mxport.refit.items.model_tensors` are taken. Names must be the names ``items`` yields.
            None: decide on this rank's own items, allowed only for a policy whose decisions do not depend on
            the rest of the model (no ``keep_last``, ``include``, ``exclude``; the default policy).
        policy, fp8_dtype, kept_dtype, kernel: as for :class:`~mxport.refit.TrainerSource`.

    The policy decides once on the whole model's list, so ranks holding different subsets agree with each
    other and with an engine that holds everything (e.g. ``keep_last=1`` on pipeline stage 0, which sees no
    last layer). A slice along K must be whole blocks (its start a multiple of 32, its end one or K), else
    ValueError: its scales would need the rest of the row. The bytes are those of quantizing the full tensor,
    cut with the box (rowwise blocks never cross rows).
    """

    def __init__(self, items: Callable[[], Iterable], *, names_and_shapes=None, policy=None,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, kept_dtype: torch.dtype | None = None,
                 kernel: str | None = None):
        from ..policy import PrecisionPolicy

        policy = PrecisionPolicy() if policy is None else policy
        self.items, self.fp8_dtype, self.kept_dtype, self.kernel = items, fp8_dtype, kept_dtype, kernel
        held = _held_items(items)
        entries = _full_entries(names_and_shapes, held, policy)
        decisions = {d.name: d for d in policy.decide_all(entries)}
        self.holdings: list[Holding] = []
        self._spec: dict[str, tuple[HeldItem, list[Holding]]] = {}  # by name: as at construction, holdings
        for h in held:
            d = decisions.get(h.name)
            if d is None or d.shape != h.full_shape:
                raise ValueError(f"items() yields {h.name!r} of full shape {h.full_shape}, which "
                                 f"names_and_shapes {'lacks' if d is None else f'gives as {d.shape}'}")
            if d.quantize and not h.dtype.is_floating_point:
                raise TypeError(f"{h.name!r}: the policy quantizes it but items() yields {h.dtype}")
            self._spec[h.name] = (h, self._holdings_of(h, d.quantize))
            self.holdings += self._spec[h.name][1]

    def _holdings_of(self, h: HeldItem, quantized: bool) -> list[Holding]:
        if not quantized:
            kept = self.kept_dtype if self.kept_dtype is not None and h.dtype.is_floating_point else h.dtype
            infos = _infos(tensor_items(h.name, kept, h.full_shape))
            return [Holding(infos[0], h.box)]
        sshape = compact_scale_shape(h.full_shape, "rowwise")
        items = tensor_items(h.name, self.fp8_dtype, h.full_shape, scales=(torch.uint8, sshape))
        values, scales = _infos(items)
        return [Holding(values, h.box), Holding(scales, scales_box(h.box, h.full_shape, name=h.name,
                                                                   whole_blocks=True))]

    def held_names(self) -> frozenset[str]:
        """The names this rank holds (all or part of), as vLLM's ``WeightSource.held_names()``."""
        return frozenset(self._spec)

    @torch.no_grad()
    def local(self) -> Local:
        """``{name: (box, tensor)}`` of this rank's bytes of the current tensors: one pass over ``items()``,
        each tensor quantized as it comes (the items are not all kept alive at once).

        Raises:
            ValueError: ``items()`` now yields other names, shapes, ranges or dtypes than at construction."""
        from ..quantize import quantize

        out: Local = {}
        for i, obj in enumerate(self.items()):
            h, t = _held_item(obj, i)
            if h.name not in self._spec or h.name in out:
                raise ValueError(f"items() now yields {h.name!r} "
                                 f"{'twice' if h.name in out else 'which it did not at construction'}")
            first, held = self._spec[h.name]
            if h != first:
                raise ValueError(f"items() now yields {h.name!r} as {h.box} of {h.full_shape} {h.dtype}, "
                                 f"at construction {first.box} of {first.full_shape} {first.dtype}")
            x = t.detach()
            if len(held) == 2:
                c = quantize(x, self.fp8_dtype, kernel=self.kernel)
                for part, hd in zip((c.data, c.scale_inv), held, strict=True):
                    out[hd.tensor.name] = (hd.box, _checked(part, hd))
            else:
                want = kept_wire_dtype(x, self.kept_dtype)
                out[h.name] = (h.box, _checked(x.to(want).contiguous(), held[0]))
        missing = [h.tensor.name for _, held in self._spec.values() for h in held if h.tensor.name not in out]
        if missing:
            raise ValueError(f"items() no longer yields {missing[:5]}")
        return out


# -- engine side ---------------------------------------------------------------------------------------------
def engine_boxes(name: str, shape: tuple[int, ...], layout: Layout, rank: int, kv_heads: int | None,
                  quantized: bool) -> list[Box]:
    """The boxes of tensor ``name`` (full ``shape``) that engine rank ``rank`` holds (see engine_holdings):
    one, or one per block of :attr:`~mxport.layout.Shard.blocks` (a fused gate_up's gate rows, up rows)."""
    shard = engine_shard(name, shape, layout, kv_heads=kv_heads, quantized=quantized)
    if shard.problem:
        raise ValueError(shard.problem)
    if shard.dim is None:
        return [Box.full(shape)]
    dim, tp = shard.dim % len(shape), layout.tp
    if layout.ep > 1 and dim == 0 and len(shape) == 3:  # experts over all tp * ep ranks
        part = rank
    elif shard.parts == tp:
        part = rank % tp
    elif tp % shard.parts == 0:  # KV heads replicated over tp // parts ranks (vLLM num_kv_head_replicas)
        part = rank % tp // (tp // shard.parts)
    else:
        raise ValueError(f"{name}: tp={tp} is not a multiple of its {shard.parts} KV heads (vLLM refuses)")
    return [Box.along(shape, dim, a, b) for a, b in shard.ranges(shape[dim], part)]


def engine_holdings(model: nn.Module, layout: Layout, rank: int, *, kv_heads: int | None = None
                    ) -> list[Holding]:
    """What engine rank ``rank`` of a vLLM-style ``layout`` (``tp * ep`` ranks) needs of an inference model
    after :func:`mxport.nn.quantize_model`: the :func:`~mxport.refit.receiver_plan` tensors (names, roles,
    dtypes, full shapes), each with the box :func:`mxport.layout.engine_shard` gives that rank.

    Column-parallel tensors: rows ``[p * n, (p + 1) * n)`` of part ``p = rank % tp``; KV projections with
    fewer heads than ``tp`` are cut in ``kv_heads`` parts, each held by ``tp // kv_heads`` consecutive ranks
    (the same box); row-parallel: the K range of part ``rank % tp``; fused experts with ``ep > 1``: experts
    ``[rank * n, (rank + 1) * n)``; everything else whole. Scales follow their values' box: the same rows, or
    the K blocks of a row-parallel K range.

    A fused ``experts.gate_up_proj`` ``[E, 2I, K]`` at tp > 1 (ep 1) gives TWO holdings (and two of its
    scales): gate rows ``[p * I/tp, (p + 1) * I/tp)`` then up rows ``[I + p * I/tp, I + (p + 1) * I/tp)``, the
    rows vLLM's ``FusedMoE`` ``w13_weight`` holds on tp rank ``p`` (:func:`engine_buffers` gives them one
    buffer, gate part first).

    Args:
        kv_heads: the model's KV heads; None = ``model.config.num_key_value_heads`` when the model has one.

    Raises:
        ValueError: ``rank`` outside ``[0, tp * ep)``; a layout with ``fsdp`` or ``pp`` (not an engine's);
            a row-parallel K split that is not a multiple of 32 for an MXFP8 tensor (naming it); a tp that is
            not a multiple of the KV heads it exceeds; attention heads that do not divide by tp, or KV heads
            that neither divide by tp nor divide it (vLLM refuses these layouts).
    """
    from .inference import receiver_plan

    if layout.fsdp != 1 or layout.pp != 1:
        raise ValueError(f"engine layout {layout}: an engine rank is cut by tp and ep only")
    if not (type(rank) is int and 0 <= rank < layout.tp * layout.ep):
        raise ValueError(f"rank must be an int in [0, {layout.tp * layout.ep}) for engine layout {layout}, "
                         f"got {rank!r}")
    config = getattr(model, "config", None)
    if kv_heads is None:
        kv_heads = getattr(config, "num_key_value_heads", None)
    problem = attention_problem(layout.tp, getattr(config, "num_attention_heads", None), kv_heads)
    if problem:
        raise ValueError(f"engine layout {layout}: {problem}")
    plan, _ = receiver_plan(model, _PLAN_BUCKET)
    out: list[Holding] = []
    values: list[Holding] = []
    for e in plan.entries:
        info = TensorInfo(e.name, e.role, e.dtype, tuple(e.shape))
        if e.role == "scales" and values:
            boxes = [scales_box(v.box, v.tensor.shape, name=v.tensor.name, whole_blocks=True) for v in values]
        else:
            boxes = engine_boxes(e.name, info.shape, layout, rank, kv_heads, e.role == "values")
        held = [Holding(info, box) for box in boxes]
        out += held
        values = held if e.role == "values" else []
    return out


_MERGED = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|weight_scale)$")
_MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _stackable(members: Sequence[Holding | None]) -> bool:
    """Whether the holdings can be row blocks of one buffer: all there, of one dtype and rank (at least 2-D),
    the same extent in every dimension but the rows (dim ``-2``)."""
    if any(x is None for x in members):
        return False
    first = members[0].box.shape
    return all(x.tensor.dtype == members[0].tensor.dtype and len(x.box.shape) == len(first) >= 2
               and x.box.shape[:-2] == first[:-2] and x.box.shape[-1] == first[-1] for x in members)


def _merge_groups(holdings: Sequence[Holding]) -> list[list[Holding]]:
    """Holdings cut from one vLLM merged buffer, each group in merged (row) order: q/k/v, gate/up of one layer
    (values or scales; one holding each), and the several holdings of one tensor (a fused expert gate_up at
    tp > 1: gate rows, then up rows, as ``w13_weight``)."""
    by_name: dict[str, list[Holding]] = {}
    for h in holdings:
        by_name.setdefault(h.tensor.name, []).append(h)
    groups = [held for held in by_name.values() if len(held) > 1 and _stackable(held)]
    for h in holdings:
        m = _MERGED.match(h.tensor.name)
        if not m or m.group(2) not in ("q_proj", "gate_proj"):
            continue
        parts = _MERGED_PARTS["qkv_proj" if m.group(2) == "q_proj" else "gate_up_proj"]
        found = [by_name.get(f"{m.group(1)}.{p}.{m.group(3)}", []) for p in parts]
        members = [x[0] if len(x) == 1 else None for x in found]
        if _stackable(members) and len(h.box.shape) == 2:
            groups.append(members)
    return groups


def engine_buffers(holdings: Sequence[Holding], device: str | torch.device = "cpu",
                   dtype_of: Callable[[TensorInfo], torch.dtype] | None = None) -> Local:
    """An engine rank's own tensors for ``holdings`` (:func:`engine_holdings`): ``{name: (box, tensor)}``,
    zero-filled, each of its box's shape (only the rank's shard), ready for
    :func:`~mxport.refit.mesh.route_targets`; a tensor the rank holds several boxes of maps to a list of
    ``(box, tensor)``, in holding order (:func:`~mxport.refit.mesh.local_part` reads either form).

    q/k/v projections of one attention and gate/up of one MLP are row views of ONE merged buffer (rows
    q | k | v, gate | up, each part its own box's rows), values and scales alike, as vLLM's
    ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` hold them; so are the gate and up boxes of a fused
    ``experts.gate_up_proj`` at tp > 1 (one ``[E, 2I/tp, K]`` buffer, scales ``[E, 2I/tp, K/32]``, gate rows
    first, as ``FusedMoE``'s ``w13_weight``): received pieces land in the merged buffers in place.
    ``dtype_of(info)`` gives a buffer's dtype (default: the plan dtype)."""
    dtype_of = dtype_of or (lambda info: dtype_from_name(info.dtype))
    views: dict[Holding, torch.Tensor] = {}
    for group in _merge_groups(holdings):
        first = group[0].box.shape
        rows = [h.box.shape[-2] for h in group]
        merged = torch.zeros((*first[:-2], sum(rows), first[-1]), dtype=dtype_of(group[0].tensor),
                             device=device)
        for h, view in zip(group, torch.split(merged, rows, dim=-2), strict=True):
            views[h] = view
    entries: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    for h in holdings:
        t = views.get(h)
        if t is None:
            t = torch.zeros(h.box.shape, dtype=dtype_of(h.tensor), device=device)
        entries.setdefault(h.tensor.name, []).append((h.box, t))
    return {n: held[0] if len(held) == 1 else held for n, held in entries.items()}
