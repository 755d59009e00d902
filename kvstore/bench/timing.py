"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_rate(fn: Callable[[], int], repeats: int = 3) -> float:
    """Run `fn` (which returns bytes moved) `repeats` times; the best GB/s (1e9 bytes/s).

    The best of a few runs is the figure least disturbed by other load on a shared machine.
    """
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        nbytes = fn()
        dt = time.perf_counter() - t0
        best = max(best, nbytes / dt / 1e9)
    return best


def interleaved_best_rates(contenders: dict[str, Callable[[], int]], repeats: int = 15) -> dict[str, float]:
    """`best_rate` for several contenders whose passes take turns (a, b, c, a, b, c, ...): a burst
    of load from another process then falls on all of them instead of on whichever ran during
    it, which matters when one pass lasts only a few milliseconds."""
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
