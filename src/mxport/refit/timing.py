"""A stopwatch that adds up the time spent in named phases (the refit stats' ``*_s`` fields)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class Stopwatch:
    """Started when built; ``with sw.phase("pack"):`` adds that block's seconds to ``sw["pack"]``;
    ``sw.mark(name)`` records an instant, ``sw.between(a, b)`` the seconds between two."""

    def __init__(self):
        self.start = time.perf_counter()
        self._spent: defaultdict[str, float] = defaultdict(float)
        self._marks: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        """Record instant ``name`` (now, or ``at``, a ``time.perf_counter()`` value)."""
        self._marks[name] = time.perf_counter() if at is None else at

    def between(self, first: str, last: str) -> float:
        return self._marks[last] - self._marks[first]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._spent[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` spent elsewhere to phase ``name``."""
        self._spent[name] += seconds

    def __getitem__(self, name: str) -> float:
        """Seconds spent in phase ``name`` so far (0.0 if never entered)."""
        return self._spent.get(name, 0.0)

    def elapsed(self) -> float:
        """Seconds since the stopwatch was built."""
        return time.perf_counter() - self.start
