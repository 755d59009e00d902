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
