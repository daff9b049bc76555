"""Export benchmark: export_components of a TE-layout 8192x8192 weight (views; swizzled) vs quantize of it.

Usage: ``.venv/bin/python benchmarks/bench_export.py [--quick]`` (same rows as ``mxport bench --only
    export``).
"""

from mxport.bench.report import script_main

if __name__ == "__main__":
    script_main("export")
