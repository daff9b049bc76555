"""Readers: a model's tensors one at a time, their names, shapes and dtypes known before any data is read.

* :class:`SafetensorsDir` — a Hugging Face model directory (``*.safetensors``, sharded with
  ``model.safetensors.index.json``) or a single ``.safetensors`` file. Every header is checked by the
  ``safetensors`` library (``safe_open``: offsets contiguous and covering the file, each shape matching its
  byte range, bounded JSON), so entries come in file order without reading data; :meth:`SafetensorsDir.get`
  and :meth:`SafetensorsDir.iter_rows` read a tensor, or rows of it, through the library too
  (``get_tensor`` / ``get_slice`` with its ``pread`` backend: no memory map).
* :class:`StateDictSource` — an ``nn.Module`` or a state dict in memory (GGUF files come in this way, through
  :func:`mxport.models.load_causal_lm`).
* :func:`open_checkpoint` — an MXFP8 (or plain) checkpoint read back as ``(name, MXFP8Components | Tensor)``:
  values and scales paired under the values' name.

Trust nothing on disk: only regular files inside the checkpoint folder are opened (a FIFO, a device, a
directory named ``*.safetensors`` or a symlink leading out of the folder is refused before it is opened, so
nothing blocks), an index must name plain files of the folder and agree with the shards' headers, JSON files
must be objects of bounded size and depth. Every problem is a :class:`CheckpointError` (a ValueError) naming
the file.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..components import MXFP8Components, compact_scale_shape
from ..formats import SAFETENSORS_DTYPES, is_fp8_dtype
from .naming import FORMATS, SCALE_SUFFIX, declared_fp8, detect_format

#: safetensors dtype names <-> torch dtypes (the ones mxport reads and writes)
ST_TO_TORCH = SAFETENSORS_DTYPES
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}

INDEX_NAME = "model.safetensors.index.json"
_MAX_JSON = 64 * 2**20
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


class CheckpointError(ValueError):
    """A checkpoint file or folder that cannot be read safely or correctly; the message names the file."""


def st_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string for ``dtype`` (``torch.bfloat16`` -> "BF16"); ValueError if none."""
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype} (safetensors dtypes: {sorted(ST_TO_TORCH)})") from None


# -- files: regular, inside the folder -----------------------------------------------------------------------
def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _roots(folder: Path) -> list[Path]:
    """Where files of ``folder`` may lead: the folder itself, and for a Hugging Face hub snapshot
    (``<repo>/snapshots/<rev>``) the repo's ``blobs`` folder its symlinks point into."""
    root = folder.resolve()
    return [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])


def check_regular_file(path: Path, roots: list[Path] | None = None) -> Path:
    """``path`` itself when it is a regular file (following symlinks) that, with ``roots``, resolves inside
    one of them; CheckpointError otherwise (FIFOs and devices are refused without being opened)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{str(path)!r} is {_kind(st.st_mode)}, not a regular file")
    if roots is not None:
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(r) for r in roots):
            raise CheckpointError(f"{str(path)!r} leads to {str(real)!r}, outside the checkpoint folder")
    return path


def _open_regular(path: Path):
    """A binary file object for regular file ``path`` (opened non-blocking, checked again once open)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{str(path)!r} is not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def read_json(path: Path, roots: list[Path] | None = None) -> dict:
    """A JSON object from regular file ``path`` (at most 64 MiB); CheckpointError for anything else (not JSON,
    nested too deeply, not an object)."""
    check_regular_file(path, roots)
    with _open_regular(path) as f:
        raw = f.read(_MAX_JSON + 1)
    if len(raw) > _MAX_JSON:
        raise CheckpointError(f"{str(path)!r}: larger than {_MAX_JSON} bytes; not a config file")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise CheckpointError(f"corrupt {path.name} in {str(path.parent)!r}: "
                              f"not valid JSON ({reason})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"corrupt {path.name} in {str(path.parent)!r}: expected a JSON object, got "
                              f"{type(data).__name__}")
    return data


# -- safetensors headers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file as its (checked) header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_TO_TORCH[self.dtype]


def _safe_open(file: Path):
    """``safe_open`` with plain reads (``pread``), not a memory map: pages of a mapped shard would count in
    the process's resident memory until the shard is closed, so peak memory would grow with the shard
    size."""
    from safetensors import safe_open

    return safe_open(str(file), framework="pt", backend="pread")


def read_header(file: str | os.PathLike, roots: list[Path] | None = None) -> dict:
    """Check a ``.safetensors`` file with the ``safetensors`` library and return its header:
    ``{name: {"dtype", "shape", "data_offsets"}}`` (file order) plus ``__metadata__``.

    Raises CheckpointError naming the file when it is not a regular file (inside ``roots``), when
    ``safetensors`` refuses it (truncated, header too large, not JSON or nested too deeply, offsets
    overlapping, out of range or not covering the data, a shape whose bytes differ from its offsets, negative
    sizes), or for a dtype mxport does not read.
    """
    file = check_regular_file(Path(file), roots)
    try:
        with _safe_open(file) as f:
            meta = f.metadata()
            specs = [(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.offset_keys()]
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the library's own words, with the file
        reason = str(exc).removeprefix("Error while deserializing header: ")
        raise CheckpointError(f"corrupt safetensors header in {str(file)!r}: {reason}") from None
    _check_unique_keys(file)
    header: dict = {"__metadata__": meta} if meta is not None else {}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in ST_TO_TORCH:
            raise CheckpointError(f"unsupported dtype {dtype!r} of tensor {name!r} in {str(file)!r}; "
                                  f"mxport reads {sorted(ST_TO_TORCH)}")
        n = ST_TO_TORCH[dtype].itemsize * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + n]}
        offset += n  # safetensors checked that the offsets are contiguous and each range fits its shape
    return header


def _no_duplicates(pairs: list[tuple]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise CheckpointError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def _check_unique_keys(file: Path) -> None:
    """Refuse a header naming one key twice (JSON leaves it to the reader which one wins): ``safetensors``
    keeps one silently. Reads the header again, already checked by ``safetensors`` (bounded size and
    depth)."""
    with _open_regular(file) as f:
        raw = f.read(_data_start(f) - 8)  # the file is at byte 8 now
    try:
        json.loads(raw, object_pairs_hook=_no_duplicates)
    except CheckpointError as exc:
        raise CheckpointError(f"corrupt safetensors header in {str(file)!r}: {exc}") from None


def _data_start(f) -> int:
    """Byte offset of a safetensors file's data section (8 + header length), from an open file."""
    f.seek(0)
    return 8 + struct.unpack("<Q", f.read(8))[0]


def _plain_shard_name(name) -> bool:
    return (isinstance(name, str) and name.endswith(".safetensors") and name == Path(name).name
            and "/" not in name and "\\" not in name and name not in (".", ".."))


def _index_shards(p: Path, roots: list[Path]) -> tuple[list[Path], dict[str, str]]:
    """The shard files ``model.safetensors.index.json`` names, in order, and its weight map; CheckpointError
    for a malformed index, a shard outside the folder or missing, a ``*.safetensors`` file of the folder it
    omits."""
    index = read_json(p / INDEX_NAME, roots)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"corrupt {INDEX_NAME} in {str(p)!r}: 'weight_map' must be a non-empty "
                              f"object of tensor name -> shard file, got {type(weight_map).__name__}")
    bad = [v for v in weight_map.values() if not _plain_shard_name(v)]
    if bad:
        raise CheckpointError(f"{INDEX_NAME} in {str(p)!r} names {bad[0]!r}: shards must be "
                              "*.safetensors files of the checkpoint folder itself")
    names = list(dict.fromkeys(weight_map.values()))
    missing = [n for n in names if not os.path.lexists(p / n)]
    if missing:
        raise CheckpointError(f"{INDEX_NAME} in {str(p)!r} names missing shard(s) {missing}")
    # Mistral repos keep a consolidated.safetensors copy in their own naming next to the HF shards
    omitted = sorted(f.name for f in p.glob("*.safetensors") if f.name not in weight_map.values()
                     and not f.name.startswith("consolidated"))
    if omitted:
        raise CheckpointError(f"{INDEX_NAME} in {str(p)!r} omits shard(s) {omitted} of the folder: "
                              "their tensors would be dropped")
    return [p / n for n in names], weight_map


def _check_index(p: Path, weight_map: dict[str, str], headers: dict[Path, dict]) -> None:
    """Each shard's header holds exactly the tensors the index maps to it."""
    for f, header in headers.items():
        have = {k for k in header if k != "__metadata__"}
        want = {k for k, v in weight_map.items() if v == f.name}
        if have - want:
            raise CheckpointError(f"{INDEX_NAME} in {str(p)!r} omits tensor(s) {sorted(have - want)[:5]} of "
                                  f"{f.name}")
        if want - have:
            raise CheckpointError(f"{INDEX_NAME} in {str(p)!r} maps tensor(s) {sorted(want - have)[:5]} to "
                                  f"{f.name}, which does not hold them")


class SafetensorsDir:
    """A model directory (or one ``.safetensors`` file) read one tensor at a time.

    Attributes:
        path: the directory (for a single file: its folder).
        files: the shard files in order (index order, or sorted names).
        config: ``config.json`` as a dict ({} when absent).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError (a ValueError): no ``*.safetensors`` in the directory; a shard, index or config that
            is not a regular file inside the folder; an index naming a missing shard, a file outside the
            folder, omitting a shard or a tensor; a corrupt header; an unsupported dtype; a tensor name in two
            shards.
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path).expanduser()
        try:
            mode = os.stat(p).st_mode
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint path {str(p)!r} does not exist") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint path {str(p)!r}: {exc.strerror or exc}") from None
        weight_map = None
        roots: list[Path] | None = None
        if stat.S_ISDIR(mode):
            self.path, roots = p, _roots(p)
            if os.path.lexists(p / INDEX_NAME):
                self.files, weight_map = _index_shards(p, roots)
            else:
                self.files = sorted(p.glob("*.safetensors"))
            if not self.files:
                raise CheckpointError(f"no model found in {str(p)!r}: no *.safetensors files")
        elif stat.S_ISREG(mode):
            if p.suffix != ".safetensors":
                raise CheckpointError(f"{str(p)!r} is not a .safetensors file or a model directory")
            self.path, self.files = p.parent, [p]
        else:
            raise CheckpointError(f"checkpoint path {str(p)!r} is {_kind(mode)}, not a model directory or a "
                                  ".safetensors file")
        cfg = self.path / "config.json"
        self.config: dict = read_json(cfg, roots) if roots is not None and os.path.lexists(cfg) else {}
        self._roots = roots
        headers = {f: read_header(f, roots) for f in self.files}
        if weight_map is not None:
            _check_index(p, weight_map, headers)
        self._info: dict[str, TensorInfo] = {}
        self._entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.st_dtypes: dict[str, str] = {}
        for f, header in headers.items():
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self._info:
                    raise CheckpointError(f"tensor {name!r} appears in two shards "
                                          f"({self._info[name].file.name}, {f.name})")
                ti = TensorInfo(f, info["dtype"], tuple(info["shape"]), *info["data_offsets"])
                self._info[name] = ti
                self.st_dtypes[name] = ti.dtype
                self._entries.append((name, ti.shape, ti.torch_dtype))
        self._handle = None
        self._handle_file: Path | None = None

    @property
    def label(self) -> str:
        return str(self.path)

    def entries(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, shape, dtype)`` of every tensor, shard by shard in file order (no data read)."""
        return list(self._entries)

    def names(self) -> list[str]:
        return [e[0] for e in self._entries]

    def nbytes(self, name: str) -> int:
        info = self._info[name]
        return info.end - info.begin

    def file_of(self, name: str) -> Path:
        return self._info[name].file

    def read_json(self, name: str) -> dict | None:
        """Another JSON file of the checkpoint folder (``hf_quant_config.json``), checked as ``config.json``;
        None when absent (or when this reader is a single file)."""
        f = self.path / name
        if self._roots is None or not os.path.lexists(f):
            return None
        return read_json(f, self._roots)

    def _info_of(self, name: str) -> TensorInfo:
        if name not in self._info:
            raise KeyError(f"no tensor {name!r} in {self.label}")
        return self._info[name]

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` into a new CPU tensor of its stored dtype. KeyError for an unknown name."""
        self._info_of(name)
        return self._read(name)

    def _read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name``, or its rows ``[r0, r1)`` of the ``(M, K)`` view, read by safetensors from its
        open shard and checked to have that shape in the stored dtype; CheckpointError naming the file when
        the read fails (the file changed after its header was checked)."""
        info = self._info[name]
        shape = info.shape if rows is None else (rows[1] - rows[0], info.shape[-1])
        if self._handle_file != info.file:
            self.close()
            self._handle = _safe_open(check_regular_file(info.file, self._roots))
            self._handle_file = info.file
        try:
            t = (self._handle.get_tensor(name) if rows is None else
                 _rows(self._handle.get_slice(name), info.shape, *rows))
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: named, with the file
            raise CheckpointError(f"corrupt safetensors file {str(info.file)!r}: reading {name!r} failed "
                                  f"({exc}; the file changed after it was opened?)") from None
        if t.dtype != info.torch_dtype or tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"corrupt safetensors file {str(info.file)!r}: {name!r} read as "
                                  f"{tuple(t.shape)} {t.dtype}, its header says {tuple(shape)} "
                                  f"{info.torch_dtype}")
        return t

    def iter_rows(self, name: str, chunk_numel: int) -> Iterator[torch.Tensor]:
        """Tensor ``name`` as consecutive whole rows of its ``(M, K)`` view (K = last dimension), about
        ``chunk_numel`` elements per chunk, each read from the file on its own (memory: one chunk)."""
        info = self._info_of(name)
        shape = info.shape
        k = shape[-1] if shape else 1
        m = math.prod(shape[:-1])
        if len(shape) < 2 or k == 0 or m == 0:  # 0-d, 1-D, empty: one piece as it is
            yield self.get(name)
            return
        step = max(1, chunk_numel // k)
        for r0 in range(0, m, step):
            yield self._read(name, (r0, min(m, r0 + step)))

    def close(self) -> None:
        """Close the open shard file (reading again reopens it)."""
        if getattr(self, "_handle", None) is not None:
            self._handle.__exit__(None, None, None)
        self._handle = None
        self._handle_file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def _row_index(lead: tuple[int, ...], r0: int, r1: int) -> list[tuple]:
    """Index tuples (ints, then one slice) that select rows ``[r0, r1)`` (``r0 < r1``) of a row-major array
    whose leading dimensions are ``lead``, in order: the rows' range cut where it crosses a leading index."""
    if len(lead) == 1:
        return [(slice(r0, r1),)]
    inner = math.prod(lead[1:])
    out: list[tuple] = []
    if r0 % inner:  # a part of index r0 // inner
        i, stop = r0 // inner, min(r1, (r0 // inner + 1) * inner)
        out += [(i, *ix) for ix in _row_index(lead[1:], r0 - i * inner, stop - i * inner)]
        r0 = stop
    if r0 < r1 and r0 // inner < r1 // inner:  # whole indices
        out.append((slice(r0 // inner, r1 // inner),))
    if r0 < r1 and r1 % inner:  # a part of index r1 // inner
        i = r1 // inner
        out += [(i, *ix) for ix in _row_index(lead[1:], max(r0, i * inner) - i * inner, r1 - i * inner)]
    return out


def _rows(piece, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of the ``(M, K)`` view of a tensor of ``shape``, read through its safetensors slice
    ``piece`` (one read per leading index the range crosses)."""
    parts = [piece[ix].reshape(-1, shape[-1]) for ix in _row_index(shape[:-1], r0, r1)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class StateDictSource:
    """An in-memory state dict (or ``nn.Module``) with the same interface as :class:`SafetensorsDir`.

    Args:
        obj: ``nn.Module`` (its ``state_dict()``; ``model.config`` is used when present) or a ``dict`` of
            tensors.
        config: config dict (defaults to ``obj.config.to_dict()`` for a transformers model, else {}).
        extras: objects with ``save_pretrained(dir)`` (tokenizer, generation config) written next to the
            weights.

    With ``tie_word_embeddings`` in the config, ``lm_head.weight`` is dropped (written once, as the
    embedding), as ``save_pretrained`` does.
    """

    def __init__(self, obj, *, config: dict | None = None, extras=(), label: str = "state dict"):
        if isinstance(obj, torch.nn.Module):
            if config is None and hasattr(obj, "config") and hasattr(obj.config, "to_dict"):
                config = obj.config.to_dict()
            state = obj.state_dict()
        elif isinstance(obj, dict):
            state = obj
        else:
            raise TypeError(f"source must be an nn.Module, a state dict, or a path; got {type(obj).__name__}")
        for k, v in state.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                raise TypeError("state dict entries must be str -> torch.Tensor, "
                                f"got {k!r}: {type(v).__name__}")
        self.config = dict(config or {})
        self.path = None
        self.module = obj if isinstance(obj, torch.nn.Module) else None  # what calibration runs
        self.extras = tuple(extras)
        self.label = label
        self._state = {k: v for k, v in state.items()
                       if not (k == "lm_head.weight" and self.config.get("tie_word_embeddings"))}

    def entries(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(k, tuple(v.shape), v.dtype) for k, v in self._state.items()]

    def names(self) -> list[str]:
        return list(self._state)

    def nbytes(self, name: str) -> int:
        t = self._state[name]
        return t.numel() * t.element_size()

    def get(self, name: str) -> torch.Tensor:
        return self._state[name].detach().to("cpu")

    def iter_rows(self, name: str, chunk_numel: int) -> Iterator[torch.Tensor]:
        """Consecutive whole rows of the tensor's ``(M, K)`` view, about ``chunk_numel`` elements each."""
        t = self.get(name)
        if t.dim() < 2 or t.numel() == 0:  # 0-d, 1-D, empty: one piece as it is
            yield t
            return
        k = t.shape[-1]
        rows = t.reshape(-1, k)
        step = max(1, chunk_numel // k)
        for r0 in range(0, rows.shape[0], step):
            yield rows[r0:r0 + step]

    def close(self) -> None:
        pass


def _pair_names(names: list[str], dtypes: dict[str, torch.dtype], fmt: str | None) -> dict[str, str]:
    """values name -> scale name for every FP8 tensor that has a scale (``<values>_scale`` /
    ``<values>_scale_inv``)."""
    suffixes = [SCALE_SUFFIX[fmt]] if fmt else list(dict.fromkeys(SCALE_SUFFIX.values()))
    present = set(names)
    pairs = {}
    for n in names:
        if not is_fp8_dtype(dtypes[n]):
            continue
        for s in suffixes:
            if n + s in present:
                pairs[n] = n + s
                break
    return pairs


def format_by_names(names: list[str], dtypes: dict[str, torch.dtype]) -> str | None:
    """Guess the format from tensor names when the config says nothing: FP8 values with ``_scale_inv`` scales
    -> "sglang"; with ``_scale`` scales -> "modelopt" (compressed-tensors uses the same names); no pairs ->
    None."""
    pairs = _pair_names(names, dtypes, None)
    if not pairs:
        return None
    if any(s.endswith("_scale_inv") for s in pairs.values()):
        return "sglang"
    return "modelopt"


def read_quant_config(d: SafetensorsDir) -> dict | None:
    """The checkpoint's quantization description: ``config.json`` ``quantization_config`` or, failing that,
    ``hf_quant_config.json``; None if neither. CheckpointError when either is there but not a JSON object."""
    qc = d.config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise CheckpointError(f"corrupt config.json in {d.label!r}: quantization_config must be an "
                                  f"object, got {type(qc).__name__}")
        return qc
    return d.read_json("hf_quant_config.json")


@dataclass(frozen=True)
class QuantDescription:
    """What the files say about quantization: the config (or None), the format (one of FORMATS or None), where
    the format came from ("config" | "names" | None) and the FP8 element the config declares (None: not
    declared)."""

    config: dict | None
    format: str | None
    source: str | None
    declared: torch.dtype | None


def describe_quantization(d: SafetensorsDir) -> QuantDescription:
    """:class:`QuantDescription` of ``d``: from ``quantization_config`` / ``hf_quant_config.json``, else the
    format guessed from the scale names. CheckpointError for a malformed quantization config."""
    qc = read_quant_config(d)
    try:
        fmt = detect_format(qc)
        declared = declared_fp8(fmt, qc)
    except ValueError as exc:
        where = ("config.json quantization_config" if "quantization_config" in d.config
                 else "hf_quant_config.json")
        raise CheckpointError(f"corrupt {where} in {d.label!r}: {exc}") from None
    if fmt is not None:
        return QuantDescription(qc, fmt, "config", declared)
    entries = d.entries()
    guess = format_by_names([n for n, _, _ in entries], {n: t for n, _, t in entries})
    return QuantDescription(qc, guess, "names" if guess else None, None)


# -- pairing values and scales, and what can be wrong with them ----------------------------------------------
_ALL_SUFFIXES = ("_scale_inv", "_scale")


def dtype_str(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _scale_owner(name: str, present: set[str]) -> tuple[str, str] | None:
    """(values name, suffix) when ``name`` is named like a scale: ``X_scale_inv`` / ``X_scale`` with ``X``
    present, or ``*.weight_scale(_inv)`` regardless of ``X``."""
    for suf in _ALL_SUFFIXES:
        if name.endswith(suf):
            base = name[: -len(suf)]
            if base in present or base.endswith(".weight"):
                return base, suf
    return None


@dataclass(frozen=True)
class PairAnalysis:
    """Roles of a checkpoint's tensors from their names, dtypes and shapes alone (no data read).

    Attributes:
        roles: name -> "values" | "scales" | "kept".
        pair_of: values name -> scale name.
        bad: values names whose scale has the wrong dtype or shape (their data cannot be decoded).
        problems / warnings: one-line descriptions (see :mod:`mxport.checkpoint.inspect`).
    """

    roles: dict[str, str]
    pair_of: dict[str, str]
    bad: frozenset[str]
    problems: tuple[str, ...]
    warnings: tuple[str, ...]


def _find_scales(names, dtypes, fmt, problems) -> tuple[dict[str, str], dict[str, str]]:
    """(roles, pair_of) of the scale-named tensors; name problems appended to ``problems``."""
    present = set(names)
    roles = {n: "kept" for n in names}
    pair_of: dict[str, str] = {}
    for n in names:  # scales first: names like X_scale whose X exists, or *.weight_scale(_inv)
        owner = _scale_owner(n, present)
        if owner is None:
            continue
        base, suf = owner
        if base not in present:
            roles[n] = "scales"
            problems.append(f"{n}: scale without values (no tensor {base!r})")
            continue
        if not is_fp8_dtype(dtypes[base]):
            if dtypes[n] == torch.uint8:
                roles[n] = "scales"
                problems.append(f"{n}: scale for {base!r}, which is {dtype_str(dtypes[base])}, "
                                "not FP8 values")
            continue
        roles[n] = "scales"
        if base in pair_of:
            problems.append(f"{base}: two scale tensors ({pair_of[base]!r} and {n!r})")
            continue
        pair_of[base] = n
        if fmt in FORMATS and suf != SCALE_SUFFIX[fmt]:
            problems.append(f"{n}: scale name does not follow format {fmt!r} "
                            f"(expected {base + SCALE_SUFFIX[fmt]!r})")
    return roles, pair_of


def _scale_header_problems(base, sname, shape, sshape, sdt, problems, warnings) -> bool:
    """Check one pair's scale dtype and shape against its values; True when it can be decoded."""
    ok = True
    if sdt not in (torch.uint8, _E8M0 or torch.uint8):
        problems.append(f"{sname}: scale stored as {dtype_str(sdt)}; "
                        "expected uint8 E8M0 bytes (bit patterns, not values)")
        ok = False
    elif sdt != torch.uint8:
        warnings.append(f"{sname}: float8_e8m0fnu scale (same bytes as uint8; engines expect U8)")
    want = compact_scale_shape(shape) if shape else None
    if want is None or tuple(sshape) != tuple(want):
        hint = ""
        if want is not None and len(sshape) == 2 and sshape[0] % 128 == 0 and sshape[1] % 4 == 0 and (
                sshape[0] >= want[0] and sshape[-1] >= want[-1]):
            hint = " (looks padded to 128x4 as TE stores it: slice it to the compact shape)"
        problems.append(f"{sname}: scale shape {list(sshape)} for values {list(shape)}; expected compact "
                        f"{list(want) if want else '?'}{hint}")
        ok = False
    return ok


def analyse_pairs(entries: list[tuple[str, tuple[int, ...], torch.dtype]], fmt: str | None,
                  declared: torch.dtype | None = None) -> PairAnalysis:
    """Pair FP8 values with their scales by name and check everything the headers tell: values without a
    scale, a scale without values or for non-FP8 values, two scales for one tensor, a scale name that does not
    follow ``fmt``, values of another FP8 element than ``declared`` (the quantization config's), a scale that
    is not uint8 E8M0 or not compact."""
    names = [n for n, _, _ in entries]
    shapes = {n: s for n, s, _ in entries}
    dtypes = {n: t for n, _, t in entries}
    problems: list[str] = []
    warnings: list[str] = []
    roles, pair_of = _find_scales(names, dtypes, fmt, problems)
    for n in names:
        if is_fp8_dtype(dtypes[n]):
            roles[n] = "values"
            if n not in pair_of:
                want = n + SCALE_SUFFIX[fmt] if fmt in FORMATS else f"{n}_scale or {n}_scale_inv"
                problems.append(f"{n}: FP8 values without a scale (expected {want})")
            if declared is not None and dtypes[n] != declared:
                problems.append(f"{n}: {dtype_str(dtypes[n])} values, but the quantization config of format "
                                f"{fmt!r} declares {dtype_str(declared)}")
    bad = set()
    for base, sname in pair_of.items():
        if not _scale_header_problems(base, sname, shapes[base], shapes[sname], dtypes[sname],
                                      problems, warnings):
            bad.add(base)
    return PairAnalysis(roles, pair_of, frozenset(bad), tuple(problems), tuple(warnings))


def data_problems(c: MXFP8Components, scale_name: str, values_name: str) -> tuple[list[str], list[str]]:
    """(problems, warnings) of one decoded pair's bytes: NaN scale bytes (E = 255); NaN / Inf FP8 values;
    every scale byte 0 (2**-127) while the values are not all zero (scales never written); an all-zero weight
    is only a warning."""
    problems, warnings = [], []
    e = c.scale_inv
    nan = int((e == 255).sum())
    if nan:
        problems.append(f"{scale_name}: {nan} NaN scale byte(s) (E = 255)")
    bits = c.data.view(torch.uint8)
    # E4M3 (fn): S.1111.111 is NaN, there is no Inf; E5M2: exponent 11111 is Inf or NaN. quantize saturates:
    # neither ever comes out of it for finite input.
    bad = (bits & 0x7F) == 0x7F if c.fp8_dtype == torch.float8_e4m3fn else (bits & 0x7C) == 0x7C
    n_bad = int(bad.sum())
    if n_bad:
        problems.append(f"{values_name}: {n_bad} NaN/Inf FP8 value(s)")
    if e.numel() and bool((e == 0).all()):
        if bool(((c.data.view(torch.uint8) & 0x7F) != 0).any()):
            problems.append(f"{scale_name}: every scale byte is 0 (2**-127) but the values are not zero: "
                            "scales never written?")
        else:
            warnings.append(f"{values_name}: an all-zero weight (values and scales all 0)")
    return problems, warnings


def _first(problems, path) -> str:
    more = f" (and {len(problems) - 1} more problem(s); see `mxport inspect`)" if len(problems) > 1 else ""
    return f"checkpoint {str(path)!r}: {problems[0]}{more}"


def _refuse_fp4(d: SafetensorsDir, q: QuantDescription, path) -> None:
    """A 4-bit checkpoint (by its config or, without one, by its tensors) is not read as MXFP8: say so."""
    from .fp4_pairs import fp4_by_names
    from .naming import detect_fp4

    found = detect_fp4(q.config) or (fp4_by_names(d.entries()) if q.format is None else None)
    if found:
        raise CheckpointError(f"checkpoint {str(path)!r} holds {found[1].upper()} weights ({found[0]}): "
                              "`mxport inspect` reads it; this reads MXFP8 checkpoints (for 4-bit fidelity, "
                              f"`mxport verify --quant {found[1]}` on the source model)")


class CheckpointReader:
    """An exported MXFP8 checkpoint (one of :data:`~mxport.checkpoint.naming.FORMATS`) or a plain HF folder.

    Opening checks the files (see :class:`SafetensorsDir`) and every values/scale pair's names, dtypes and
    shapes (:func:`analyse_pairs`): FP8 values without a scale, values of another element type than the
    quantization config declares (E4M3 bytes stored as ``F8_E5M2``), a padded or non-uint8 scale, a config
    that declares MXFP8 over files without one pair are each a :class:`CheckpointError`. Reading a pair checks
    its bytes (:func:`data_problems`: NaN scales, scales never written).

    Attributes:
        format: "modelopt" | "compressed-tensors" | "sglang" (from the config's quantization_config or
            hf_quant_config.json, else guessed from scale tensor names), or None for an unquantized
            checkpoint.
        config: ``config.json`` as a dict.
    """

    def __init__(self, path: str | os.PathLike):
        self._dir = SafetensorsDir(path)
        try:
            self.path = self._dir.path
            self.config = self._dir.config
            q = describe_quantization(self._dir)
            self.format = q.format
            _refuse_fp4(self._dir, q, path)
            a = analyse_pairs(self._dir.entries(), q.format, q.declared)
            if a.problems:
                raise CheckpointError(_first(a.problems, path))
            if q.source == "config" and not a.pair_of:
                raise CheckpointError(f"checkpoint {str(path)!r}: the config declares {q.format!r} MXFP8 "
                                      "quantization but no FP8 values/scale pair is in the files")
        except BaseException:
            self._dir.close()
            raise
        self._pairs = a.pair_of
        self._scales = set(self._pairs.values())

    def names(self) -> list[str]:
        """Names :meth:`iter_tensors` yields (values names for MXFP8 pairs; scale names are folded in)."""
        return [n for n in self._dir.names() if n not in self._scales]

    def scale_name_of(self, name: str) -> str | None:
        """The scale tensor's name for values ``name`` (None for a kept tensor)."""
        return self._pairs.get(name)

    def get(self, name: str) -> MXFP8Components | torch.Tensor:
        """One entry of :meth:`iter_tensors` by name. CheckpointError for a pair whose bytes are wrong."""
        if name not in self._pairs:
            return self._dir.get(name)
        sname = self._pairs[name]
        scale = self._dir.get(sname)
        c = MXFP8Components(self._dir.get(name), scale.view(torch.uint8) if scale.dtype == _E8M0 else scale,
                            "rowwise")
        problems, _ = data_problems(c, sname, name)
        if problems:
            raise CheckpointError(f"{str(self._dir.file_of(sname))!r}: {problems[0]}")
        return c

    def iter_tensors(self) -> Iterator[tuple[str, MXFP8Components | torch.Tensor]]:
        """Yield ``(name, value)`` in file order: ``MXFP8Components`` (rowwise, compact uint8 scales; 3-D
        expert values give scales ``[E, N, ceil(K/32)]``) for each values/scale pair, plain tensors for the
        rest."""
        for name in self.names():
            yield name, self.get(name)

    def close(self) -> None:
        self._dir.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """Open an MXFP8 checkpoint (directory or single ``.safetensors`` file) for reading; see
    :class:`CheckpointReader`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError (a ValueError): unsafe or corrupt files, index or config; values/scale pairs that do
            not match (see :class:`CheckpointReader`).
    """
    return CheckpointReader(path)
