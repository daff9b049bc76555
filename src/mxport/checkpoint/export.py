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
from ..components import compact_scale_shape
from ..formats import BLOCK_SIZE, FLOAT_DTYPES, is_fp8_dtype
from ..policy import Decision, PrecisionPolicy, exclude_modules, share_group
from ..quantize import quantize
from .experts import checkpoint_naming
from .naming import DEFAULT_FORMAT, check_fp8_dtype, hf_quant_config, quantization_config, scale_name
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

    def to_dict(self) -> dict:
        return {"out": str(self.out), "format": self.format, "files": self.files,
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
    entries = reader.entries()
    fp8 = [n for n, _, dtype in entries if is_fp8_dtype(dtype)]
    if fp8:
        from ..models import fp8_source_error

        raise fp8_source_error(fp8)
    return (policy or PrecisionPolicy()).decide_all(entries)


#: why a K that is not a multiple of 32 cannot be MXFP8 in a checkpoint, in one line (docs/format.md,
#: "Who refuses a K that is not a multiple of 32")
UNALIGNED_WHY = ("vLLM (modelopt, compressed-tensors), SGLang's MXFP8 kernels and TE take whole blocks of 32 "
                 "along K only")


def unaligned(decisions: list[Decision]) -> list[Decision]:
    """The quantized decisions whose last dimension K is not a multiple of 32."""
    return [d for d in decisions if d.quantize and d.shape[-1] % BLOCK_SIZE]


def align_decisions(decisions: list[Decision], keep_unaligned: bool = False) -> list[Decision]:
    """``decisions`` for a checkpoint every consumer loads: a quantized tensor whose K is not a multiple of 32
    is refused (ValueError naming them) or, with ``keep_unaligned``, kept in its source dtype; a tensor that
    shares one precision with a kept one (:func:`mxport.policy.share_group`: q/k/v, gate/up, one MoE layer's
    experts) is kept with it. Each kept tensor's reason says why."""
    bad = unaligned(decisions)
    if not bad:
        return decisions
    if not keep_unaligned:
        names = ", ".join(f"{d.name} (K={d.shape[-1]})" for d in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"{len(bad)} tensor{'s' if len(bad) > 1 else ''} with K not a multiple of 32 "
                         f"cannot be MXFP8 ({UNALIGNED_WHY}): {names}{more}; pass --keep-unaligned "
                         "(keep_unaligned=True) to keep them in their source dtype")
    why = {d.name: f"kept: K={d.shape[-1]} is not a multiple of 32 (--keep-unaligned)" for d in bad}
    for d in bad:  # its share group (fused by the engine) keeps one precision: kept with it
        group = share_group(d.name)
        if group:
            why.setdefault(group[0], f"kept: {group[1]} share one precision ({d.name}: K={d.shape[-1]} "
                                     "is not a multiple of 32, --keep-unaligned)")
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


def _output_groups(decisions, outputs, fmt, fp8_dtype, dtype) -> list[list[TensorSpec]]:
    groups = []
    for d in decisions:
        for name, r0, r1 in outputs[d.name]:
            shape = d.shape if len(outputs[d.name]) == 1 else (r1 - r0, d.shape[-1])
            if d.quantize:
                groups.append([TensorSpec(name, fp8_dtype, shape),
                               TensorSpec(scale_name(name, fmt), torch.uint8, compact_scale_shape(shape))])
            else:
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


def export_checkpoint(source, out: str | os.PathLike, *, fmt: str = DEFAULT_FORMAT,
                      fp8_dtype: torch.dtype = torch.float8_e4m3fn, policy: PrecisionPolicy | None = None,
                      dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB",
                      overwrite: bool = False,
                      progress: Callable[[str, int], None] | None = None, keep_unaligned: bool = False,
                      nonzero_scales: bool = False) -> ExportResult:
    """Export ``source`` as an MXFP8 checkpoint in format ``fmt`` at ``out``.

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

    Values/scales are :func:`mxport.quantize` (rceil, rowwise, 1x32 blocks) of the source tensor in its stored
    dtype, byte for byte. Safetensors sources are read in whole-row chunks of :data:`CHUNK_NUMEL` elements, so
    peak memory is a few chunks plus one tensor's scales, whatever the tensor or shard size; in-memory sources
    hold their tensors anyway.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False (checked before any work).
        FileNotFoundError / ValueError / TypeError: bad source, format, dtype, shard size; a tensor to
            quantize whose K is not a multiple of 32 without ``keep_unaligned``; nothing is left behind.
    """
    check_fp8_dtype(fmt, fp8_dtype)
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    if isinstance(out, (str, os.PathLike)) and isinstance(source, (str, os.PathLike)):
        prepare_out(out, overwrite, Path(source))  # fail fast before loading
    reader = source if isinstance(source, (SafetensorsDir, StateDictSource)) else open_source(source)
    src_dir = getattr(reader, "path", None)
    from_path = Path(source) if isinstance(source, (str, os.PathLike)) else None
    out = prepare_out(out, overwrite, from_path or getattr(reader, "source_path", None) or src_dir)
    config = dict(reader.config or {})

    planned = plan(reader, policy)
    decisions = align_decisions(planned, keep_unaligned)
    kept = [d.name for d, p in zip(decisions, planned, strict=True) if p.quantize and not d.quantize]
    if _tied(config):  # tied embeddings: the head is the embedding, written once
        decisions = [d for d in decisions if d.name != "lm_head.weight"]
    naming = checkpoint_naming(config, [d.name for d in decisions])
    excl = [naming.rename(m) if naming else m for m in exclude_modules(decisions)]
    if _tied(config) and "lm_head" not in excl:  # the engine's head shares the (kept) embedding
        excl.append("lm_head")
    outputs = _outputs(decisions, naming)
    shards = plan_shards(_output_groups(decisions, outputs, fmt, fp8_dtype, dtype), max_bytes)

    with temp_output_dir(out) as tmp:
        writer = ShardedSafetensorsWriter(tmp, shards, metadata={"producer": "mxport", "mxport_format": fmt})
        try:
            in_bytes = _stream(reader, decisions, outputs, writer, _Encoding(fmt, fp8_dtype, dtype,
                                                                             nonzero_scales), progress)
            weight_map = writer.close()
            reader.close()
            copied = _copy_small_files(src_dir, tmp)
            _write_configs(tmp, reader, config, fmt, excl, fp8_dtype, dtype)
            os.chmod(tmp, 0o755)
            replace_dir(tmp, out)
        except BaseException:
            writer.abort()
            raise
    files = sorted(set(weight_map.values()) | set(copied) | {p.name for p in out.iterdir()})
    out_bytes = sum(s.nbytes for specs in shards for s in specs)
    renamed = {n: [o[0] for o in outs] for n, outs in outputs.items() if [o[0] for o in outs] != [n]}
    return ExportResult(out, fmt, decisions, files, in_bytes, out_bytes, excl, kept, bool(nonzero_scales),
                        renamed)


def _write_configs(tmp: Path, reader, config: dict, fmt: str, excl: list[str], fp8_dtype: torch.dtype,
                   dtype: torch.dtype | None) -> None:
    """The reader's extras (tokenizer, generation config), ``config.json`` with ``quantization_config`` and,
    for modelopt, ``hf_quant_config.json``."""
    for extra in getattr(reader, "extras", ()):
        extra.save_pretrained(str(tmp))
    config["quantization_config"] = quantization_config(fmt, excl, fp8_dtype)
    if dtype is not None:  # transformers < 5 reads torch_dtype, >= 5 writes dtype: update what is there
        for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
            config[key] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    if fmt == "modelopt":
        (tmp / "hf_quant_config.json").write_text(
            json.dumps(hf_quant_config(excl, fp8_dtype), indent=2) + "\n")


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
    """How tensors are written: checkpoint format, FP8 element type, the cast of kept floating tensors."""

    fmt: str
    fp8_dtype: torch.dtype
    dtype: torch.dtype | None
    nonzero_scales: bool = False

    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and rows.dtype in FLOAT_DTYPES and rows.dtype != self.dtype:
            return rows.to(self.dtype)
        return rows


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
        if not self.d.quantize:
            self.submit(name, self.enc.kept(rows))
            return
        c = quantize(rows, self.enc.fp8_dtype, nonzero_scales=self.enc.nonzero_scales)
        self.submit(name, c.data)
        self.scales.append(c.scale_inv)

    def _finish(self, name: str) -> None:
        for sc in self.scales:
            self.submit(scale_name(name, self.enc.fmt), sc)
        self.scales = []


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
