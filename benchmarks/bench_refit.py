"""Refit benchmark: refit throughput vs a raw dist.broadcast of the same bytes, the end-to-end refit step
split into quantize / pack / transfer / unpack / wait, and against BF16 broadcast + receiver quantize (two
processes, gloo loopback).

Usage: ``.venv/bin/python benchmarks/bench_refit.py [--quick]`` (same rows as ``mxport bench --only refit``);
``benchmarks/bench_refit.py --large [--threads N] [--runs N]``: a ~1 GB refit (22 BF16 layers of a 1B-class
Llama's shapes: 1.0 GB of MXFP8 from 2.0 GB of BF16), about 10 GB of memory.
"""

import sys

from mxport.bench.report import script_main


def _large(argv: list[str]) -> None:
    from rich.console import Console

    from mxport.bench.refit import run_large
    from mxport.bench.report import rows_table

    def opt(name: str, default: int) -> int:
        return int(argv[argv.index(name) + 1]) if name in argv else default

    rows = run_large(runs=opt("--runs", 5), threads=opt("--threads", 1))
    Console().print(rows_table(rows, title="refit, ~1 GB synthetic model (medians)"))
    for r in rows:
        print(r)


if __name__ == "__main__":
    if "--large" in sys.argv[1:]:
        _large(sys.argv[1:])
    else:
        script_main("refit")
