"""What one vLLM worker holds of a refit plan, where each byte lands in its live weights, and how each layer
re-derives what its kernel keeps beside them (the engine layout of the ``"mxport"`` backend).

* :func:`worker_holdings`: the boxes of every plan tensor that tensor-parallel rank ``rank`` holds, by
  vLLM's rules: column-parallel rows (q / k / v with KV heads replicated over ``tp // kv_heads`` ranks, gate /
  up), row-parallel K ranges (scales: their K blocks), a vocabulary's rows from the layer's own
  ``shard_indices`` (padding rows stay the engine's), everything else whole.
* :func:`live_slices`: those boxes as views of the worker's live parameters (q / k / v at their row offsets
  in ``qkv_proj``, gate / up in ``gate_up_proj``, from ``output_partition_sizes``), and one
  :class:`LayerApply` per layer saying how the layer takes new bytes:

  ``in_place``     the live parameters are the checkpoint layout and the kernel derives nothing from them
                   (vLLM's ``EmulationMxfp8LinearKernel`` with ``VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0``,
                   norms, biases, embeddings on GPUs): bytes land in them directly;
  ``redispatch``   the same, and the CPU GEMM dispatch keeps a packed copy of the weight (a vocabulary
                   layer's ``cpu_linear``: the tied lm_head's logits): re-packed from the new weight;
  ``dequant``      the emulation kernel dequantized the weight to BF16 at load (vLLM's default): the FP8
                   values are staged, the scales land in place, the BF16 weight is re-decoded in place;
  ``layerwise``    anything else (a kernel that swizzles, repacks or empties its weights): the layer's
                   checkpoint-layout tensors are staged, then vLLM's own post-load processing runs on them
                   and its results are copied into the live tensors (pointers stable), as vLLM's layerwise
                   reload does, for this layer only.

  A layer that has a tensor no plan entry gives (a static input scale, say) cannot be re-processed from the
  refit alone: :func:`live_slices` refuses it, naming it and its kernel.
* :func:`apply_layers`: the re-derivations, for the layers a refit touched (after every byte was validated
  and written).
* :func:`holding_digests`: per holding, a checksum of the live bytes in checkpoint layout (undoing the
  emulation kernel's BF16 decode): what attestation compares with what the trainer sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..parallel import Layout
from ..refit.engine.slices import engine_holdings
from ..refit.mesh import Box, Holding, TensorInfo
from ..refit.plan import RefitPlan

PATHS = ("in_place", "redispatch", "dequant", "layerwise")
_VOCAB_NAMES = ("embed_tokens", "lm_head")


@dataclass
class LayerApply:
    """How one vLLM layer takes a refit: ``path`` (one of :data:`PATHS`), its kernel's name, and for the
    staged paths the checkpoint-layout buffers the refit lands in (``{parameter name: tensor}``)."""

    name: str
    module: torch.nn.Module
    path: str
    kernel: str
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    follows: str | None = None  # a layer outside the plan computing from this named layer's weight
    lead: torch.nn.Module | None = None  # that layer's module (a tied lm_head's embedding)


def _fused_of(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    """``{part: (fused parameter module, index of the part)}`` from the model's ``packed_modules_mapping``."""
    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    return {part: (fused, i) for fused, parts in mapping.items() for i, part in enumerate(parts)}


def _target(name: str, fused_of: dict) -> tuple[str, str, int | None]:
    """``(module name, parameter name, part index or None)`` of the vLLM parameter plan tensor ``name`` loads
    into (``...q_proj.weight`` -> ``(...qkv_proj, weight, 0)``)."""
    module, _, param = name.rpartition(".")
    parts = module.split(".")
    part = None
    for i, c in enumerate(parts):
        if c in fused_of:
            parts[i], part = fused_of[c]
    return ".".join(parts), param, part


def _vocab_rows(model: torch.nn.Module, module_name: str) -> tuple[int, int] | None:
    """The checkpoint rows ``[start, end)`` a vocabulary layer of this rank holds (its ``shard_indices``), or
    None when the module is not one."""
    mod = model.get_submodule(module_name)
    si = getattr(mod, "shard_indices", None)
    if si is None:
        return None
    return int(si.org_vocab_start_index), int(si.org_vocab_end_index)


def worker_holdings(plan: RefitPlan, model: torch.nn.Module, *, tp: int, rank: int,
                    kv_heads: int | None = None) -> list[Holding]:
    """What tensor-parallel rank ``rank`` of ``tp`` of the vLLM ``model`` needs of ``plan``: vLLM's slicing
    (:func:`mxport.refit.engine_holdings`), a vocabulary's rows from the layer's own ``shard_indices``.

    Raises:
        ValueError: a layout vLLM refuses (attention heads, KV heads), a K split that cuts MXFP8 blocks."""
    fused_of = _fused_of(model)

    def vocab(info: TensorInfo) -> list[Box] | None:
        module = _target(info.name, fused_of)[0]
        rows = _vocab_rows(model, module) if module.endswith(_VOCAB_NAMES) else None
        return [Box.along(info.shape, 0, *rows)] if rows is not None else None

    return engine_holdings(model, Layout(tp=tp), rank, kv_heads=kv_heads, plan=plan, boxes_of=vocab)


def _kernel_name(mod: torch.nn.Module) -> str:
    qm = getattr(mod, "quant_method", None)
    kernel = getattr(qm, "kernel", None)
    return type(kernel if kernel is not None else qm).__name__ if qm is not None else "none"


def _recorded(mod: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The layer's checkpoint-layout parameters as vLLM recorded them for layerwise reload (meta tensors), or
    its live ones when there is no record."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        recorded = dict(get_layerwise_info(mod).restore_metadata[0])
    except ImportError:  # pragma: no cover - vLLM without layerwise reload
        recorded = {}
    live = dict(mod.named_parameters(recurse=False))
    return {n: recorded.get(n, t) for n, t in live.items()} | recorded


def _path(mod: torch.nn.Module, names: set[str]) -> str:
    """How layer ``mod`` takes new bytes for its parameters ``names`` (see the module doc)."""
    kernel = _kernel_name(mod)
    live = dict(mod.named_parameters(recurse=False))
    recorded = _recorded(mod)
    same = all(n in live and live[n].numel() > 0 and tuple(live[n].shape) == tuple(recorded[n].shape)
               and live[n].dtype == recorded[n].dtype for n in names)
    if kernel == "EmulationMxfp8LinearKernel":
        return "in_place" if same else "dequant"
    if kernel in ("none", "UnquantizedEmbeddingMethod") and same:
        return "redispatch" if getattr(mod, "cpu_linear", None) is not None else "in_place"
    return "layerwise"


def _layer_of(model, module: str, names: set[str], check_only: bool = False) -> LayerApply:
    mod = model.get_submodule(module)
    path = _path(mod, names)
    recorded = _recorded(mod)
    if path == "layerwise":
        missing = sorted(set(recorded) - names)
        if missing:
            raise ValueError(f"{module}: its kernel {_kernel_name(mod)} keeps {missing}, which the refit "
                             "does not carry: this layer cannot be re-processed from the refit alone")
    device = torch.device("meta") if check_only else next((t.device for t in mod.parameters(recurse=False)),
                                                           torch.device("cpu"))
    staged = {}
    if path in ("layerwise", "dequant"):
        staged = {n: torch.zeros(recorded[n].shape, dtype=recorded[n].dtype, device=device)
                  for n in (recorded if path == "layerwise" else ["weight"])}
    return LayerApply(module, mod, path, _kernel_name(mod), staged)


def _rows(model, module: str, part: int | None) -> int:
    """The first row of fused part ``part`` in the live parameter (0 for an unfused one)."""
    if part is None:
        return 0
    sizes = getattr(model.get_submodule(module), "output_partition_sizes", None)
    if sizes is None:
        raise ValueError(f"{module}: a fused layer without output_partition_sizes")
    return int(sum(int(s) for s in sizes[:part]))


def live_slices(model: torch.nn.Module, holdings: Sequence[Holding], *, check_only: bool = False
                ) -> tuple[dict, list[LayerApply]]:
    """``(live, layers)``: ``live`` maps each plan tensor to ``(box, view)`` (a list of them for several
    boxes) into the worker's live parameters (or into a staged layer's buffers); ``layers`` says how each
    touched layer takes its bytes (see the module doc). ``check_only``: the same checks, the staged layers'
    buffers on the meta device (nothing allocated).

    Raises:
        ValueError: a layer that cannot take a refit (naming it and its kernel), a view whose shape is not
            its box's (a plan that does not fit: :func:`~mxport.integrations.vllm.plan_misfits` says more)."""
    fused_of = _fused_of(model)
    by_module: dict[str, set[str]] = {}
    for h in holdings:
        module, param, _ = _target(h.tensor.name, fused_of)
        by_module.setdefault(module, set()).add(param)
    layers = {m: _layer_of(model, m, names, check_only) for m, names in by_module.items()}
    live: dict[str, list] = {}
    for h in holdings:
        module, param, part = _target(h.tensor.name, fused_of)
        layer = layers[module]
        whole = layer.staged.get(param)
        if whole is None:
            whole = getattr(layer.module, param).data
        view = whole
        if part is not None or tuple(whole.shape) != h.box.shape:  # a fused part's or a vocabulary's rows
            dim = -2 if whole.dim() >= 2 else 0  # a bias: its one dimension
            start, rows = _rows(model, module, part), h.box.shape[dim]
            if start + rows > whole.shape[dim]:
                raise ValueError(f"{h.tensor.name}: the engine's {module}.{param} has {whole.shape[dim]} "
                                 f"rows, the box {h.box} this rank holds needs rows {start}..{start + rows}")
            view = whole.narrow(dim, start, rows)
        if tuple(view.shape) != h.box.shape:
            raise ValueError(f"{h.tensor.name}: the engine's {module}.{param} gives {tuple(view.shape)} for "
                             f"the box {h.box} {h.box.shape} this rank holds")
        live.setdefault(h.tensor.name, []).append((h.box, view))
    out = {n: v[0] if len(v) == 1 else v for n, v in live.items()}
    return out, [*layers.values(), *_followers(model, layers)]


def _followers(model: torch.nn.Module, layers: dict[str, LayerApply]) -> list[LayerApply]:
    """A tied ``lm_head`` (``tie_word_embeddings``): outside the plan, it computes the logits from the
    embedding's weight, and its CPU GEMM keeps its own packed copy of it (vLLM's AMX path packs it with
    ``convert_weight_packed`` and empties the layer's weight; its oneDNN path reads the weight): re-packed
    from the embedding whenever the embedding's layer is."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return []
    leads = [x for x in layers.values() if x.name.endswith("embed_tokens") and x.path in ("in_place",
                                                                                          "redispatch")]
    out = []
    for name, mod in model.named_modules():
        if (leads and name not in layers and name.endswith("lm_head")
                and getattr(mod, "cpu_linear", None) is not None):
            out.append(LayerApply(name, mod, "redispatch", _kernel_name(mod), follows=leads[0].name,
                                  lead=leads[0].module))
    return out


def _redispatch(layer: LayerApply) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    mod = layer.module
    if layer.lead is None:
        dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
        return
    emptied = mod.weight.numel() == 0  # a tied lm_head whose GEMM kept only its packed copy
    mod.weight = layer.lead.weight
    dispatch_cpu_unquantized_gemm(mod, remove_weight=emptied)


def _dequant(layer: LayerApply) -> None:
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

    mod = layer.module
    n, k = layer.staged["weight"].shape
    scale = mod.weight_scale.data[:n, :k // 32].contiguous()
    mod.weight.data.copy_(dequant_mxfp8_to_bf16(layer.staged["weight"], scale))


def _layerwise(layer: LayerApply) -> None:
    """vLLM's layerwise reload for one layer, from the staged checkpoint-layout tensors: restore the layer's
    recorded (checkpoint-layout) parameters, fill them, run the kernel's post-load processing, copy the
    results into the original tensors and put those back (pointers stable)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        _copy_and_restore_kernel_tensors,
        get_layerwise_info,
    )
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    mod = layer.module
    info = get_layerwise_info(mod)
    info.kernel_tensors = get_layer_params_buffers(mod)
    info.kernel_non_persistent_buffers = set(mod._non_persistent_buffers_set)
    restore_layer_on_meta(mod, info)
    materialize_layer(mod, info)
    for n, t in layer.staged.items():
        getattr(mod, n).data.copy_(t)
    if hasattr(mod, "_already_called_process_weights_after_loading"):
        delattr(mod, "_already_called_process_weights_after_loading")
    mod.quant_method.process_weights_after_loading(mod)
    _copy_and_restore_kernel_tensors(mod, info)
    info.reset()


_APPLY = {"redispatch": _redispatch, "dequant": _dequant, "layerwise": _layerwise}


def touched_layers(model: torch.nn.Module, layers: Sequence[LayerApply], names: set[str] | None
                   ) -> list[LayerApply]:
    """The layers holding plan tensors ``names`` (a delta refit's changed tensors; None: every layer)."""
    if names is None:
        return list(layers)
    fused_of = _fused_of(model)
    modules = {_target(n, fused_of)[0] for n in names}
    return [layer for layer in layers if layer.name in modules or layer.follows in modules]


def apply_layers(layers: Sequence[LayerApply]) -> dict[str, int]:
    """Re-derive what each layer's kernel keeps beside the bytes just written (see the module doc); returns
    the number of layers per path."""
    with torch.no_grad():
        for layer in layers:
            fn = _APPLY.get(layer.path)
            if fn is not None:
                fn(layer)
    counts = dict.fromkeys(PATHS, 0)
    for layer in layers:
        counts[layer.path] += 1
    return counts


def checkpoint_part(live: dict, layers: Sequence[LayerApply]):
    """``part(name, box)``: the live bytes of ``box`` of plan tensor ``name`` in checkpoint layout: a view
    of the live weights, except a ``dequant`` layer's FP8 values, re-encoded from its live BF16 decode and
    live scales (exact: every decoded value is an FP8 value times a power of two). What attestation reads."""
    from ..refit.mesh import local_part

    staged = {layer.staged["weight"].data_ptr(): layer for layer in layers if layer.path == "dequant"}

    def part(name: str, box: Box) -> torch.Tensor:
        view = local_part(live, name, box)
        layer = staged.get(view.untyped_storage().data_ptr())
        return view if layer is None else _reencode(layer, view)

    return part


def _reencode(layer: LayerApply, view: torch.Tensor) -> torch.Tensor:
    """The FP8 values of ``view`` (rows of a ``dequant`` layer's staged weight) re-encoded from the same rows
    of its live BF16 weight and its live scales."""
    mod = layer.module
    k = mod.weight.shape[-1]
    r0, rows = view.storage_offset() // k, view.shape[-2]
    w = mod.weight.data.narrow(-2, r0, rows).float()
    s = mod.weight_scale.data.narrow(-2, r0, rows)[:, :k // 32].to(torch.int32)
    scale = torch.exp2((s - 127).float()).repeat_interleave(32, dim=-1)
    return (w / scale).to(view.dtype)[..., view.storage_offset() % k:][..., :view.shape[-1]]


def tensor_digests(holdings: Sequence[Holding], digest) -> dict[str, int]:
    """``{tensor name: digest}`` of the live bytes of every box a worker holds (``digest``: a
    :class:`~mxport.refit.attest.PieceDigests` over :func:`checkpoint_part`)."""
    from ..refit.attest import fold

    out: dict[str, list[int]] = {}
    for h in holdings:
        out.setdefault(h.tensor.name, []).append(digest(h.tensor.name, h.box))
    return {n: fold(d) for n, d in out.items()}


def staged_bytes(layers: Sequence[LayerApply]) -> int:
    """Bytes of the layers' staging buffers (the ``dequant`` and ``layerwise`` paths' checkpoint copies)."""
    return sum(t.numel() * t.element_size() for layer in layers for t in layer.staged.values())
