"""The refit benchmark (refit throughput vs a raw dist.broadcast of the same bytes) on a SmolLM2-135M-shaped
model with random weights: the same 272 tensors and bytes as the embedded model (166.2 MB, kept tensors in
BF16), for machines where it is not installed (it needs only torch and transformers; run from the
repository root with ``PYTHONPATH=src`` if mxport is not installed).
The rows are those of ``mxport bench --only refit``.

Usage: ``.venv/bin/python benchmarks/bench_refit_shaped.py [RUNS] [BUCKET_MB]`` (defaults 7 and 32).
"""

import sys

from rich.console import Console

from mxport.bench.refit import run_shaped
from mxport.bench.report import rows_table

if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    rows = run_shaped(*args)
    Console().print(rows_table(rows, title="refit, SmolLM2-135M-shaped (medians)"))
    for r in rows:
        print(r)
