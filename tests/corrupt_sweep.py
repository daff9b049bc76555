"""Corrupt-checkpoint sweep (issue 12): many corrupt variants of one small exported checkpoint, each run
through ``inspect_checkpoint``, ``load_checkpoint`` and ``mxport verify --checkpoint`` (the CLI in-process),
every call in a worker process watched by a timeout, so a hang or a crash is seen, not waited on.

The variant generator (:data:`VARIANTS`, :func:`make_variant`) is the one place both users take it from:
``tests/test_corrupt_sweep.py`` runs a subset; ``python tests/corrupt_sweep.py`` runs them all and prints the
counts (``--json FILE`` writes every result). Run it with ``PYTHONPATH`` naming the mxport to test.

Each variant says what each call must do: ``error`` (refuse it: a ValueError-family error with a message, an
``inspect`` report with problems, ``verify`` exit 1 or 2) or ``ok`` (accept it: the variant is a valid
checkpoint written differently). ``model``: the files are a valid MXFP8 checkpoint that does not match the
model (a kept tensor missing or renamed, an extra tensor): ``inspect`` knows no model, so it must accept it;
the two others must refuse.

Outcome categories: correct (accepted as expected, or problems reported), clear error, and the bad ones: raw
exception (another exception type), traceback (the CLI printed one), silent success (a corrupt file accepted
as fine), false alarm (a valid variant refused), hang, crash.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OPS = ("inspect", "load", "verify")
GOOD = ("correct", "clear error")
BAD = ("raw exception", "traceback", "silent success", "false alarm", "hang", "crash")
INDEX = "model.safetensors.index.json"
#: tensors the mutations aim at (a quantized linear's values and scale, a kept tensor)
V = "model.layers.0.mlp.down_proj.weight"
S = V + "_scale"
K = "model.norm.weight"
E = "model.embed_tokens.weight"


# -- the base checkpoint -------------------------------------------------------------------------------------
def build_base(root: Path) -> tuple[Path, Path]:
    """A tiny Llama (``src``, with tokenizer) and its modelopt export in several shards
    with an index (``base``)."""
    from mxport.checkpoint import export_checkpoint
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(root / "src", hidden=64, layers=2, intermediate=96, vocab=256)
    export_checkpoint(str(src), root / "base", fmt="modelopt", max_shard_size="40KB")
    (root / "prompts.txt").write_text("hello there\n")
    return src, root / "base"


# -- byte-level helpers --------------------------------------------------------------------------------------
def read_st(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(f: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    hb = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8) if not isinstance(header, bytes) else b""
    f.write_bytes(struct.pack("<Q", len(hb) if length is None else length) + hb + data)


def index(ck: Path) -> dict:
    return json.loads((ck / INDEX).read_text())


def shard_of(ck: Path, name: str) -> Path:
    return ck / index(ck)["weight_map"][name]


def edit_header(name: str, fn: Callable[[dict], None]) -> Callable[[Path], None]:
    """Mutate the header of the shard holding tensor ``name`` with ``fn(header)``, data untouched."""
    def mutate(ck: Path) -> None:
        f = shard_of(ck, name)
        h, data = read_st(f)
        fn(h)
        write_st(f, h, data)
    return mutate


def set_entry(name: str, key: str, value) -> Callable[[Path], None]:
    return edit_header(name, lambda h: h[name].__setitem__(key, value))


def raw_shard(name: str, fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    """Replace the whole file of the shard holding ``name`` by ``fn(its bytes)``."""
    def mutate(ck: Path) -> None:
        f = shard_of(ck, name)
        f.write_bytes(fn(f.read_bytes()))
    return mutate


def raw_header(name: str, header: bytes, length: int | None = None) -> Callable[[Path], None]:
    def mutate(ck: Path) -> None:
        f = shard_of(ck, name)
        write_st(f, header, read_st(f)[1], length)
    return mutate


def tensors(fn: Callable[[dict], None], shard_name: str = V) -> Callable[[Path], None]:
    """Rewrite the shard holding ``shard_name`` with ``fn(state dict)`` (a valid file), the
    index kept in step."""
    def mutate(ck: Path) -> None:
        from safetensors.torch import load_file, save_file

        f = shard_of(ck, shard_name)
        state = load_file(str(f))
        before = set(state)
        fn(state)
        save_file({k: v.contiguous() for k, v in state.items()}, str(f), metadata={"format": "pt"})
        idx = index(ck)
        for k in before - set(state):
            del idx["weight_map"][k]
        for k in set(state) - before:
            idx["weight_map"][k] = f.name
        (ck / INDEX).write_text(json.dumps(idx))
    return mutate


def data_bytes(name: str, fn: Callable[[bytearray], None]) -> Callable[[Path], None]:
    """Mutate the data bytes of tensor ``name`` in place (header untouched)."""
    def mutate(ck: Path) -> None:
        f = shard_of(ck, name)
        h, data = read_st(f)
        b, e = h[name]["data_offsets"]
        part = bytearray(data[b:e])
        fn(part)
        write_st(f, h, data[:b] + bytes(part) + data[e:])
    return mutate


def edit_json(fname: str, fn: Callable[[dict], object]) -> Callable[[Path], None]:
    """Rewrite JSON file ``fname`` of the checkpoint with ``fn(obj)`` (its return value, when
    not None, is written)."""
    def mutate(ck: Path) -> None:
        obj = json.loads((ck / fname).read_text())
        out = fn(obj)
        (ck / fname).write_text(json.dumps(obj if out is None else out))
    return mutate


def write_text(fname: str, text: str) -> Callable[[Path], None]:
    return lambda ck: (ck / fname).write_text(text)


def replace_by(fname_or_tensor: str, kind: str) -> Callable[[Path], None]:
    """Replace a file (by name, or the shard holding a tensor) with a directory, FIFO or symlink."""
    def mutate(ck: Path) -> None:
        f = ck / fname_or_tensor if (ck / fname_or_tensor).exists() else shard_of(ck, fname_or_tensor)
        outside = ck.parent / f"outside-{ck.name}-{f.name}"
        if kind == "symlink_out":
            shutil.copy(f, outside)
        f.unlink()
        if kind == "dir":
            f.mkdir()
        elif kind == "fifo":
            os.mkfifo(f)
        elif kind == "symlink_out":
            f.symlink_to(outside)
        elif kind == "dangling":
            f.symlink_to(ck / "no-such-file")
        elif kind == "loop":
            f.symlink_to(f)
        else:  # a device: /dev/null or /dev/zero
            f.symlink_to(kind)
    return mutate


def index_map(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(idx):
        out = fn(idx["weight_map"])
        if out is not None:
            idx["weight_map"] = out
    return edit_json(INDEX, edit)


def qc(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    return edit_json("config.json", lambda c: fn(c["quantization_config"]))


def nested(depth: int) -> str:
    return '{"a":' + "[" * depth + "]" * depth + "}"


def _torch():
    import torch
    return torch


def _both(*fns):
    def mutate(ck):
        for fn in fns:
            fn(ck)
    return mutate


def _shape(name, f):
    return edit_header(name, lambda h: h[name].__setitem__("shape", f(h[name]["shape"])))


def _offsets(name, f):
    return edit_header(name, lambda h: h[name].__setitem__("data_offsets", f(h[name]["data_offsets"])))


def _padded_scale(state):
    t = _torch()
    s = state[S]
    p = t.zeros(128, 4, dtype=t.uint8)
    p[: s.shape[0], : s.shape[1]] = s
    state[S] = p


def _fifo_extra(ck):
    os.mkfifo(ck / "extra.safetensors")


def _symlink_folder(ck):
    real = ck.parent / f"real-{ck.name}"
    ck.rename(real)
    ck.symlink_to(real)


def _rename_shard_via_symlink(ck):
    f = shard_of(ck, V)
    f.rename(ck / "renamed.bin")
    f.symlink_to("renamed.bin")


def _no_quant_config(ck):
    edit_json("config.json", lambda c: c.pop("quantization_config"))(ck)
    (ck / "hf_quant_config.json").unlink()


def _dequantize_all(state):
    import mxport

    t = _torch()
    for n in [n for n, v in state.items() if v.dtype == t.float8_e4m3fn]:
        c = mxport.MXFP8Components(state[n], state.pop(n + "_scale"), "rowwise")
        state[n] = c.dequantize(t.bfloat16)


def _dequantize_every_shard(ck):
    for f in sorted(set(index(ck)["weight_map"].values())):
        name = next(k for k, v in index(ck)["weight_map"].items() if v == f)
        tensors(_dequantize_all, name)(ck)


def _extra_shard(ck, name="extra.safetensors"):
    from safetensors.torch import save_file

    save_file({"stray.weight": _torch().ones(2, 2)}, str(ck / name))


def _no_index(ck):
    (ck / INDEX).unlink()


def _set(d, k, v):
    d[k] = v


# -- the variants --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    mutate: Callable[[Path], None]
    expect: str  # "error" | "ok" | "model"

    def expected(self, op: str) -> str:
        if self.expect == "model":
            return "ok" if op == "inspect" else "error"
        return self.expect


def _header_variants() -> list[Variant]:
    out = []
    for tag, name in (("values", V), ("scale", S), ("kept", K)):
        out += [
            Variant(f"{tag}: shape claims more rows", _shape(name, lambda s: [s[0] + 1, *s[1:]]), "error"),
            Variant(f"{tag}: shape claims fewer rows", _shape(name, lambda s: [s[0] - 1, *s[1:]]), "error"),
            Variant(f"{tag}: shape [-1, K]", _shape(name, lambda s: [-1, *s[1:]]), "error"),
            Variant(f"{tag}: shape 0-d", _shape(name, lambda s: []), "error"),
            Variant(f"{tag}: shape a string", _shape(name, lambda s: "64x96"), "error"),
            Variant(f"{tag}: shape with a float", _shape(name, lambda s: [s[0] + 0.5, *s[1:]]), "error"),
            Variant(f"{tag}: shape huge", _shape(name, lambda s: [2**62, *s[1:]]), "error"),
            Variant(f"{tag}: offsets overlap the previous tensor", _offsets(name, lambda o: [o[0] - 2, o[1]]),
                    "error"),
            Variant(f"{tag}: offsets beyond the file", _offsets(name, lambda o: [o[0], o[1] + 10**6]),
                    "error"),
            Variant(f"{tag}: offsets reversed", _offsets(name, lambda o: [o[1], o[0]]), "error"),
            Variant(f"{tag}: offsets negative", _offsets(name, lambda o: [-8, o[1]]), "error"),
            Variant(f"{tag}: offsets leave a gap", _offsets(name, lambda o: [o[0] + 1, o[1]]), "error"),
            Variant(f"{tag}: offsets missing", edit_header(name, lambda h, n=name: h[n].pop("data_offsets")),
                    "error"),
            Variant(f"{tag}: dtype missing", edit_header(name, lambda h, n=name: h[n].pop("dtype")), "error"),
            Variant(f"{tag}: dtype unknown", set_entry(name, "dtype", "XYZ"), "error"),
            Variant(f"{tag}: dtype C64", set_entry(name, "dtype", "C64"), "error"),
            Variant(f"{tag}: dtype lowercase", set_entry(name, "dtype", "u8"), "error"),
            Variant(f"{tag}: entry is a list", edit_header(name, lambda h, n=name: h.__setitem__(n, [1, 2])),
                    "error"),
        ]
    out += [
        Variant("values: dtype F8_E5M2 (config says E4M3)", set_entry(V, "dtype", "F8_E5M2"), "error"),
        Variant("values: dtype U8", set_entry(V, "dtype", "U8"), "error"),
        Variant("values: dtype I8", set_entry(V, "dtype", "I8"), "error"),
        Variant("values: dtype BF16", set_entry(V, "dtype", "BF16"), "error"),
        Variant("values: shape transposed (same bytes)", _shape(V, lambda s: s[::-1]), "error"),
        Variant("values: shape with a leading 1 (same bytes)", _shape(V, lambda s: [1, *s]), "error"),
        Variant("scale: dtype I8", set_entry(S, "dtype", "I8"), "error"),
        Variant("scale: dtype BOOL", set_entry(S, "dtype", "BOOL"), "error"),
        Variant("scale: dtype F8_E4M3", set_entry(S, "dtype", "F8_E4M3"), "error"),
        Variant("scale: dtype F32", set_entry(S, "dtype", "F32"), "error"),
        Variant("scale: shape transposed (same bytes)", _shape(S, lambda s: s[::-1]), "error"),
        Variant("scale: shape flattened (same bytes)", _shape(S, lambda s: [s[0] * s[1]]), "error"),
        Variant("kept: shape transposed (same bytes)", _shape(E, lambda s: s[::-1]), "model"),
        Variant("header: tensor entry with an unknown key (harmless)", edit_header(
            V, lambda h: h[V].__setitem__("x", 1)), "ok"),
        Variant("header: __metadata__ with a number", edit_header(
            V, lambda h: h.__setitem__("__metadata__", {"a": 1})), "error"),
        Variant("header: __metadata__ a list", edit_header(V, lambda h: h.__setitem__("__metadata__", [1])),
                "error"),
        Variant("header: not JSON", raw_header(V, b"{not json}      "), "error"),
        Variant("header: JSON array", raw_header(V, b"[1, 2, 3]       "), "error"),
        Variant("header: JSON string", raw_header(V, b'"abc"   '), "error"),
        Variant("header: nested 10000 deep", raw_header(V, nested(10000).encode()), "error"),
        Variant("header: nested 200 deep", raw_header(V, nested(200).encode()), "error"),
        Variant("header: not UTF-8", raw_header(V, b'{"\xff\xfe": 1}  '), "error"),
        Variant("header: length 2**62", raw_shard(V, lambda b: struct.pack("<Q", 2**62) + b[8:]), "error"),
        Variant("header: length 0", raw_shard(V, lambda b: struct.pack("<Q", 0) + b[8:]), "error"),
        Variant("header: length beyond the file", raw_shard(V, lambda b: struct.pack("<Q", len(b)) + b[8:]),
                "error"),
        Variant("header: length one short", raw_shard(
            V, lambda b: struct.pack("<Q", struct.unpack("<Q", b[:8])[0] - 1) + b[8:]), "error"),
        Variant("header: duplicate tensor key", raw_shard(V, _dup_key), "error"),
    ]
    return out


def _dup_key(b: bytes) -> bytes:
    n = struct.unpack("<Q", b[:8])[0]
    h = b[8:8 + n].rstrip()
    entry = json.dumps({V: json.loads(h)[V]})[1:-1]
    hb = h[:-1] + b"," + entry.encode() + b"}"
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + b[8 + n:]


def _file_variants() -> list[Variant]:
    return [
        Variant("file: empty", raw_shard(V, lambda b: b""), "error"),
        Variant("file: 7 bytes", raw_shard(V, lambda b: b[:7]), "error"),
        Variant("file: truncated in the header", raw_shard(V, lambda b: b[:40]), "error"),
        Variant("file: truncated by one byte", raw_shard(V, lambda b: b[:-1]), "error"),
        Variant("file: truncated to half", raw_shard(V, lambda b: b[: len(b) // 2]), "error"),
        Variant("file: one trailing byte", raw_shard(V, lambda b: b + b"\0"), "error"),
        Variant("file: 8 trailing bytes", raw_shard(V, lambda b: b + b"\0" * 8), "error"),
        Variant("file: all zero bytes", raw_shard(V, lambda b: bytes(len(b))), "error"),
        Variant("file: shard is a directory", replace_by(V, "dir"), "error"),
        Variant("file: shard is a FIFO", replace_by(V, "fifo"), "error"),
        Variant("file: shard is a symlink out of the folder", replace_by(V, "symlink_out"), "error"),
        Variant("file: shard is a dangling symlink", replace_by(V, "dangling"), "error"),
        Variant("file: shard is a symlink loop", replace_by(V, "loop"), "error"),
        Variant("file: shard is /dev/null", replace_by(V, "/dev/null"), "error"),
        Variant("file: shard is /dev/zero", replace_by(V, "/dev/zero"), "error"),
        Variant("file: a FIFO named extra.safetensors", _fifo_extra, "error"),
        Variant("file: a directory named extra.safetensors", lambda ck: (ck / "extra.safetensors").mkdir(),
                "error"),
        Variant("file: a stray shard the index omits", _extra_shard, "error"),
        Variant("file: shard deleted", lambda ck: shard_of(ck, V).unlink(), "error"),
        Variant("file: no index, a FIFO named extra.safetensors", _both(_fifo_extra, _no_index), "error"),
        Variant("file: no index, a directory named extra.safetensors", _both(
            lambda ck: (ck / "extra.safetensors").mkdir(), _no_index), "error"),
        Variant("file: no index, a shard a symlink out of the folder", _both(replace_by(V, "symlink_out"),
                                                                            _no_index), "error"),
        Variant("file: no index, a shard is /dev/zero", _both(replace_by(V, "/dev/zero"), _no_index),
                "error"),
    ]


def _index_variants() -> list[Variant]:
    def drop_shard(m):
        f = m[V]
        return {k: v for k, v in m.items() if v != f}

    return [
        Variant("index: weight_map a list", index_map(lambda m: list(m.items())), "error"),
        Variant("index: weight_map a string", index_map(lambda m: "model.safetensors"), "error"),
        Variant("index: weight_map empty", index_map(lambda m: {}), "error"),
        Variant("index: weight_map missing", edit_json(INDEX, lambda i: i.pop("weight_map")), "error"),
        Variant("index: a shard name is a number", index_map(lambda m: m.__setitem__(V, 7)), "error"),
        Variant("index: a shard outside the folder (..)", index_map(
            lambda m: m.__setitem__(V, "../x.safetensors")), "error"),
        Variant("index: an absolute shard path", index_map(lambda m: m.__setitem__(V, "/etc/passwd")),
                "error"),
        Variant("index: a shard in a subfolder", index_map(lambda m: m.__setitem__(V, "sub/x.safetensors")),
                "error"),
        Variant("index: a missing shard", index_map(lambda m: m.__setitem__(V, "nope.safetensors")), "error"),
        Variant("index: a tensor in the wrong shard", index_map(lambda m: m.__setitem__(V, m[E])
                                                                if m[V] != m[E] else m.__setitem__(V, m[K])),
                "error"),
        Variant("index: a tensor omitted", index_map(lambda m: m.pop(V)), "error"),
        Variant("index: a tensor no shard holds", index_map(lambda m: m.__setitem__("ghost.weight", m[V])),
                "error"),
        Variant("index: a whole shard omitted", index_map(drop_shard), "error"),
        Variant("index: not JSON", write_text(INDEX, "{weight_map"), "error"),
        Variant("index: a JSON array", write_text(INDEX, "[]"), "error"),
        Variant("index: nested 100000 deep", write_text(INDEX, nested(100000)), "error"),
        Variant("index: a FIFO", replace_by(INDEX, "fifo"), "error"),
        Variant("index: a directory", replace_by(INDEX, "dir"), "error"),
        Variant("index: a symlink out of the folder", replace_by(INDEX, "symlink_out"), "error"),
        Variant("index: /dev/zero", replace_by(INDEX, "/dev/zero"), "error"),
    ]


def _config_variants() -> list[Variant]:
    def ct(c):
        from mxport.checkpoint.naming import quantization_config

        c["quantization_config"] = quantization_config("compressed-tensors",
                                                       c["quantization_config"]["ignore"])

    return [
        Variant("config: not JSON", write_text("config.json", "{oops"), "error"),
        Variant("config: a JSON array", write_text("config.json", "[1]"), "error"),
        Variant("config: nested 100000 deep", write_text("config.json", nested(100000)), "error"),
        Variant("config: quantization_config a list", edit_json("config.json", lambda c: _set(
            c, "quantization_config", [1])), "error"),
        Variant("config: quantization_config a string", edit_json("config.json", lambda c: _set(
            c, "quantization_config", "mxfp8")), "error"),
        Variant("config: config_groups a list", _both(edit_json("config.json", ct), qc(
            lambda q: _set(q, "config_groups", [q["config_groups"]["group_0"]]))), "error"),
        Variant("config: a config group a list", _both(edit_json("config.json", ct), qc(
            lambda q: _set(q, "config_groups", {"g": [1]}))), "error"),
        Variant("config: format sglang (scale names do not follow)", qc(lambda q: q.update(
            quant_method="mxfp8", fmt="e4m3")), "error"),
        Variant("config: sglang fmt int4", qc(lambda q: q.update(quant_method="mxfp8", fmt="int4")), "error"),
        Variant("config: a FIFO", replace_by("config.json", "fifo"), "error"),
        Variant("config: a directory", replace_by("config.json", "dir"), "error"),
        Variant("config: a symlink out of the folder", replace_by("config.json", "symlink_out"), "error"),
        Variant("hf_quant_config: quantization a list", _both(
            edit_json("config.json", lambda c: c.pop("quantization_config")),
            edit_json("hf_quant_config.json", lambda h: _set(h, "quantization", [1]))), "error"),
        Variant("hf_quant_config: a FIFO", _both(
            edit_json("config.json", lambda c: c.pop("quantization_config")),
            replace_by("hf_quant_config.json", "fifo")), "error"),
        Variant("config: compressed-tensors (same names: valid)", edit_json("config.json", ct), "ok"),
    ]


def _pair_variants() -> list[Variant]:
    t = _torch
    return [
        Variant("pair: scale removed", tensors(lambda s: s.pop(S)), "error"),
        Variant("pair: values removed", tensors(lambda s: s.pop(V)), "error"),
        Variant("pair: both removed", tensors(lambda s: (s.pop(V), s.pop(S))), "model"),
        Variant("pair: scale padded to 128x4", tensors(_padded_scale), "error"),
        Variant("pair: scale one column short", tensors(lambda s: _set(s, S, s[S][:, :-1])), "error"),
        Variant("pair: scale one row short", tensors(lambda s: _set(s, S, s[S][:-1])), "error"),
        Variant("pair: scale as float32 values", tensors(lambda s: _set(s, S, (s[S].float() - 127).exp2())),
                "error"),
        Variant("pair: scale as int32", tensors(lambda s: _set(s, S, s[S].to(t().int32))), "error"),
        Variant("pair: a second scale (_scale_inv)", tensors(lambda s: _set(s, S + "_inv", s[S].clone())),
                "error"),
        Variant("pair: a scale for a kept tensor", tensors(lambda s: _set(
            s, K + "_scale", t().ones(1, 2, dtype=t().uint8)), K), "error"),
        Variant("pair: an orphan *.weight_scale", tensors(lambda s: _set(
            s, "model.foo.weight_scale", t().ones(2, 1, dtype=t().uint8))), "error"),
        Variant("pair: values stored as BF16 beside their scale", tensors(lambda s: _set(
            s, V, s[V].to(t().bfloat16))), "error"),
        Variant("pair: values 3-D [1, N, K] with a matching scale", tensors(
            lambda s: (_set(s, V, s[V][None]), _set(s, S, s[S][None]))), "model"),
        Variant("pair: values renamed with their scale", tensors(
            lambda s: (_set(s, V + "x", s.pop(V)), _set(s, V + "x_scale", s.pop(S)))), "model"),
        Variant("pair: scales stored as F8_E8M0 (same bytes)", tensors(lambda s: _set(
            s, S, s[S].view(t().float8_e8m0fnu))), "ok"),
        Variant("data: one NaN scale byte (255)", data_bytes(S, lambda b: b.__setitem__(0, 255)), "error"),
        Variant("data: every scale byte 255", data_bytes(S, lambda b: b.__setitem__(slice(None), bytes([255])
                                                                                    * len(b))), "error"),
        Variant("data: every scale byte 0 (never written)", data_bytes(S, lambda b: b.__setitem__(
            slice(None), bytes(len(b)))), "error"),
        Variant("data: NaN FP8 values (0x7F)", data_bytes(
            V, lambda b: b.__setitem__(slice(0, 4), b"\x7f" * 4)), "error"),
        Variant("data: every value NaN (0xFF)", data_bytes(V, lambda b: b.__setitem__(slice(None), b"\xff"
                                                                                      * len(b))), "error"),
        Variant("model: a kept tensor removed", tensors(lambda s: s.pop(K), K), "model"),
        Variant("model: an extra unknown tensor", tensors(
            lambda s: _set(s, "model.extra.weight", t().ones(3)), K), "model"),
        Variant("model: nothing quantized (every pair dequantized), config still MXFP8",
                _dequantize_every_shard, "error"),
        Variant("model: nothing quantized, no quantization config", _both(_dequantize_every_shard,
                                                                         _no_quant_config), "error"),
    ]


def _ok_variants() -> list[Variant]:
    return [
        Variant("ok: the export as written", lambda ck: None, "ok"),
        Variant("ok: header padded with spaces", raw_shard(V, _pad_header), "ok"),
        Variant("ok: header keys reordered", edit_header(V, lambda h: _reorder(h)), "ok"),
        Variant("ok: no __metadata__", edit_header(V, lambda h: h.pop("__metadata__", None)), "ok"),
        Variant("ok: no quantization config (format from the names)", _no_quant_config, "ok"),
        Variant("ok: the folder reached through a symlink", _symlink_folder, "ok"),
        Variant("ok: a shard as a symlink inside the folder", _rename_shard_via_symlink, "ok"),
        Variant("ok: a consolidated.safetensors beside the shards", lambda ck: _extra_shard(
            ck, "consolidated.safetensors"), "ok"),
        Variant("ok: no index (shards found by name)", _no_index, "ok"),
        Variant("ok: index with more metadata", edit_json(INDEX, lambda i: i["metadata"].update(x=1)), "ok"),
    ]


def _pad_header(b: bytes) -> bytes:
    n = struct.unpack("<Q", b[:8])[0]
    return struct.pack("<Q", n + 64) + b[8:8 + n] + b" " * 64 + b[8 + n:]


def _reorder(h: dict) -> None:
    items = list(h.items())[::-1]
    h.clear()
    h.update(items)


VARIANTS: list[Variant] = (_header_variants() + _file_variants() + _index_variants() + _config_variants()
                           + _pair_variants() + _ok_variants())


def make_variant(base: Path, out_root: Path, v: Variant, i: int) -> Path:
    """A copy of ``base`` under ``out_root`` with ``v`` applied; returns the checkpoint path to open."""
    ck = out_root / f"v{i:03d}"
    shutil.copytree(base, ck, symlinks=True)
    v.mutate(ck)
    return ck


# -- the worker: one process running the calls, answering one JSON line per call -----------------------------
def _call(op: str, path: str, model, src: str, prompts: str) -> dict:
    from mxport.checkpoint import inspect_checkpoint
    from mxport.nn import load_checkpoint

    try:
        if op == "inspect":
            rep = inspect_checkpoint(path)
            return {"outcome": "problems" if rep["problems"] else "accepted",
                    "detail": "; ".join(rep["problems"])}
        if op == "load":
            load_checkpoint(copy.deepcopy(model), path)
            return {"outcome": "accepted", "detail": ""}
    except (ValueError, FileNotFoundError) as exc:
        return {"outcome": "error" if str(exc) else "raw", "detail": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # noqa: BLE001 - classified
        return {"outcome": "raw", "detail": f"{type(exc).__name__}: {exc}"[:500]}
    from typer.testing import CliRunner

    from mxport.cli import app

    r = CliRunner().invoke(app, ["verify", src, "--checkpoint", path, "--max-new-tokens", "2", "--prompts",
                                 prompts])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return {"outcome": "traceback", "detail": f"{type(r.exception).__name__}: {r.exception}"[:500]}
    err = (r.stderr if hasattr(r, "stderr") else r.output).strip().splitlines()
    if r.exit_code == 0:
        return {"outcome": "accepted", "detail": ""}
    outcome = "error" if r.exit_code == 2 and err else ("problems" if r.exit_code == 1 else "raw")
    return {"outcome": outcome, "detail": " ".join(err)[-500:]}


def worker(src: str, prompts: str) -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the answers
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        op, path = line.rstrip("\n").split("\t")
        out.write(json.dumps(_call(op, path, model, src, prompts)) + "\n")
        out.flush()


class Runner:
    """Runs calls in a worker process; a call that does not answer within ``timeout`` s is a hang (the worker
    is killed and a new one started), a worker that dies is a crash."""

    def __init__(self, src: Path, prompts: Path, timeout: float = 60.0, log=None):
        self.args = [sys.executable, os.path.abspath(__file__), "--worker", str(src), str(prompts)]
        self.timeout = timeout
        self.log = log if log is not None else subprocess.DEVNULL
        self.proc = None

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        line = self._readline(300)
        if line != "ready\n":
            raise RuntimeError(f"the sweep worker did not start: {line!r}")

    def _readline(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def call(self, op: str, path: Path) -> dict:
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write(f"{op}\t{path}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        t0 = time.monotonic()
        line = self._readline(self.timeout)
        if line is None:
            self.stop()
            return {"outcome": "hang", "detail": f"no answer within {self.timeout:.0f} s"}
        if not line:
            code = self.proc.wait()
            self.proc = None
            return {"outcome": "crash", "detail": f"worker exited with {code}"}
        res = json.loads(line)
        res["seconds"] = round(time.monotonic() - t0, 3)
        return res


def classify(outcome: str, expected: str) -> str:
    if outcome in ("hang", "crash", "traceback"):
        return outcome
    if outcome == "raw":
        return "raw exception"
    if expected == "ok":
        return "correct" if outcome == "accepted" else "false alarm"
    return {"accepted": "silent success", "problems": "correct", "error": "clear error"}[outcome]


def sweep(root: Path, variants: list[Variant], *, timeout: float = 60.0, log=None,
          progress=None) -> list[dict]:
    """Build the base checkpoint under ``root``, make every variant and run the three calls on each."""
    src, base = build_base(root)
    runner = Runner(src, root / "prompts.txt", timeout, log)
    results = []
    try:
        for i, v in enumerate(variants):
            ck = make_variant(base, root / "variants", v, i)
            for op in OPS:
                res = runner.call(op, ck)
                res.update(variant=v.name, op=op, expected=v.expected(op),
                           category=classify(res["outcome"], v.expected(op)))
                results.append(res)
                if progress is not None:
                    progress(res)
    finally:
        runner.stop()
    return results


def counts(results: list[dict]) -> dict[str, dict[str, int]]:
    table = {c: dict.fromkeys(OPS, 0) for c in GOOD + BAD}
    for r in results:
        table[r["category"]][r["op"]] += 1
    return table


def format_table(results: list[dict]) -> str:
    table = counts(results)
    n = len({r["variant"] for r in results})
    lines = [f"{n} variants x {len(OPS)} calls", f"{'category':<16}" + "".join(f"{op:>10}" for op in OPS)]
    lines += [f"{c:<16}" + "".join(f"{table[c][op]:>10}" for op in OPS) for c in GOOD + BAD]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("SRC", "PROMPTS"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write every result to this file")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per call before it counts as a hang")
    ap.add_argument("-k", help="only variants whose name contains this")
    ap.add_argument("-v", action="store_true", help="print every bad result as it comes")
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    os.environ.setdefault("MXPORT_DISABLE_COMPILE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    variants = [v for v in VARIANTS if not args.k or args.k in v.name]

    def show(r):
        if args.v and r["category"] in BAD:
            print(f"{r['category']:>14} {r['op']:>7}  {r['variant']}: {r['detail'][:200]}", flush=True)

    with tempfile.TemporaryDirectory(prefix="mxport-sweep-") as tmp:
        results = sweep(Path(tmp), variants, timeout=args.timeout, log=sys.stderr if args.v else None,
                        progress=show)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r["category"] in BAD for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
