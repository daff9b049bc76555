"""Refit benchmark: refit throughput vs a raw dist.broadcast of the same bytes, the end-to-end refit step
split into quantize / pack / transfer / unpack / wait, and against BF16 broadcast + receiver quantize (two
processes, gloo loopback).

Usage: ``.venv/bin/python benchmarks/bench_refit.py [--quick]`` (same rows as ``mxport bench --only refit``);
``benchmarks/bench_refit.py --large [--threads N] [--runs N]``: a ~1 GB refit (22 BF16 layers of a 1B-class
Llama's shapes: 1.0 GB of MXFP8 from 2.0 GB of BF16), about 10 GB of memory.
"""

import argparse

from mxport.bench.report import script_main


def _large(runs: int, threads: int) -> None:
    from rich.console import Console

    from mxport.bench.refit import run_large
    from mxport.bench.report import rows_table

    rows = run_large(runs=runs, threads=threads)
    Console().print(rows_table(rows, title="refit, ~1 GB synthetic model (medians)"))
    for r in rows:
        print(r)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the quick mode of the standard rows")
    parser.add_argument("--large", action="store_true", help="the ~1 GB refit instead of the standard rows")
    parser.add_argument("--runs", type=int, default=5, help="--large: runs (medians)")
    parser.add_argument("--threads", type=int, default=1, help="--large: torch threads per process")
    args = parser.parse_args()
    if args.large:
        _large(args.runs, args.threads)
    else:
        script_main("refit", ["--quick"] if args.quick else [])
