"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


def interleaved_best_rates(contenders: dict[str, Callable[[], int]], repeats: int = 15, *,
                           rotate: bool = False,
                           prepare: Mapping[str, Callable[[], None]] | None = None) -> dict[str, float]:
    """The best GB/s (1e9 bytes/s) of each contender (`fn()` returns the bytes it moved) over
    `repeats` passes, the passes taking turns (a, b, c, a, b, c, ...). The best of a few passes is
    the figure least disturbed by other load on a shared machine, and taking turns puts a burst of
    it on all of them instead of on whichever ran during it, which matters when one pass lasts
    only a few milliseconds.

    `rotate`: each turn starts one contender later (a, b, c; b, c, a; ...), so that none always
    runs first, right after the previous turn's last. `prepare[name]` runs untimed right before
    each of that contender's passes (undoing the previous pass's work)."""
    best = dict.fromkeys(contenders, 0.0)
    order = list(contenders.items())
    for turn in range(repeats):
        shift = turn % len(order) if rotate and order else 0
        for name, fn in order[shift:] + order[:shift]:
            if prepare is not None and name in prepare:
                prepare[name]()
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
