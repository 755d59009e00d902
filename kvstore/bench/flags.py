"""argparse types for counts, sizes, seconds and directories of the benchmarks' (and a few other
commands') flags: a value out of range is refused while the command line is parsed, as argparse's
one line and exit 2, before a service starts or a file is written; not a ZeroDivisionError, a
misleading error or a traceback from deep inside, minutes later."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable


def count(least: int = 1, most: int = 1_000_000) -> Callable[[str], int]:
    """An integer in [least, most]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be {least:,} to {most:,}, got {value:,}")
        return value

    return parse


def finite(least: float, most: float, unit: str = "", *, above: bool = False,
           below: bool = False) -> Callable[[str], float]:
    """A finite number in [least, most] (float() takes "nan" and "inf"); `unit` names it in errors.
    `above` / `below` leave `least` / `most` out of the range."""
    what = f"a number of {unit}" if unit else "a number"
    low = f"> {least:g}" if above else f">= {least:g}"
    high = f"< {most:g}" if below else f"<= {most:g}"
    bounds = (f"from {least:g} to {most:g}" if not (above or below) and math.isfinite(least)
              else f"{low} and {high}" if math.isfinite(least) else f"at most {most:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        in_range = (value > least if above else value >= least) and (value < most if below else value <= most)
        if not (math.isfinite(value) and in_range):
            raise argparse.ArgumentTypeError(f"must be a finite{what[1:]} {bounds}, got {text}")
        return value

    return parse


def seconds(least: float = 0.0, most: float = 86_400.0) -> Callable[[str], float]:
    """A finite number of seconds in [least, most]."""
    return finite(least, most, "seconds")


def writable_dir(text: str) -> str:
    """An existing directory this user may create files in (a temp dir is made inside it)."""
    if "\0" in text:
        raise argparse.ArgumentTypeError("a path cannot contain a NUL")
    if not text:  # said as ": not an existing directory"
        raise argparse.ArgumentTypeError("must not be empty (it names a directory)")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: not an existing directory")
    # os.access says yes to root on a read-only mount: ask the file system too.
    if not os.access(text, os.W_OK | os.X_OK) or os.statvfs(text).f_flag & os.ST_RDONLY:
        raise argparse.ArgumentTypeError(f"{text}: not writable here")
    return text


class OutputPath(str):
    """A path `writable_file` accepted: a file the command writes. The CLI tells such flags apart by
    this type, to name the flag and path in one line when writing fails (a full disk, /dev/full)."""

    __slots__ = ()


def writable_file(make_parents: bool = False) -> Callable[[str], str]:
    """A file the command writes once its run is done (tables, a plot, a trace): no directory, in
    one that exists (or, with `make_parents`, under the nearest one that does, for a writer that
    makes the rest) and takes files. Said after the run, a bad one cost its whole time."""

    def parse(text: str) -> str:
        if "\0" in text:
            raise argparse.ArgumentTypeError("a path cannot contain a NUL")
        if not text:  # Path('') is '.', a directory
            raise argparse.ArgumentTypeError("must not be empty (it names a file to write)")
        if os.path.isdir(text) or text.endswith(os.sep):
            raise argparse.ArgumentTypeError(f"{text}: is a directory (name a file in it)")
        parent = os.path.dirname(os.path.abspath(text))
        while make_parents and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(f"{text}: {os.path.dirname(text) or '.'} is not an existing directory")
        writable = os.access(text, os.W_OK) if os.path.exists(text) else os.access(parent, os.W_OK | os.X_OK)
        # os.access says yes to root on a read-only mount: ask the file system too.
        if not writable or os.statvfs(parent).f_flag & os.ST_RDONLY:
            raise argparse.ArgumentTypeError(f"{text}: not writable here")
        return OutputPath(text)

    return parse
