"""Issue 2's benchmark: BF16 4096x4096 -> MXFP8 rowwise vs torchao to_mx (RCEIL) and the copy_ memory bound.

Usage: ``.venv/bin/python benchmarks/bench_quantize.py [--quick]`` (same rows as ``mxport bench --only quantize``).
"""

import sys

from rich.console import Console

from mxport.bench.quantize import run
from mxport.bench.report import rows_table

if __name__ == "__main__":
    rows = run(quick="--quick" in sys.argv[1:])
    Console().print(rows_table(rows, title="quantize (medians)"))
    for r in rows:
        print(r)
