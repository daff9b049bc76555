"""Naming per format, the safetensors header parser, the streaming writer and
open_checkpoint on hand-made files."""

import json
import math
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxport import quantize
from mxport.checkpoint import (
    FORMATS,
    CheckpointError,
    inspect_checkpoint,
    open_checkpoint,
    quantization_config,
    scale_name,
)
from mxport.checkpoint.naming import check_fp8_dtype, detect_format, hf_quant_config, values_name
from mxport.checkpoint.readers import SafetensorsDir, read_header
from mxport.checkpoint.writers import ShardedSafetensorsWriter, TensorSpec, parse_size, plan_shards


def test_scale_names_per_format():
    w = "model.layers.0.mlp.down_proj.weight"
    assert scale_name(w, "modelopt") == w + "_scale"
    assert scale_name(w, "compressed-tensors") == w + "_scale"
    assert scale_name(w, "sglang") == w + "_scale_inv"
    fused = "model.layers.0.mlp.experts.down_proj"
    assert (scale_name(fused, "sglang") == fused + "_scale_inv"
            and scale_name(fused, "modelopt") == fused + "_scale")
    assert values_name(w + "_scale_inv", "sglang") == w
    with pytest.raises(ValueError, match="format"):
        scale_name(w, "gguf")


def test_quantization_configs_per_format():
    ex = ["lm_head", "model.layers.0.mlp.down_proj"]
    mo = quantization_config("modelopt", ex)
    assert (mo["quant_method"], mo["quant_algo"], mo["ignore"]) == ("modelopt", "MXFP8", ex)
    hq = hf_quant_config(ex)
    assert hq["quantization"]["quant_algo"] == "MXFP8" and hq["quantization"]["group_size"] == 32
    assert hq["quantization"]["exclude_modules"] == ex and "kv_cache_quant_algo" in hq["quantization"]
    ct = quantization_config("compressed-tensors", ex)
    assert (ct["quant_method"] == "compressed-tensors" and ct["format"] == "mxfp8-quantized"
            and ct["ignore"] == ex)
    wargs = ct["config_groups"]["group_0"]["weights"]
    assert (wargs["strategy"], wargs["group_size"], wargs["type"], wargs["num_bits"], wargs["symmetric"],
            wargs["scale_dtype"]) == ("group", 32, "float", 8, True, "uint8")
    sg = quantization_config("sglang", ex)
    assert (sg["quant_method"], sg["weight_block_size"], sg["scale_fmt"], sg["ignored_layers"]) == (
        "mxfp8", [1, 32], "ue8m0", ex)
    assert sg["activation_scheme"] == "dynamic" and sg["fmt"] == "e4m3"
    for fmt in FORMATS:
        assert detect_format(quantization_config(fmt, ex)) == fmt
    assert detect_format(hq) == "modelopt"
    assert detect_format({"quant_method": "fp8"}) is None and detect_format(None) is None


def test_e5m2_refused_by_every_format():
    # SGLang 0.5.23 registers MXFP8 values as E4M3 whatever the config's fmt says: E5M2 would
    # load as garbage there
    with pytest.raises(ValueError, match="E4M3 only .*SGLang 0.5.23 registers MXFP8 values as E4M3"):
        check_fp8_dtype("sglang", torch.float8_e5m2)
    for fmt in FORMATS:
        assert check_fp8_dtype(fmt, torch.float8_e4m3fn) == torch.float8_e4m3fn
        with pytest.raises(ValueError, match="E4M3 only"):
            quantization_config(fmt, [], torch.float8_e5m2)
    with pytest.raises(TypeError, match="fp8_dtype"):
        check_fp8_dtype("sglang", torch.bfloat16)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("50KB") == 50_000 and parse_size("1MiB") == 2**20
    assert parse_size(123) == 123
    for bad in ("lots", "5XB", 0, "-1GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_streaming_writer_matches_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(5, 7, generator=g).bfloat16(),
               "b": torch.arange(12, dtype=torch.uint8).view(3, 4),
               "c": torch.randn(3, generator=g), "d": torch.randn(4, 64, generator=g).to(torch.float8_e4m3fn),
               "e": torch.zeros(0, 3)}
    groups = [[TensorSpec(k, v.dtype, tuple(v.shape))] for k, v in tensors.items()]
    shards = plan_shards(groups, 80)
    assert len(shards) > 1
    w = ShardedSafetensorsWriter(tmp_path, shards)
    for k, v in tensors.items():
        w.write(k, v)
    weight_map = w.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and set(weight_map) == set(tensors)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tensors.values())
    back = {}
    for f in set(weight_map.values()):
        back.update(load_file(str(tmp_path / f)))
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8), v.view(torch.uint8))


def test_writer_rejects_out_of_plan(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, [[TensorSpec("a", torch.float32, (2,))]])
    with pytest.raises(ValueError, match="expected 'a'"):
        w.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="not written"):
        w.close()
    w.abort()


def test_read_header_rejects_corrupt_files(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="corrupt"):
        read_header(f)
    f.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        read_header(f)
    f.write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(ValueError, match="corrupt safetensors header .*JSON"):
        read_header(f)
    hdr = json.dumps({"t": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8)
    with pytest.raises(ValueError, match="unsupported dtype 'C64'"):
        read_header(f)


def make_mxfp8_dir(path, fmt, *, sharded=False, k=70):
    """A checkpoint of ``fmt``; the down projection's K is ``k`` (70 by default: a partial last block, which
    mxport's readers decode and ``inspect`` flags: no engine loads it)."""
    g = torch.Generator().manual_seed(1)
    src = {"model.layers.0.mlp.down_proj.weight": torch.randn(3, k, generator=g, dtype=torch.bfloat16),
           "model.layers.0.mlp.experts.gate_up_proj": torch.randn(2, 4, 64, generator=g)}
    tensors = {"model.embed_tokens.weight": torch.randn(8, 70, generator=g).bfloat16()}
    for n, x in src.items():
        c = quantize(x)
        tensors[n] = c.data
        tensors[scale_name(n, fmt)] = c.scale_inv
    path.mkdir()
    if sharded:
        names = list(tensors)
        save_file({k: tensors[k] for k in names[:2]}, str(path / "model-00001-of-00002.safetensors"))
        save_file({k: tensors[k] for k in names[2:]}, str(path / "model-00002-of-00002.safetensors"))
        wm = {k: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors" for i, k in enumerate(names)}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps({"quantization_config": quantization_config(fmt, ["lm_head"])}))
    return src


@pytest.mark.parametrize("fmt", FORMATS)
def test_open_checkpoint_pairs_values_and_scales(tmp_path, fmt):
    src = make_mxfp8_dir(tmp_path / "ck", fmt, sharded=fmt == "sglang")
    with open_checkpoint(tmp_path / "ck") as ck:
        assert ck.format == fmt
        assert "quantization_config" in ck.config
        got = dict(ck.iter_tensors())
    assert list(got) == ck.names()
    assert set(got) == {"model.embed_tokens.weight", *src}
    assert isinstance(got["model.embed_tokens.weight"], torch.Tensor)
    for n, x in src.items():
        ref = quantize(x)
        c = got[n]
        assert c.direction == "rowwise" and c.scale_inv.dtype == torch.uint8
        assert c.scale_inv.shape == ref.scale_inv.shape
        assert torch.equal(c.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(c.scale_inv, ref.scale_inv)
    assert got["model.layers.0.mlp.experts.gate_up_proj"].scale_inv.shape == (2, 4, 2)


def test_open_checkpoint_guesses_format_from_names(tmp_path):
    make_mxfp8_dir(tmp_path / "ck", "sglang")
    (tmp_path / "ck" / "config.json").write_text("{}")
    assert open_checkpoint(tmp_path / "ck").format == "sglang"
    make_mxfp8_dir(tmp_path / "ck2", "modelopt")
    (tmp_path / "ck2" / "config.json").unlink()
    assert open_checkpoint(tmp_path / "ck2").format == "modelopt"


def test_open_checkpoint_plain_dir_and_errors(tmp_path):
    (tmp_path / "plain").mkdir()
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "plain" / "model.safetensors"))
    ck = open_checkpoint(tmp_path / "plain")
    assert ck.format is None and [n for n, _ in ck.iter_tensors()] == ["w"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model found"):
        SafetensorsDir(tmp_path / "empty")


def test_writer_parts(tmp_path):
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    w = ShardedSafetensorsWriter(tmp_path, [[TensorSpec("x", torch.float32, (2, 3, 4)),
                                             TensorSpec("e", torch.float32, (0, 4))]])
    with pytest.raises(ValueError, match="rows of 'x'"):
        w.write_part("x", torch.zeros(2, 3))
    w.write_part("x", x.reshape(-1, 4)[:5])
    with pytest.raises(ValueError, match="more than"):
        w.write_part("x", torch.zeros(2, 4))
    w.write_part("x", x.reshape(-1, 4)[5:])
    w.write("e", torch.zeros(0, 4))
    w.close()
    back = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(back["x"], x) and back["e"].shape == (0, 4)


def test_iter_rows_reads_whole_rows(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {"x3": torch.randn(3, 5, 7, generator=g).bfloat16(), "v": torch.randn(9, generator=g),
               "e": torch.zeros(0, 4), "s": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with SafetensorsDir(tmp_path / "model.safetensors") as d:
        parts = list(d.iter_rows("x3", 20))  # 20 // 7 = 2 rows per chunk of the (15, 7) view
        assert [tuple(p.shape) for p in parts] == [(2, 7)] * 7 + [(1, 7)]
        assert torch.equal(torch.cat(parts).view(torch.uint8), tensors["x3"].reshape(15, 7).view(torch.uint8))
        for n in ("v", "e", "s"):
            (p,) = d.iter_rows(n, 4)
            assert p.shape == tensors[n].shape and torch.equal(p, tensors[n])


# -- reading safely (issue 12 item 5) ------------------------------------------------------------------------
def _header_and_data(f):
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _rewrite(f, header, data):
    hb = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def _in_thread(fn, timeout=20.0):
    """Run ``fn`` in a daemon thread; the exception it raised (None if none). Fails the test if it blocks."""
    import threading

    box = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["exc"] = exc
        box["done"] = True

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert box.get("done"), f"blocked for {timeout} s"
    return box.get("exc")


def test_export_refuses_a_header_shape_claiming_more_bytes_than_its_offsets(tmp_path):
    from mxport.checkpoint import export_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    save_file({"a.weight": torch.randn(4, 64), "b.weight": torch.randn(4, 64)},
              str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    h, data = _header_and_data(src / "model.safetensors")
    h["a.weight"]["shape"] = [5, 64]  # one row more: the neighbour's bytes were exported as that row
    _rewrite(src / "model.safetensors", h, data)
    with pytest.raises(ValueError, match=r"corrupt safetensors header in .*model.safetensors.*invalid shape"):
        export_checkpoint(str(src), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_overlapping_offsets_and_duplicate_keys_refused(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(2, 4), "b": torch.ones(2, 4)}, str(f))
    h, data = _header_and_data(f)
    first, second = sorted(["a", "b"], key=lambda k: h[k]["data_offsets"][0])
    h[second]["data_offsets"] = [h[second]["data_offsets"][0] - 4, h[second]["data_offsets"][1] - 4]
    _rewrite(f, h, data[:-4])  # same sizes, 4 bytes shared with the first tensor
    with pytest.raises(CheckpointError, match="invalid offset"):
        SafetensorsDir(f)
    save_file({"a": torch.ones(2, 4)}, str(f))
    h, data = _header_and_data(f)
    hb = json.dumps(h).encode()[:-1] + b', "a": ' + json.dumps(h["a"]).encode() + b"}"
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + data)
    with pytest.raises(CheckpointError, match="'a' appears twice"):
        SafetensorsDir(f)


def test_fifo_device_and_directory_never_opened(tmp_path):
    import os

    ck = tmp_path / "ck"
    make_mxfp8_dir(ck, "modelopt")
    os.mkfifo(ck / "extra.safetensors")  # no writer: opening it for reading would block forever
    exc = _in_thread(lambda: open_checkpoint(ck))
    assert isinstance(exc, CheckpointError) and "is a FIFO, not a regular file" in str(exc)
    assert "extra.safetensors" in str(exc)
    exc = _in_thread(lambda: SafetensorsDir(ck / "extra.safetensors"))
    assert isinstance(exc, CheckpointError) and "FIFO" in str(exc)
    (ck / "extra.safetensors").unlink()
    (ck / "extra.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="character device"):
        open_checkpoint(ck)
    (ck / "extra.safetensors").unlink()
    (ck / "extra.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="is a directory"):
        open_checkpoint(ck)
    (ck / "extra.safetensors").rmdir()
    (ck / "config.json").unlink()
    os.mkfifo(ck / "config.json")
    exc = _in_thread(lambda: open_checkpoint(ck))
    assert isinstance(exc, CheckpointError) and "config.json" in str(exc)


def test_symlinks_only_inside_the_folder(tmp_path):
    ck = tmp_path / "ck"
    make_mxfp8_dir(ck, "modelopt")
    (ck / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (ck / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        open_checkpoint(ck)
    (ck / "model.safetensors").unlink()
    (tmp_path / "elsewhere.safetensors").rename(ck / "real.bin")
    (ck / "model.safetensors").symlink_to("real.bin")  # inside the folder: fine
    assert open_checkpoint(ck).format == "modelopt"
    # a Hugging Face hub snapshot: files are symlinks into the repo's blobs folder
    snap = tmp_path / "models--x" / "snapshots" / "abc"
    blobs = tmp_path / "models--x" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in ck.iterdir():
        if f.name != "model.safetensors":
            (blobs / f.name).write_bytes(f.read_bytes())
            (snap / ("model.safetensors" if f.name == "real.bin" else f.name)).symlink_to(blobs / f.name)
    assert open_checkpoint(snap).format == "modelopt"


def test_index_must_name_the_folders_shards_and_agree_with_them(tmp_path):
    def fresh(name):
        ck = tmp_path / name
        make_mxfp8_dir(ck, "sglang", sharded=True)
        return ck, json.loads((ck / "model.safetensors.index.json").read_text())

    def write_index(ck, idx):
        (ck / "model.safetensors.index.json").write_text(json.dumps(idx))

    cases = {
        "outside": (lambda m: m.update({k: "../model-00001-of-00002.safetensors" for k in list(m)[:1]}),
                    "of the checkpoint folder itself"),
        "absolute": (lambda m: m.update({k: "/etc/passwd" for k in list(m)[:1]}), "of the checkpoint folder"),
        "omitted tensor": (lambda m: m.pop(next(iter(m))), "omits tensor"),
        "omitted shard": (lambda m: [m.pop(k) for k, v in list(m.items()) if v.startswith("model-00002")],
                          "omits shard"),
        "ghost tensor": (lambda m: m.update({"ghost": next(iter(m.values()))}), "which does not hold them"),
    }
    for name, (edit, message) in cases.items():
        ck, idx = fresh(name.replace(" ", "_"))
        edit(idx["weight_map"])
        write_index(ck, idx)
        with pytest.raises(CheckpointError, match=message):
            open_checkpoint(ck)
    ck, idx = fresh("list")
    idx["weight_map"] = list(idx["weight_map"].items())
    write_index(ck, idx)
    with pytest.raises(CheckpointError, match="'weight_map' must be a non-empty object"):
        open_checkpoint(ck)
    ck, idx = fresh("stray")
    save_file({"stray": torch.ones(1)}, str(ck / "stray.safetensors"))
    with pytest.raises(CheckpointError, match=r"omits shard\(s\) \['stray.safetensors'\]"):
        open_checkpoint(ck)


def test_config_json_checked(tmp_path):
    ck = tmp_path / "ck"
    make_mxfp8_dir(ck, "compressed-tensors")
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text('{"a":' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(CheckpointError, match="config.json .*nested too deeply"):
        open_checkpoint(ck)
    (ck / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json .*expected a JSON object, got list"):
        open_checkpoint(ck)
    groups = cfg["quantization_config"]["config_groups"]
    cfg["quantization_config"]["config_groups"] = list(groups.values())
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'config_groups' must be an object"):
        open_checkpoint(ck)
    cfg["quantization_config"] = ["modelopt"]
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization_config must be an object, got list"):
        open_checkpoint(ck)


def test_pairs_checked_when_opened_and_read(tmp_path):
    ck = tmp_path / "ck"
    make_mxfp8_dir(ck, "modelopt")
    f = ck / "model.safetensors"
    state = load_file(str(f))
    v = "model.layers.0.mlp.down_proj.weight"
    # E4M3 bytes stored as F8_E5M2 (the config says E4M3): decoded as E5M2 they are garbage
    save_file({**state, v: state[v].view(torch.float8_e5m2)}, str(f))
    with pytest.raises(CheckpointError, match="float8_e5m2 values, but the quantization config of format "
                                              "'modelopt' declares float8_e4m3fn"):
        open_checkpoint(ck)
    save_file({k: t for k, t in state.items() if k != v + "_scale"}, str(f))
    with pytest.raises(CheckpointError, match=f"{v}: FP8 values without a scale"):
        open_checkpoint(ck)
    scale = state[v + "_scale"].clone()
    scale[1, 2] = 255
    save_file({**state, v + "_scale": scale}, str(f))
    with open_checkpoint(ck) as r, pytest.raises(CheckpointError, match="1 NaN scale byte"):
        dict(r.iter_tensors())
    values = state[v].clone()
    values.view(torch.uint8)[0, :3] = 0x7F
    save_file({**state, v: values}, str(f))
    with open_checkpoint(ck) as r, pytest.raises(CheckpointError, match="3 NaN/Inf FP8 value"):
        dict(r.iter_tensors())


# -- inspect: typed report and the problems it must report (issue 12 item 10, issue 15) ----------------------
def test_inspect_report_typed_and_dict_keys(tmp_path):
    import dataclasses

    from mxport.checkpoint.inspect import InspectReport, inspect

    make_mxfp8_dir(tmp_path / "ck", "modelopt", k=96)
    rep = inspect(tmp_path / "ck")
    assert isinstance(rep, InspectReport) and rep.ok and rep.format == "modelopt"
    with pytest.raises(dataclasses.FrozenInstanceError):
        rep.format = "sglang"
    d = rep.to_dict()
    assert list(d) == ["path", "format", "format_source", "tensors", "pairs", "totals", "problems",
                       "warnings", "consumers", "quant"]
    assert d["quant"] == "mxfp8"
    assert d == inspect_checkpoint(tmp_path / "ck") and rep["pairs"] == d["pairs"] and len(d["pairs"]) == 2
    json.dumps(d)


def test_inspect_reports_nothing_mxfp8_and_e5m2_sglang(tmp_path):
    (tmp_path / "plain").mkdir()
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "plain" / "model.safetensors"))
    assert inspect_checkpoint(tmp_path / "plain")["problems"] == [
        "nothing MXFP8 in this checkpoint: no FP8 values/scale pair (not quantized?)"]
    ck = tmp_path / "sg"
    make_mxfp8_dir(ck, "sglang", k=96)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"]["fmt"] = "e5m2"  # as older mxport wrote it
    (ck / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(ck / "model.safetensors"))
    save_file({k: (t.float().to(torch.float8_e5m2) if t.dtype == torch.float8_e4m3fn else t)
               for k, t in state.items()}, str(ck / "model.safetensors"))
    problems = inspect_checkpoint(ck)["problems"]
    assert len(problems) == 1 and "SGLang 0.5.23 registers MXFP8 values as E4M3" in problems[0]
    assert open_checkpoint(ck).format == "sglang"  # mxport's own readers decode it right


def test_row_ranges_become_slices_of_the_leading_dimensions():
    """iter_rows reads through safetensors' get_slice, which cuts dimension by dimension: a range of rows of
    the (M, K) view is cut where it crosses a leading index, every range of every shape, in order."""
    from mxport.checkpoint.readers import _row_index

    for lead in [(7,), (3, 5), (2, 3, 4), (1, 1, 3), (4, 1, 2)]:
        m = math.prod(lead)
        a = torch.arange(m * 2).reshape(*lead, 2)
        for r0 in range(m):
            for r1 in range(r0 + 1, m + 1):
                parts = [a[ix].reshape(-1, 2) for ix in _row_index(lead, r0, r1)]
                assert torch.equal(torch.cat(parts), a.reshape(-1, 2)[r0:r1]), (lead, r0, r1)
                assert len(parts) <= 2 * len(lead) - 1
