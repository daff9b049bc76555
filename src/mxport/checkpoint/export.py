"""The export pipeline: source reader -> precision policy -> quantize -> streaming writer, into a temporary
directory renamed into place.

Source kinds: a Hugging Face directory of ``*.safetensors`` (streamed one tensor at a time), a ``.gguf`` file
or a directory holding one (loaded through :func:`mxport.models.load_causal_lm`), ``None`` (the embedded
default model, see :mod:`mxport.models`), an ``nn.Module`` or a state dict.

Output (docs/format.md, "What each consumer expects"): quantized tensors as ``<m>.weight`` FP8 values
(rowwise, the source shape) plus the scale tensor named by :func:`~mxport.checkpoint.naming.scale_name` (uint8
E8M0, compact ``(*shape[:-1], ceil(K/32))``), written next to each other; kept tensors in their dtype, or cast
to ``dtype`` when given (floating ones only); ``config.json`` with ``quantization_config``
(+ ``hf_quant_config.json`` for modelopt); every other small file of the source directory (tokenizer,
generation config, chat template, ...) copied.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .._fs import check_output_place, clean_stale_temps, output_errors, replace_dir, temp_output_dir
from ..formats import FLOAT_DTYPES, is_fp8_dtype
from ..fp4 import abs_max
from ..policy import Decision, PrecisionPolicy, exclude_modules, global_scale_group, share_group
from ..quants import MXFP8, Quant, get_quant
from .experts import checkpoint_naming
from .naming import (
    DEFAULT_FORMAT,
    check_activation,
    check_fp8_dtype,
    check_quant_format,
    hf_quant_config,
    input_scale_name,
    quant_names,
    quantization_config,
)
from .readers import INDEX_NAME, SafetensorsDir, StateDictSource
from .writers import ShardedSafetensorsWriter, TensorSpec, parse_size, plan_shards

#: files of a source directory that are not copied (weights, replaced configs, mxport's cache stamp)
_SKIP_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx")
_SKIP_NAMES = {"config.json", "hf_quant_config.json", INDEX_NAME, "pytorch_model.bin.index.json",
               "mxport-source.json"}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote: the output directory, decisions, files, byte counts
    (``input_bytes`` read from the source, ``output_bytes`` of tensor data written), the exclude list written
    to the config, the tensors kept in their source dtype by ``keep_unaligned`` (K not a multiple of 32, and
    the tensors sharing one precision with them), whether scale bytes 0 were lifted to 1, and the source
    tensors written under other names (``renamed``: source name -> output names; fused experts are written
    per expert, :mod:`mxport.checkpoint.experts`)."""

    out: Path
    format: str
    decisions: list[Decision]
    files: list[str]
    input_bytes: int
    output_bytes: int
    exclude_modules: list[str]
    kept_unaligned: list[str] = field(default_factory=list)
    nonzero_scales: bool = False
    renamed: dict[str, list[str]] = field(default_factory=dict)
    quant: str = "mxfp8"
    activation: str = "none"

    def to_dict(self) -> dict:
        return {"out": str(self.out), "format": self.format, "quant": self.quant,
                "activation": self.activation, "files": self.files,
                "input_bytes": self.input_bytes, "output_bytes": self.output_bytes,
                "quantized": sum(d.quantize for d in self.decisions),
                "kept": sum(not d.quantize for d in self.decisions), "exclude_modules": self.exclude_modules,
                "kept_unaligned": self.kept_unaligned, "nonzero_scales": self.nonzero_scales,
                "renamed": self.renamed,
                "decisions": [d.to_dict() for d in self.decisions]}


def open_source(source) -> SafetensorsDir | StateDictSource:
    """A reader for ``source`` (see the module docstring).

    Raises FileNotFoundError / ValueError (from :func:`mxport.models.resolve_source`) for a missing path or a
    path with no model; TypeError for any other object.
    """
    if isinstance(source, (torch.nn.Module, dict)):
        return StateDictSource(source)
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise TypeError("source must be a path, None, an nn.Module or a state dict; "
                        f"got {type(source).__name__}")
    from ..models import load_causal_lm, resolve_source

    src = resolve_source(source)
    if src.kind == "hf_dir":
        return SafetensorsDir(src.path)
    model, tok = load_causal_lm(src, dtype=torch.float32)
    extras = [tok] + ([model.generation_config] if getattr(model, "generation_config", None) else [])
    reader = StateDictSource(model, extras=extras, label=src.label)
    reader.source_path = src.path / src.gguf_file  # the file an output must never replace (prepare_out)
    return reader


def plan(reader, policy: PrecisionPolicy | None = None) -> list[Decision]:
    """The policy's decisions for every tensor of ``reader`` (what ``--dry-run`` prints).

    Raises:
        ValueError: the source already holds FP8 values (an MXFP8 or FP8 checkpoint): its values and scales
            would be copied as plain "kept" tensors under the new format's config, a checkpoint no engine
            reads right.
    """
    from ..models import fp4_source_error, fp8_source_error

    fp4 = fp4_source_error(reader.config, reader.entries())  # NVFP4's E4M3 scales: say which one it is first
    if fp4 is not None:
        raise fp4
    entries = reader.entries()
    fp8 = [n for n, _, dtype in entries if is_fp8_dtype(dtype)]
    if fp8:
        raise fp8_source_error(fp8)
    return (policy or PrecisionPolicy()).decide_all(entries)


#: why a K that is not a multiple of 32 cannot be MXFP8 in a checkpoint, in one line (docs/format.md,
#: "Who refuses a K that is not a multiple of 32")
UNALIGNED_WHY = ("vLLM (modelopt, compressed-tensors), SGLang's MXFP8 kernels and TE take whole blocks of 32 "
                 "along K only")


def why_unaligned(quant: Quant) -> str:
    """Why a weight whose K is not whole blocks of ``quant`` cannot be written in it, in a few words."""
    if quant is MXFP8:
        return UNALIGNED_WHY
    return f"vLLM's {quant.name.upper()} layers take whole blocks of {quant.block} along K only"


def unaligned(decisions: list[Decision], quant: Quant = MXFP8) -> list[Decision]:
    """The quantized decisions whose last dimension K is not whole blocks of ``quant`` (32; NVFP4: 16)."""
    return [d for d in decisions if d.quantize and not quant.aligned(d.shape[-1])]


def align_decisions(decisions: list[Decision], keep_unaligned: bool = False,
                    quant: Quant | str = MXFP8) -> list[Decision]:
    """``decisions`` for a checkpoint every consumer loads: a quantized tensor whose K is not whole blocks
    (a multiple of 32; 16 for NVFP4) is refused (ValueError naming them) or, with ``keep_unaligned``, kept in
    its source dtype; a tensor that shares one precision with a kept one (:func:`mxport.policy.share_group`:
    q/k/v, gate/up, one MoE layer's experts) is kept with it. Each kept tensor's reason says why."""
    quant = get_quant(quant)
    if quant is not MXFP8:  # the policy's reasons say MXFP8: the export writes another format
        name = quant.name.upper()
        decisions = [Decision(d.name, d.shape, d.dtype, True, d.reason.replace("MXFP8", name)) if d.quantize
                     else d for d in decisions]
    bad = unaligned(decisions, quant)
    if not bad:
        return decisions
    if not keep_unaligned:
        names = ", ".join(f"{d.name} (K={d.shape[-1]})" for d in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"{len(bad)} tensor{'s' if len(bad) > 1 else ''} with K not a multiple of "
                         f"{quant.block} cannot be {quant.name.upper()} ({why_unaligned(quant)}): {names}"
                         f"{more}; pass --keep-unaligned (keep_unaligned=True) to keep them in their source "
                         "dtype")
    why = {d.name: f"kept: K={d.shape[-1]} is not a multiple of {quant.block} (--keep-unaligned)"
           for d in bad}
    for d in bad:  # its share group (fused by the engine) keeps one precision: kept with it
        group = share_group(d.name)
        if group:
            why.setdefault(group[0], f"kept: {group[1]} share one precision ({d.name}: K={d.shape[-1]} "
                                     f"is not a multiple of {quant.block}, --keep-unaligned)")
    out = []
    for d in decisions:
        group = share_group(d.name)
        reason = why.get(d.name) or (why.get(group[0]) if d.quantize and group else None)
        out.append(Decision(d.name, d.shape, d.dtype, False, reason) if reason else d)
    return out


def _tied(config: dict) -> bool:
    return bool(config.get("tie_word_embeddings", False))


def _outputs(decisions, naming) -> dict[str, list[tuple[str, int, int]]]:
    """Per source tensor, its output tensors as ``(name, first row, end row)`` of its ``(M, K)`` view: one
    (the tensor, renamed for the checkpoint), or one per expert piece of a fused expert tensor
    (:class:`~mxport.checkpoint.experts.ExpertNaming`)."""
    out = {}
    for d in decisions:
        pieces = naming.split(d.name, d.shape) if naming else None
        rows = math.prod(d.shape[:-1]) if len(d.shape) > 1 else 1
        out[d.name] = pieces or [(naming.rename(d.name) if naming else d.name, 0, rows)]
    return out


def _output_groups(decisions, outputs, enc: _Encoding) -> list[list[TensorSpec]]:
    groups = []
    q = enc.quant
    for d in decisions:
        for name, r0, r1 in outputs[d.name]:
            shape = d.shape if len(outputs[d.name]) == 1 else (r1 - r0, d.shape[-1])
            if d.quantize:
                values, scale, glob = quant_names(name, enc.fmt, q.name)
                group = [TensorSpec(values, q.values_dtype(enc.fp8_dtype), q.values_shape(shape)),
                         TensorSpec(scale, q.scale_dtype, q.scale_shape(shape))]
                if glob:
                    group.append(TensorSpec(glob, torch.float32, enc.global_shape()))
                if name in enc.inputs:
                    group.append(TensorSpec(input_scale_name(name), torch.float32, ()))
                groups.append(group)
            else:
                dtype = enc.dtype
                out_dtype = dtype if (dtype is not None and d.dtype in FLOAT_DTYPES) else d.dtype
                groups.append([TensorSpec(name, out_dtype, shape)])
    return groups


def _copy_small_files(src_dir: Path | None, dst: Path) -> list[str]:
    if src_dir is None:
        return []
    copied = []
    for f in sorted(src_dir.iterdir()):
        if f.is_file() and f.name not in _SKIP_NAMES and not f.name.startswith(".") and (
                not f.name.endswith(_SKIP_SUFFIXES)):
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def prepare_out(out: str | os.PathLike, overwrite: bool, source_dir: Path | None) -> Path:
    """Check the output path before any work and recover from a killed run into it; returns it as a Path.

    ``source_dir`` is the source (a folder or a file, e.g. a GGUF) or None. Refused (ValueError): an output
    that is, contains or lies inside the source, or is / contains the current, home or root directory
    (compared on real paths, :func:`mxport._fs.check_output_place`); an existing file. FileExistsError when
    ``out`` exists without ``overwrite``. Before that, temporaries of ``out`` left by killed runs are removed,
    and an output that an interrupted overwrite left renamed aside is put back
    (:func:`mxport._fs.clean_stale_temps`).
    """
    out = Path(out).expanduser()
    check_output_place(out, source_dir)
    with output_errors(out):
        clean_stale_temps(out)
    # a symlink (even a dangling or looping one) is there: never replaced silently
    exists = os.path.lexists(out)
    if exists and not overwrite:
        raise FileExistsError(f"output {str(out)!r} already exists; "
                              "pass overwrite=True (--overwrite) to replace it")
    if exists and not out.is_dir():
        raise ValueError(f"output {str(out)!r} exists and is not a directory")
    return out


def check_options(fmt: str, fp8_dtype: torch.dtype, quant, activation: str = "none",
                  nonzero_scales: bool = False, dtype: torch.dtype | None = None) -> Quant:
    """The export's options checked together (one ValueError / TypeError naming the first bad one); returns
    the weight format's record."""
    check_fp8_dtype(fmt, fp8_dtype)
    quant = get_quant(quant)
    check_quant_format(fmt, quant.name)
    if nonzero_scales and quant is not MXFP8:
        raise ValueError(f"--nonzero-scales (nonzero_scales) applies to MXFP8's E8M0 bytes, not to "
                         f"{quant.name}")
    check_activation(activation, quant.name, fmt)
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    return quant


def export_checkpoint(source, out: str | os.PathLike, *, fmt: str = DEFAULT_FORMAT,
                      fp8_dtype: torch.dtype = torch.float8_e4m3fn, policy: PrecisionPolicy | None = None,
                      dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB",
                      overwrite: bool = False,
                      progress: Callable[[str, int], None] | None = None, keep_unaligned: bool = False,
                      nonzero_scales: bool = False, quant: str = "mxfp8", activation: str = "none",
                      calibration=None) -> ExportResult:
    """Export ``source`` as an MXFP8 (or ``quant``: MXFP4, NVFP4) checkpoint in format ``fmt`` at ``out``.

    Args:
        source: path (HF dir, GGUF), None (the embedded default model), an ``nn.Module`` or a state dict; or a
            reader from :func:`open_source`.
        out: output directory; written under a temporary name in the same folder and renamed into place.
        fmt: "modelopt" (default), "compressed-tensors" or "sglang"
            (:data:`~mxport.checkpoint.naming.FORMATS`).
        fp8_dtype: element type of the values; E5M2 only where the format allows it (sglang).
        policy: which tensors are quantized (default :class:`~mxport.policy.PrecisionPolicy()`).
        dtype: cast kept floating tensors to this dtype (bf16 / fp16 / fp32); None keeps each tensor's dtype.
        max_shard_size: e.g. "5GB"; a values+scale pair never straddles shards.
        overwrite: replace an existing ``out``.
        progress: called as ``progress(tensor_name, input_bytes_done)`` after each source tensor.
        keep_unaligned: keep a tensor whose K is not a multiple of 32 in its source dtype (and the tensors
            that share one precision with it in the engine: q/k/v, gate/up, one MoE layer's experts) instead
            of refusing the export (:func:`align_decisions`): vLLM, SGLang and TE cannot load it as MXFP8.
        nonzero_scales: E8M0 byte 1 for every block whose byte would be 0 (FlashInfer's TRT-LLM kernels;
            :func:`mxport.quantize.lift_zero_scales`); decoded values stay the same.
        quant: the weights' format, ``"mxfp8"`` (default), ``"mxfp4"`` or ``"nvfp4"`` (:mod:`mxport.quants`;
            modelopt and compressed-tensors only). NVFP4's global scale is shared by the tensors vLLM fuses
            (q/k/v, gate/up, one expert's w1/w3), as ModelOpt and llmcompressor share it: one read of those
            tensors before the export computes their amax.
        activation: ``"none"`` (weight-only, default) or ``"nvfp4"`` (W4A4: ModelOpt's ``NVFP4``, with each
            linear's ``input_scale`` calibrated by :mod:`mxport.calibration`; ``quant="nvfp4"``,
            ``fmt="modelopt"``). The model is loaded (or the given module used) for the calibration forwards.
        calibration: token-id batches ``[1, T]`` for ``activation="nvfp4"`` (default:
            :func:`mxport.calibration.calibration_batches`).

    Values/scales are :func:`mxport.quantize` (rceil, rowwise, 1x32 blocks) of the source tensor in its stored
    dtype, byte for byte. Safetensors sources are read in whole-row chunks of :data:`CHUNK_NUMEL` elements, so
    peak memory is a few chunks plus one tensor's scales, whatever the tensor or shard size; in-memory sources
    hold their tensors anyway.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False (checked before any work).
        FileNotFoundError / ValueError / TypeError: bad source, format, dtype, shard size; a weight whose K
            is not whole blocks (32; NVFP4 16) without ``keep_unaligned``; nothing is left behind.
    """
    quant = check_options(fmt, fp8_dtype, quant, activation, nonzero_scales, dtype)
    max_bytes = parse_size(max_shard_size)
    if isinstance(out, (str, os.PathLike)) and isinstance(source, (str, os.PathLike)):
        prepare_out(out, overwrite, Path(source))  # fail fast before loading
    reader = source if isinstance(source, (SafetensorsDir, StateDictSource)) else open_source(source)
    src_dir = getattr(reader, "path", None)
    from_path = Path(source) if isinstance(source, (str, os.PathLike)) else None
    out = prepare_out(out, overwrite, from_path or getattr(reader, "source_path", None) or src_dir)
    config = dict(reader.config or {})

    decisions, kept, excl, outputs = _decide(reader, policy, keep_unaligned, config, quant)
    enc = _Encoding(fmt, fp8_dtype, dtype, nonzero_scales, quant,
                    global_scales(reader, decisions, outputs, quant, fmt),
                    input_scales(reader, decisions, calibration) if activation != "none" else {})
    shards = plan_shards(_output_groups(decisions, outputs, enc), max_bytes)

    with temp_output_dir(out) as tmp:
        writer = ShardedSafetensorsWriter(tmp, shards, metadata={"producer": "mxport", "mxport_format": fmt})
        try:
            in_bytes = _stream(reader, decisions, outputs, writer, enc, progress)
            weight_map = writer.close()
            reader.close()
            copied = _copy_small_files(src_dir, tmp)
            _write_configs(tmp, reader, config, enc, excl)
            os.chmod(tmp, 0o755)
            replace_dir(tmp, out)
        except BaseException:
            writer.abort()
            raise
    files = sorted(set(weight_map.values()) | set(copied) | {p.name for p in out.iterdir()})
    out_bytes = sum(s.nbytes for specs in shards for s in specs)
    renamed = {n: [o[0] for o in outs] for n, outs in outputs.items() if [o[0] for o in outs] != [n]}
    return ExportResult(out, fmt, decisions, files, in_bytes, out_bytes, excl, kept, bool(nonzero_scales),
                        renamed, quant.name, activation)


def _decide(reader, policy, keep_unaligned: bool, config: dict, quant: Quant):
    """``(decisions, kept_unaligned, exclude_modules, outputs)`` of an export: the policy's decisions aligned
    to ``quant``'s blocks, the tied head dropped, and the names each tensor is written under."""
    planned = plan(reader, policy)
    decisions = align_decisions(planned, keep_unaligned, quant)
    kept = [d.name for d, p in zip(decisions, planned, strict=True) if p.quantize and not d.quantize]
    if _tied(config):  # tied embeddings: the head is the embedding, written once
        decisions = [d for d in decisions if d.name != "lm_head.weight"]
    naming = checkpoint_naming(config, [d.name for d in decisions])
    excl = [naming.rename(m) if naming else m for m in exclude_modules(decisions)]
    if _tied(config) and "lm_head" not in excl:  # the engine's head shares the (kept) embedding
        excl.append("lm_head")
    return decisions, kept, excl, _outputs(decisions, naming)


def refuse_split(decisions, outputs, quant: Quant) -> None:
    """ValueError for an NVFP4 export of a fused 3-D expert tensor (written per expert: each expert's w1/w3
    would need a global scale of its own pair)."""
    if not quant.global_scale:
        return
    for d in (d for d in decisions if d.quantize and len(outputs[d.name]) > 1):
        raise ValueError(f"{quant.name} export of fused expert tensors ({d.name}) is not supported; exclude "
                         "the experts (--exclude '*.experts.*') or export them as mxfp8")


def check_dry_run(reader, decisions, quant: Quant | str) -> None:
    """The refusals a real export makes after its decisions, for ``--dry-run`` (:func:`refuse_split`)."""
    naming = checkpoint_naming(reader.config or {}, [d.name for d in decisions])
    refuse_split(decisions, _outputs(decisions, naming), get_quant(quant))


def global_scales(reader, decisions, outputs, quant: Quant, fmt: str = "modelopt"
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """NVFP4: each quantized output tensor's global scale ``(g, stored)``, from the largest magnitude of the
    tensors it shares one with (:func:`mxport.policy.global_scale_group`), read from ``reader`` once: ModelOpt
    stores ``g = amax / (6 * 448)`` (:meth:`~mxport.quants.Quant.global_scale_of`), compressed-tensors the
    divisor ``d`` with ``g = 1 / d`` (:meth:`~mxport.quants.Quant.global_divisor_of`: what vLLM computes from
    it at load is ``g`` exactly). {} for formats without one. A fused 3-D expert tensor (written per expert)
    is refused: its experts' w1/w3 pairs would each need their own shared scale."""
    if not quant.global_scale:
        return {}
    refuse_split(decisions, outputs, quant)
    amax: dict[str, torch.Tensor] = {}
    for d in (d for d in decisions if d.quantize):
        m = max((abs_max(rows) for rows in reader.iter_rows(d.name, CHUNK_NUMEL) if rows.numel()),
                default=torch.tensor(0.0))  # an empty tensor: amax 0, global scale 1
        if not bool(torch.isfinite(m)):
            raise ValueError(f"{d.name}: {quant.name}: x holds NaN or Inf, which E2M1 cannot encode")
        key = global_scale_group(outputs[d.name][0][0])
        amax[key] = torch.maximum(amax.get(key, m), m)
    pair = (quant.global_divisor_of if fmt == "compressed-tensors"
            else lambda a: (quant.global_scale_of(a),) * 2)
    return {outs[0][0]: pair(amax[global_scale_group(outs[0][0])])
            for d in decisions if d.quantize for outs in [outputs[d.name]]}


def input_scales(reader, decisions, calibration=None) -> dict[str, torch.Tensor]:
    """W4A4 NVFP4: each quantized weight's ``input_scale`` (ModelOpt's rule, :mod:`mxport.calibration`) from
    forwards of the model over ``calibration`` batches; the model is the reader's module or loaded from its
    folder in the weights' dtype."""
    from ..calibration import calibration_batches, input_amax, nvfp4_input_scales

    names = [d.name for d in decisions if d.quantize]
    model, tok = getattr(reader, "module", None), None
    if model is None:
        from ..models import load_causal_lm

        dtype = next(d.dtype for d in decisions if d.quantize)
        model, tok = load_causal_lm(reader.path, dtype=dtype, require_tokenizer=False)
    else:
        tok = next((x for x in getattr(reader, "extras", ()) if hasattr(x, "apply_chat_template")), None)
    batches = calibration if calibration is not None else calibration_batches(model, tok)
    scales = nvfp4_input_scales(input_amax(model, [n.removesuffix(".weight") for n in names], batches))
    return {n: scales[n.removesuffix(".weight")] for n in names}


def _write_configs(tmp: Path, reader, config: dict, enc: _Encoding, excl: list[str]) -> None:
    """The reader's extras (tokenizer, generation config), ``config.json`` with ``quantization_config`` and,
    for modelopt, ``hf_quant_config.json``."""
    fmt, dtype = enc.fmt, enc.dtype
    for extra in getattr(reader, "extras", ()):
        extra.save_pretrained(str(tmp))
    act = "nvfp4" if enc.inputs else "none"
    config["quantization_config"] = quantization_config(fmt, excl, enc.fp8_dtype, enc.quant.name, act)
    if dtype is not None:  # transformers < 5 reads torch_dtype, >= 5 writes dtype: update what is there
        for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
            config[key] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    if fmt == "modelopt":
        (tmp / "hf_quant_config.json").write_text(
            json.dumps(hf_quant_config(excl, enc.fp8_dtype, enc.quant.name, act), indent=2) + "\n")


#: elements per chunk: tensors are read, quantized / cast and written in whole-row chunks of about this size
CHUNK_NUMEL = 1 << 22


def _chunks(reader, decisions):
    """``(decision, rows, is_last_chunk_of_the_tensor)`` over every tensor, in order (see ``iter_rows``)."""
    for d in decisions:
        it = reader.iter_rows(d.name, CHUNK_NUMEL)
        cur = next(it)
        for nxt in it:
            yield d, cur, False
            cur = nxt
        yield d, cur, True


@dataclass(frozen=True)
class _Encoding:
    """How tensors are written: checkpoint format, weight format, FP8 element type, the cast of kept floating
    tensors, and each quantized output's global scale (NVFP4, :func:`global_scales`)."""

    fmt: str
    fp8_dtype: torch.dtype
    dtype: torch.dtype | None
    nonzero_scales: bool = False
    quant: Quant = MXFP8
    globals: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name: (g, stored)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # W4A4: weight name -> its input_scale

    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and rows.dtype in FLOAT_DTYPES and rows.dtype != self.dtype:
            return rows.to(self.dtype)
        return rows

    def global_shape(self) -> tuple[int, ...]:
        """ModelOpt writes ``weight_scale_2`` as a 0-d tensor, compressed-tensors ``weight_global_scale`` as
        one element."""
        return () if self.fmt == "modelopt" else (1,)

    def global_tensor(self, name: str) -> torch.Tensor:
        """The stored global scale of output ``name`` (:func:`global_scales`), in the format's shape."""
        return self.globals[name][1].to(torch.float32).reshape(self.global_shape())


class _Router:
    """Sends one source tensor's row chunks to its output tensors, in order: values as they come, a quantized
    output's scales once its last row is in (the planned order: values, then scales, per output)."""

    def __init__(self, d: Decision, outputs: list[tuple[str, int, int]], enc: _Encoding, submit):
        self.d, self.outputs, self.enc, self.submit = d, outputs, enc, submit
        self.i = self.row = 0
        self.scales: list[torch.Tensor] = []

    def feed(self, rows: torch.Tensor, last: bool) -> None:
        if len(self.outputs) == 1:  # the whole tensor (any rank, possibly empty)
            self._part(self.outputs[0][0], rows)
            if last:
                self._finish(self.outputs[0][0])
            return
        n, lo = rows.shape[0], self.row
        while self.i < len(self.outputs):
            name, r0, r1 = self.outputs[self.i]
            if max(r0, lo) < min(r1, lo + n):
                self._part(name, rows[max(r0, lo) - lo: min(r1, lo + n) - lo])
            if r1 > lo + n:
                break
            self._finish(name)
            self.i += 1
        self.row += n

    def _part(self, name: str, rows: torch.Tensor) -> None:
        enc = self.enc
        if not self.d.quantize:
            self.submit(name, enc.kept(rows))
            return
        try:
            q = enc.quant.quantize(rows, fp8_dtype=enc.fp8_dtype, nonzero_scales=enc.nonzero_scales,
                                   global_scale=enc.globals[name][0] if name in enc.globals else None)
        except ValueError as exc:  # say which tensor (NaN / Inf a 4-bit format cannot encode)
            raise ValueError(f"{self.d.name}: {exc}") from None
        self.submit(quant_names(name, enc.fmt, enc.quant.name)[0], q.values)
        self.scales.append(q.scale)

    def _finish(self, name: str) -> None:
        if not self.d.quantize:
            return
        enc = self.enc
        _, scale, glob = quant_names(name, enc.fmt, enc.quant.name)
        for sc in self.scales:
            self.submit(scale, sc)
        self.scales = []
        if glob:
            self.submit(glob, enc.global_tensor(name))
        if name in enc.inputs:
            self.submit(input_scale_name(name), enc.inputs[name].to(torch.float32).reshape(()))


def _stream(reader, decisions, outputs, writer: ShardedSafetensorsWriter, enc: _Encoding, progress) -> int:
    """Read -> quantize / cast -> write, chunk by chunk, with the next chunk's read and the previous chunks'
    writes running on two helper threads (file I/O releases the GIL), so I/O overlaps with quantize.

    Rowwise MX blocks never cross rows, so quantizing whole-row chunks gives the bytes of one ``quantize`` of
    the whole tensor (and of each expert's rows: a fused expert tensor is written per expert, ``outputs``). A
    quantized output's values are streamed; its scales (32x smaller) are written after them. Memory in
    flight: a few chunks. Returns the source bytes read.
    """
    in_bytes = 0
    pending: deque = deque()
    chunks = _chunks(reader, decisions)

    def submit(*args) -> None:
        pending.append(wex.submit(writer.write_part, *args))
        while len(pending) > 2:
            pending.popleft().result()

    with ThreadPoolExecutor(1, thread_name_prefix="mxport-read") as rex, \
            ThreadPoolExecutor(1, thread_name_prefix="mxport-write") as wex:
        router = None
        nxt = rex.submit(next, chunks, None)
        while (item := nxt.result()) is not None:
            nxt = rex.submit(next, chunks, None)
            d, rows, last = item
            if router is None or router.d is not d:
                router = _Router(d, outputs[d.name], enc, submit)
            router.feed(rows, last)
            in_bytes += rows.numel() * rows.element_size()
            if last and progress is not None:
                progress(d.name, in_bytes)
        while pending:
            pending.popleft().result()
    return in_bytes
