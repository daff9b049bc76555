"""Quantize benchmark: BF16 4096x4096 -> MXFP8 rowwise vs torchao to_mx (RCEIL) and the copy_ memory bound.

Usage: ``.venv/bin/python benchmarks/bench_quantize.py [--quick]`` (same rows as ``mxport bench --only
    quantize``).
"""

from mxport.bench.report import script_main

if __name__ == "__main__":
    script_main("quantize")
