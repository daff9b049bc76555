"""Timing helpers shared by every benchmark: medians over repeated runs after warm-up, and peak RSS."""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median over ``runs`` timed calls (after warm-up), plus min and max."""

    median: float
    min: float
    max: float
    runs: int


def _sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(fn: Callable[[], object], *, runs: int = 5, warmup: int = 1, device=None) -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``runs`` times timed; return the median (seconds)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), min(times), max(times), runs)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss), in bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def proc_kib_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file (``/proc/meminfo``'s ``MemAvailable``, ``/proc/self/status``'s
    ``VmHWM``) in bytes, or None where the file or the line is not there."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
