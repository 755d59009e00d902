"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def interleaved_best_rates(contenders: dict[str, Callable[[], int]], repeats: int = 15) -> dict[str, float]:
    """The best GB/s (1e9 bytes/s) of each contender (`fn()` returns the bytes it moved) over
    `repeats` passes, the passes taking turns (a, b, c, a, b, c, ...). The best of a few passes is
    the figure least disturbed by other load on a shared machine, and taking turns puts a burst of
    it on all of them instead of on whichever ran during it, which matters when one pass lasts
    only a few milliseconds."""
    best = dict.fromkeys(contenders, 0.0)
    for _ in range(repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            nbytes = fn()
            dt = time.perf_counter() - t0
            best[name] = max(best[name], nbytes / dt / 1e9)
    return best


def percentile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]
