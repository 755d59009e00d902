"""Checks that need a short TTL not to have run out yet (a hit before it expires), made only when
the test got there in time: a loaded machine can stall a test thread past a TTL of a fraction of
a second. Such a try proves nothing either way, so it is run again on keys of its own, rather
than failing the test or making every TTL (and the test) longer."""

from __future__ import annotations

import time
from collections.abc import Callable


class Stalled(Exception):
    """A step due before a short TTL ran out came after it."""


def due(since: float, seconds: float) -> None:
    """Raise `Stalled` unless it is still less than `seconds` after `since` (a `time.monotonic()`
    taken before what started the TTL). Call it after the step returned, before checking it."""
    if time.monotonic() - since >= seconds:
        raise Stalled


def until_in_time(run: Callable[[int], None], tries: int = 5) -> None:
    """`run(i)` (i: the try, for keys of its own) again while a try stalled past a TTL it counted on."""
    for i in range(tries):
        try:
            run(i)
            return
        except Stalled:
            continue
    raise AssertionError(f"{tries} tries in a row stalled past the TTLs they counted on")
