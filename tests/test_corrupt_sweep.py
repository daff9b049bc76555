"""A subset of the corrupt-checkpoint sweep (tests/corrupt_sweep.py; ``python tests/corrupt_sweep.py`` runs
all of it): each variant through inspect_checkpoint, load_checkpoint and ``mxport verify --checkpoint`` in a
watched worker process; every call must give the expected result or a clear error, never a raw exception, a
traceback, a silent success, a false alarm, a hang or a crash."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import corrupt_sweep as cs  # noqa: E402

SUBSET = [
    "values: shape claims more rows", "values: shape [-1, K]", "values: offsets overlap the previous tensor",
    "scale: offsets beyond the file", "values: dtype F8_E5M2 (config says E4M3)", "scale: dtype I8",
    "header: nested 10000 deep", "header: duplicate tensor key", "header: length 2**62",
    "file: truncated by one byte", "file: one trailing byte", "file: shard is a symlink out of the folder",
    "file: no index, a FIFO named extra.safetensors", "file: no index, a shard is /dev/zero",
    "index: weight_map a list", "index: a shard outside the folder (..)", "index: a whole shard omitted",
    "index: a tensor omitted", "config: quantization_config a list", "config: config_groups a list",
    "hf_quant_config: a FIFO", "pair: scale removed", "pair: scale padded to 128x4",
    "data: one NaN scale byte (255)", "data: NaN FP8 values (0x7F)", "model: a kept tensor removed",
    "model: nothing quantized, no quantization config", "ok: the export as written",
    "ok: no quantization config (format from the names)", "ok: a shard as a symlink inside the folder",
    "ok: no index (shards found by name)", "pair: scales stored as F8_E8M0 (same bytes)",
]


def test_variant_catalogue():
    names = [v.name for v in cs.VARIANTS]
    assert len(names) == len(set(names)) and len(names) >= 120
    assert set(SUBSET) <= set(names)
    assert {v.expect for v in cs.VARIANTS} == {"error", "ok", "model"}


def test_corrupt_subset_gives_clear_results(tmp_path):
    variants = [v for v in cs.VARIANTS if v.name in SUBSET]
    results = cs.sweep(tmp_path, variants, timeout=60)
    assert len(results) == len(SUBSET) * len(cs.OPS)
    bad = [f"{r['category']}: {r['op']} {r['variant']}: {r['detail'][:200]}" for r in results
           if r["category"] not in cs.GOOD]
    assert not bad, "\n".join(bad)
    table = cs.counts(results)
    assert table["correct"]["inspect"] >= 8  # the valid variants and the problems inspect reports
