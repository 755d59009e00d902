"""`--json` output: figures as JSON that any parser reads. Python's json writes NaN and Infinity,
which JSON does not have (a strict reader refuses the whole document); a figure that is not a
finite number (a ratio over a zero, a percentile of no samples) is written as null instead."""

from __future__ import annotations

import json
import math
from typing import IO, Any


def finite_or_none(value: Any) -> Any:
    """`value` with every NaN or infinite float, at any depth of dicts, lists and tuples, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def dump_json(doc: Any, out: IO[str]) -> None:
    """`doc` as indented JSON and a newline; allow_nan=False: a non-finite number left is a bug here."""
    json.dump(finite_or_none(doc), out, indent=2, allow_nan=False)
    out.write("\n")
