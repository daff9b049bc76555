"""Fuzz mxport's public API with a bigger budget than the test and print the outcome counts.

    PYTHONPATH=src python scripts/fuzz_api.py [--cases N] [--seeds S ...] [--json FILE]

Each case is classified (tests/fuzz_api.py): correct (a result equal to the independent reference), clear
(TypeError / ValueError naming an argument), unclear (TypeError / ValueError naming none), wrong (a result
that differs from the reference), raw (any other exception). A crash (the process dying) stops the run: the
exit code says so. Exit 0 when there is no wrong / unclear / raw outcome, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

# as the tests: compiling costs tens of seconds per graph
os.environ.setdefault("MXPORT_DISABLE_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fuzz_api  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20000, help="cases per seed (default 20000)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--json", help="write the counts and the first failures as JSON to this file")
    args = ap.parse_args(argv)
    total, failures, start = Counter(), [], time.perf_counter()
    for seed in args.seeds:
        stats = fuzz_api.run(args.cases, seed=seed)
        total.update(stats.counts)
        failures += stats.failures
        print(f"seed {seed}: {dict(sorted(stats.counts.items()))}", flush=True)
    counts = {k: total.get(k, 0) for k in ("correct", "clear", "unclear", "wrong", "raw")}
    counts["crashes"] = 0  # a crash would have ended this process before this line
    print(f"total {sum(total.values())} cases in {time.perf_counter() - start:.0f} s: {counts}")
    for f in failures[:20]:
        print(" ", f)
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": sum(total.values()), "counts": counts,
                                               "seeds": args.seeds, "failures": failures}, indent=2) + "\n")
    return 0 if counts["wrong"] == counts["unclear"] == counts["raw"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
