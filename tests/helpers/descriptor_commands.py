"""For a child process (`ScriptedChild`) whose listener the test runs out of descriptors: its
"accept failed" warnings counted, and the test's commands answered one JSON line each: "fill"
(RLIMIT_NOFILE lowered to a few over those open, then every one left taken), "free" (all given back)
and "stats" (the warnings, and whatever the caller's `stats` adds). Any other line ends it."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from collections.abc import Callable
from typing import Any


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts = {"accept failed": 0, "all": 0}

    def emit(self, record: logging.LogRecord) -> None:
        self.counts["all"] += 1
        self.counts["accept failed"] += "accept failed" in record.getMessage()


def count_warnings() -> dict[str, int]:
    """The counts of kvstore's warnings from now on, kept up to date."""
    handler = _Warnings()
    logging.getLogger("kvstore").addHandler(handler)
    return handler.counts


def say(**answer: Any) -> None:
    print(json.dumps(answer), flush=True)


def answer_commands(warnings: dict[str, int], stats: Callable[[], dict[str, Any]]) -> None:
    held: list[int] = []
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "fill":
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, limits[1]))
            while True:
                try:
                    held.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    break
            say(held=len(held))
        elif cmd == "free":
            for fd in held:
                os.close(fd)
            held.clear()
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            say(freed=True)
        elif cmd == "stats":
            say(warnings=warnings, **stats())
        else:
            break
