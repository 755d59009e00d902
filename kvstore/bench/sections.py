"""`--sections` of a benchmark: which of its parts to run."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import InvalidInput


def pick_sections(bench: str, text: str | None, known: Sequence[str], default: Sequence[str]) -> list[str]:
    """The parts named in `text` ("a,b"), checked against `known`; `default` when not given.
    A bad list stops the bench with what it takes."""
    if text is None:
        return list(default)
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    if not chosen or any(s not in known for s in chosen):
        raise InvalidInput(f"{bench}: --sections takes some of {','.join(known)}, not {text!r}")
    return chosen


def positive_ints(bench: str, flag: str, text: str) -> list[int]:
    """A comma-separated list of positive integers ("4096,32768"); a bad one stops the bench
    naming its flag."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise InvalidInput(f"{bench}: {flag} takes positive integers, comma-separated (e.g. 4096,32768), not {text!r}")
    return values
