"""A note for figures whose names carry a flag's default (`lookup_32k_p50_ms` for `--tokens 32768`).

The names stay those of the defaults whatever the flags say, so that a reader (BENCHMARKS.md, the
tests, a script comparing runs) finds the same keys in every run; a run with other sizes says so.
"""

from __future__ import annotations

import argparse


def names_note(args: argparse.Namespace, defaults: dict[str, tuple[str, int]]) -> dict[str, str]:
    """{"names_note": ...} where a flag named in `defaults` (its dest: (the part of the names that
    stands for it, its default)) was given another value; else {}."""
    off = [(dest, word, default) for dest, (word, default) in defaults.items() if getattr(args, dest) != default]
    if not off:
        return {}
    said = ", ".join(f"`{word}` stands for {default:,} (--{dest.replace('_', '-')} {getattr(args, dest):,} in this run)"
                     for dest, word, default in off)
    return {"names_note": f"figure and target names are those of the defaults: {said}"}
