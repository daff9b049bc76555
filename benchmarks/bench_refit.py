"""Issue 6's benchmark: refit throughput vs a raw dist.broadcast of the same bytes, and the end-to-end refit step
split into quantize / pack / transfer / unpack (two processes, gloo loopback).

Usage: ``.venv/bin/python benchmarks/bench_refit.py [--quick]`` (same rows as ``mxport bench --only refit``).
"""

import sys

from rich.console import Console

from mxport.bench.refit import run
from mxport.bench.report import rows_table

if __name__ == "__main__":
    rows = run(quick="--quick" in sys.argv[1:])
    Console().print(rows_table(rows, title="refit (medians)"))
    for r in rows:
        print(r)
