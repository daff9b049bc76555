"""Sharded refit benchmark (issue 14), T trainer ranks -> E engine ranks: mxport's sharded MXFP8 refit
against gather BF16 + broadcast + engine quantize, with the capacity model's predictions
(``mxport.bench.refit_sharded``; its rows are those of ``mxport bench --only refit_sharded``).

Usage (from the repository root; ``PYTHONPATH=src`` when mxport is not installed)::

    python benchmarks/bench_refit_sharded.py --quick [--json out.json]
    python benchmarks/bench_refit_sharded.py                    # 64 MB and 256 MB, T = 2, 4; E = 1, 2
    python benchmarks/bench_refit_sharded.py --tiny --json -    # seconds: the test's mode
"""

import sys

from mxport.bench.refit_sharded import main

if __name__ == "__main__":
    sys.exit(main())
