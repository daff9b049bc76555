"""Checkpoint-export benchmark: export of a synthetic sharded BF16 checkpoint to MXFP8 (modelopt) vs a plain
safetensors load-and-save of the same checkpoint: throughput (GB/s of input) and peak RSS, each side in its
own process.

Usage: ``.venv/bin/python benchmarks/bench_checkpoint.py [--quick]`` (same rows as ``mxport bench --only
    checkpoint``).
"""

from mxport.bench.report import script_main

if __name__ == "__main__":
    script_main("checkpoint")
