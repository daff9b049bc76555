"""Refit benchmark: refit throughput vs a raw dist.broadcast of the same bytes, and the end-to-end refit step
split into quantize / pack / transfer / unpack (two processes, gloo loopback).

Usage: ``.venv/bin/python benchmarks/bench_refit.py [--quick]`` (same rows as ``mxport bench --only refit``).
"""

from mxport.bench.report import script_main

if __name__ == "__main__":
    script_main("refit")
