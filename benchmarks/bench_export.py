"""Issue 3's benchmark: export_components of a TE-layout 8192x8192 weight (views; swizzled) vs quantize of it.

Usage: ``.venv/bin/python benchmarks/bench_export.py [--quick]`` (same rows as ``mxport bench --only export``).
"""

import sys

from rich.console import Console

from mxport.bench.export import run
from mxport.bench.report import rows_table

if __name__ == "__main__":
    rows = run(quick="--quick" in sys.argv[1:])
    Console().print(rows_table(rows, title="export (medians)"))
    for r in rows:
        print(r)
