"""Readers: tensors of a model one at a time, with their names, shapes and dtypes known before any data is read.

* :class:`SafetensorsDir` — a Hugging Face model directory (``*.safetensors``, sharded with
  ``model.safetensors.index.json``) or a single ``.safetensors`` file. Headers are parsed directly (the
  safetensors format: 8-byte little-endian header length, JSON header, data), so entries come in file order
  without reading data; :meth:`SafetensorsDir.get` reads one tensor (plain reads at the header's offsets).
* :class:`StateDictSource` — an ``nn.Module`` or a state dict in memory (GGUF files come in this way, through
  :func:`mxport.models.load_causal_lm`).
* :func:`open_checkpoint` — an MXFP8 (or plain) checkpoint read back as ``(name, MXFP8Components | Tensor)``:
  values and scales paired under the values' name.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from ..components import MXFP8Components
from ..formats import SAFETENSORS_DTYPES, is_fp8_dtype
from .naming import FORMATS, SCALE_SUFFIX, detect_format

#: safetensors dtype names <-> torch dtypes (the ones mxport reads and writes)
ST_TO_TORCH = SAFETENSORS_DTYPES
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}

INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


def st_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string for ``dtype`` (``torch.bfloat16`` -> "BF16"); ValueError if none."""
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype} (safetensors dtypes: {sorted(ST_TO_TORCH)})") from None


def read_header(file: str | os.PathLike) -> dict:
    """Parse a ``.safetensors`` header: ``{name: {"dtype", "shape", "data_offsets"}}`` plus ``__metadata__``.

    Raises ValueError naming the file when the header is truncated, not JSON, or inconsistent with the file size.
    """
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"corrupt safetensors file {str(file)!r}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"corrupt safetensors header in {str(file)!r}: header length {n} does not fit the "
                             f"file of {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"corrupt safetensors header in {str(file)!r}: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"corrupt safetensors header in {str(file)!r}: expected a JSON object")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            shape = [int(s) for s in info["shape"]]
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"corrupt safetensors header in {str(file)!r}: bad entry for {name!r}") from None
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"corrupt safetensors header in {str(file)!r}: {name!r} data_offsets [{begin}, {end}] "
                             f"outside the {data_len} data bytes")
        if dtype not in ST_TO_TORCH:
            raise ValueError(f"unsupported dtype {dtype!r} of tensor {name!r} in {str(file)!r}; mxport reads "
                             f"{sorted(ST_TO_TORCH)}")
        info["shape"] = shape
    return header


def _data_start(file: Path) -> int:
    """Byte offset of a safetensors file's data section (8 + header length)."""
    with open(file, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


class SafetensorsDir:
    """A model directory (or one ``.safetensors`` file) read one tensor at a time.

    Attributes:
        path: the directory (for a single file: its folder).
        files: the shard files in order (index order, or sorted names).
        config: ``config.json`` as a dict ({} when absent).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no ``*.safetensors`` in the directory, an index naming a missing shard, a corrupt header,
            an unsupported dtype, a tensor name in two shards.
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"checkpoint path {str(p)!r} does not exist")
        if p.is_file():
            if p.suffix != ".safetensors":
                raise ValueError(f"{str(p)!r} is not a .safetensors file or a model directory")
            self.path, self.files = p.parent, [p]
        else:
            self.path = p
            index = p / INDEX_NAME
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(f"corrupt {INDEX_NAME} in {str(p)!r}: {exc}") from None
                names = list(dict.fromkeys(weight_map.values()))
                self.files = [p / n for n in names]
                missing = [str(f.name) for f in self.files if not f.is_file()]
                if missing:
                    raise ValueError(f"{INDEX_NAME} in {str(p)!r} names missing shard(s) {missing}")
            else:
                self.files = sorted(p.glob("*.safetensors"))
            if not self.files:
                raise ValueError(f"no model found in {str(p)!r}: no *.safetensors files")
        cfg = self.path / "config.json"
        self.config: dict = {}
        if cfg.is_file() and (p.is_dir()):
            try:
                self.config = json.loads(cfg.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"corrupt config.json in {str(self.path)!r}: {exc}") from None
        self._headers = {f: read_header(f) for f in self.files}
        self._data_start = {f: _data_start(f) for f in self.files}
        self._where: dict[str, Path] = {}
        self._entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.st_dtypes: dict[str, str] = {}
        for f, header in self._headers.items():
            items = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                           key=lambda kv: kv[1]["data_offsets"][0])
            for name, info in items:
                if name in self._where:
                    raise ValueError(f"tensor {name!r} appears in two shards ({self._where[name].name}, {f.name})")
                self._where[name] = f
                self.st_dtypes[name] = info["dtype"]
                self._entries.append((name, tuple(info["shape"]), ST_TO_TORCH[info["dtype"]]))
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
        begin, end = self._headers[self._where[name]][name]["data_offsets"]
        return end - begin

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` into a new CPU tensor of its stored dtype. KeyError for an unknown name.

        Plain ``readinto`` at the header's offsets, not a memory map: pages of a mapped shard would count in the
        process's resident memory until the shard is closed, so peak memory would grow with the shard size.
        """
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.label}")
        info = self._headers[self._where[name]][name]
        begin, end = info["data_offsets"]
        return self._read(name, 0, end - begin).view(ST_TO_TORCH[info["dtype"]]).reshape(info["shape"])

    def _read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Bytes ``[start, stop)`` of tensor ``name``'s data as a new uint8 tensor."""
        f = self._where[name]
        begin = self._headers[f][name]["data_offsets"][0]
        buf = torch.empty(stop - start, dtype=torch.uint8)
        if stop > start:
            if self._handle_file != f:
                self.close()
                self._handle = open(f, "rb")  # noqa: SIM115 - kept open across reads, closed by close()
                self._handle_file = f
            self._handle.seek(self._data_start[f] + begin + start)
            view = memoryview(buf.numpy())
            got = 0
            while got < len(view):
                n = self._handle.readinto(view[got:])
                if not n:
                    raise ValueError(f"corrupt safetensors file {str(f)!r}: {name!r} data ends early")
                got += n
        return buf

    def iter_rows(self, name: str, chunk_numel: int) -> Iterator[torch.Tensor]:
        """Tensor ``name`` as consecutive whole rows of its ``(M, K)`` view (K = last dimension), about
        ``chunk_numel`` elements per chunk, each read from the file on its own (memory: one chunk)."""
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.label}")
        info = self._headers[self._where[name]][name]
        dtype, shape = ST_TO_TORCH[info["dtype"]], info["shape"]
        k = shape[-1] if shape else 1
        m = 1
        for s in shape[:-1]:
            m *= s
        if len(shape) < 2 or k == 0 or m == 0:  # 0-d, 1-D, empty: one piece as it is
            yield self.get(name)
            return
        row_bytes = k * torch.empty((), dtype=dtype).element_size()
        step = max(1, chunk_numel // k)
        for r0 in range(0, m, step):
            r1 = min(m, r0 + step)
            yield self._read(name, r0 * row_bytes, r1 * row_bytes).view(dtype).reshape(r1 - r0, k)

    def close(self) -> None:
        """Close the open shard file (reading again reopens it)."""
        if getattr(self, "_handle", None) is not None:
            self._handle.close()
        self._handle = None
        self._handle_file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


class StateDictSource:
    """An in-memory state dict (or ``nn.Module``) with the same interface as :class:`SafetensorsDir`.

    Args:
        obj: ``nn.Module`` (its ``state_dict()``; ``model.config`` is used when present) or a ``dict`` of tensors.
        config: config dict (defaults to ``obj.config.to_dict()`` for a transformers model, else {}).
        extras: objects with ``save_pretrained(dir)`` (tokenizer, generation config) written next to the weights.

    With ``tie_word_embeddings`` in the config, ``lm_head.weight`` is dropped (written once, as the embedding),
    as ``save_pretrained`` does.
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
                raise TypeError(f"state dict entries must be str -> torch.Tensor, got {k!r}: {type(v).__name__}")
        self.config = dict(config or {})
        self.path = None
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
    """values name -> scale name for every FP8 tensor whose scale (``<values>_scale`` / ``_scale_inv``) exists."""
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
    """Guess the format from tensor names when the config says nothing: FP8 values with ``_scale_inv`` scales ->
    "sglang"; with ``_scale`` scales -> "modelopt" (compressed-tensors uses the same names); no pairs -> None."""
    pairs = _pair_names(names, dtypes, None)
    if not pairs:
        return None
    if any(s.endswith("_scale_inv") for s in pairs.values()):
        return "sglang"
    return "modelopt"


def read_quant_config(path: Path, config: dict) -> dict | None:
    """The checkpoint's quantization description: ``config.json`` ``quantization_config`` or, failing that,
    ``hf_quant_config.json``; None if neither."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(qc, dict):
        return qc
    hq = path / "hf_quant_config.json"
    if hq.is_file():
        try:
            data = json.loads(hq.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"corrupt hf_quant_config.json in {str(path)!r}: {exc}") from None
        return data if isinstance(data, dict) else None
    return None


class CheckpointReader:
    """An exported MXFP8 checkpoint (any of :data:`~mxport.checkpoint.naming.FORMATS`) or a plain HF directory.

    Attributes:
        format: "modelopt" | "compressed-tensors" | "sglang" (from the config's quantization_config or
            hf_quant_config.json, else guessed from scale tensor names), or None for an unquantized checkpoint.
        config: ``config.json`` as a dict.
    """

    def __init__(self, path: str | os.PathLike):
        self._dir = SafetensorsDir(path)
        self.path = self._dir.path
        self.config = self._dir.config
        dtypes = {n: d for n, _, d in self._dir.entries()}
        names = self._dir.names()
        fmt = detect_format(read_quant_config(self.path, self.config))
        self.format = fmt if fmt in FORMATS else format_by_names(names, dtypes)
        self._pairs = _pair_names(names, dtypes, self.format)
        self._scales = set(self._pairs.values())

    def names(self) -> list[str]:
        """Names :meth:`iter_tensors` yields (values names for MXFP8 pairs; scale names are folded in)."""
        return [n for n in self._dir.names() if n not in self._scales]

    def scale_name_of(self, name: str) -> str | None:
        """The scale tensor's name for values ``name`` (None for a kept tensor)."""
        return self._pairs.get(name)

    def get(self, name: str) -> MXFP8Components | torch.Tensor:
        """One entry of :meth:`iter_tensors` by name."""
        if name in self._pairs:
            return MXFP8Components(self._dir.get(name), self._dir.get(self._pairs[name]), "rowwise")
        return self._dir.get(name)

    def iter_tensors(self) -> Iterator[tuple[str, MXFP8Components | torch.Tensor]]:
        """Yield ``(name, value)`` in file order: ``MXFP8Components`` (rowwise, compact uint8 scales; 3-D expert
        values give scales ``[E, N, ceil(K/32)]``) for each values/scale pair, plain tensors for the rest.

        Raises ValueError (from :class:`~mxport.MXFP8Components`) when a scale's shape or dtype does not match its
        values (e.g. a padded scale); ``mxport inspect`` reports such checkpoints without raising.
        """
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
        ValueError: no safetensors files, a corrupt header or index, an unsupported dtype.
    """
    return CheckpointReader(path)
