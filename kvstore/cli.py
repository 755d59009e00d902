"""The `kvstore` command line. Each subcommand lives in its own module under `kvstore/commands/`
and exposes `add_arguments(parser)` and `run(args) -> int`; this file only dispatches.

Command modules import torch and grpc inside `run` only, and a bench's module (which imports what
it measures) only once that bench is chosen, so building the parser and `kvstore --help` load
neither (tests/test_cli_imports.py checks).
Errors a user can fix (bad flags, bad config, a service that is not running) print one clear
line to stderr and exit 2; they never print a traceback. Output piped to a reader that stops
early (`| head`) ends the command quietly with status 141, as SIGPIPE would. SIGTERM stops a
command as Ctrl-C does, its clean-up run (children stopped, temporary files removed): one line,
status 143 (`serve` and `runner` drain instead, as their modules say).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Sequence

from kvstore.bench.flags import OutputPath
from kvstore.commands.bench import BENCHES
from kvstore.commands.stop_signals import Terminated, sigterm_raises
from kvstore.errors import KvstoreError

EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE
EXIT_SIGTERM = 128 + 15  # what a shell reports for a command SIGTERM killed
# What a write() that names no file fails with when the file cannot take the bytes.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})

# (subcommand, module under kvstore.commands, one-line help)
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("demo", "demo", "play one agent session (cold, warm, expired; 3 times by default) on the embedded default"),
    ("serve", "serve", "run the gRPC service and the admin HTTP port"),
    ("stats", "stats", "ask a running service for its statistics"),
    ("layout", "layout", "show a model's cache layout and capacity arithmetic"),
    ("check-config", "check_config", "validate a config file and print the effective settings"),
    # The names come from the benches `kvstore bench` registers, so the list cannot go stale.
    ("bench", "bench", f"run a benchmark ({', '.join(BENCHES)})"),
    ("runner", "runner", "run the reference model as a runner attached to a service"),
    ("replay-quality", "replay_quality", "measure bounded vs exact replay error on the reference model"),
    ("tune", "tune", "evaluate TTL policies offline against a recorded trace"),
    ("explain", "explain", "explain why a recent request missed"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="kvstore: a tiered KV-cache persistence service with bounded replay (gRPC sidecar).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_text in COMMANDS:
        mod = importlib.import_module(f"kvstore.commands.{module}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:  # here, not at interpreter exit, so that a closed pipe is caught below
            sys.stdout.flush()
    except BrokenPipeError:
        # Whoever read stdout stopped (`kvstore stats --json | head -1`): stop quietly with the
        # status of a command killed by SIGPIPE (128 + 13), as coreutils would, so that a script
        # can still tell the output was cut short. What is left to flush goes to /dev/null, or the
        # interpreter fails again on it at exit.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (captured, in tests)
            pass
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    if sys.byteorder != "little":
        # Chunks, token ids and checksums are little-endian on disk and on the wire, and numpy reads
        # them in the host's order in places: refused rather than read wrong.
        print(f"kvstore {args.command}: runs on little-endian hosts only (x86-64, aarch64); this one is "
              f"{sys.byteorder}-endian", file=sys.stderr)
        return 2
    try:
        # `serve` and `runner` set handlers of their own (a clean drain); every other command's
        # `with` and `finally` blocks stop its children and remove its temporary files on SIGTERM.
        with sigterm_raises():
            return int(args._run(args))
    except KvstoreError as e:
        print(f"kvstore {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        print(f"kvstore {args.command}: stopped by SIGTERM", file=sys.stderr)
        return EXIT_SIGTERM
    except OSError as e:
        said = _output_failure(args, e)
        if said is None:
            raise
        print(f"kvstore {args.command}: {said}", file=sys.stderr)
        return 1


def _output_failure(args: argparse.Namespace, e: OSError) -> str | None:
    """The line for an OSError in writing a file a flag named (`--markdown /dev/full`, a full disk),
    or None when it is no such failure: another OSError keeps its traceback. A failed write() names
    no file: one of WRITE_ERRNOS is taken to be the output's (with several given, all are named)."""
    outputs = {f"--{dest.replace('_', '-')}": v for dest, v in vars(args).items() if isinstance(v, OutputPath)}
    if not outputs or isinstance(e, BrokenPipeError):  # stdout's reader gone: main's to say
        return None
    why = e.strerror or str(e)
    named = [flag for flag, path in outputs.items() if e.filename is not None and os.fspath(e.filename) == path]
    if named:
        return f"{named[0]} {outputs[named[0]]}: cannot write it: {why}"
    if e.filename is not None or e.errno not in WRITE_ERRNOS:  # another file's failure, or no write's
        return None
    if len(outputs) == 1:
        flag, path = next(iter(outputs.items()))
        return f"{flag} {path}: cannot write it: {why}"
    return "cannot write an output (" + ", ".join(f"{f} {p}" for f, p in outputs.items()) + f"): {why}"


if __name__ == "__main__":
    sys.exit(main())
