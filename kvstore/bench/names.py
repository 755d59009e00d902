"""A note for figures whose names carry a flag's default (`lookup_32k_p50_ms` for `--tokens 32768`).

The names stay those of the defaults whatever the flags say, so that a reader (BENCHMARKS.md, the
tests, a script comparing runs) finds the same keys in every run; a run with other sizes says so.
"""

from __future__ import annotations

import argparse


def names_note(args: argparse.Namespace, defaults: dict[str, tuple[str, int]]) -> dict[str, str]:
    """{"names_note": ...} where a flag named in `defaults` (its dest: (the part of the names that
    stands for it, its default)) was given another value; else {}. `dest[i]` names the i-th value
    of a flag that takes several (`toy_chunks[1]`: the second of `--toy-chunks SMALL LARGE`)."""
    off = [(dest, word, default) for dest, (word, default) in defaults.items() if _value(args, dest) != default]
    if not off:
        return {}
    said = ", ".join(f"`{word}` stands for {default:,} ({_flag(args, dest)} in this run)"
                     for dest, word, default in off)
    return {"names_note": f"figure and target names are those of the defaults: {said}"}


def _value(args: argparse.Namespace, dest: str) -> int:
    name, _, index = dest.partition("[")
    value = getattr(args, name)
    return int(value[int(index.rstrip("]"))]) if index else int(value)


def _flag(args: argparse.Namespace, dest: str) -> str:
    """The flag as given: `--toy-chunks 2,000 4,000` (all its values) for `toy_chunks[0]`."""
    name = dest.partition("[")[0]
    value = getattr(args, name)
    shown = " ".join(f"{v:,}" for v in value) if isinstance(value, list | tuple) else f"{value:,}"
    return f"--{name.replace('_', '-')} {shown}"
