"""Issue 4's benchmark: export of a synthetic sharded BF16 checkpoint to MXFP8 (modelopt) vs a plain safetensors
load-and-save of the same checkpoint: throughput (GB/s of input) and peak RSS, each side in its own process.

Usage: ``.venv/bin/python benchmarks/bench_checkpoint.py [--quick]`` (same rows as ``mxport bench --only checkpoint``).
"""

import sys

from rich.console import Console

from mxport.bench.checkpoint import run
from mxport.bench.report import rows_table

if __name__ == "__main__":
    rows = run(quick="--quick" in sys.argv[1:])
    Console().print(rows_table(rows, title="checkpoint export (medians)"))
    for r in rows:
        print(r)
