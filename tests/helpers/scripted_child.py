"""A Python process run from a script that answers commands: the test writes a command per line
on its stdin, and the child answers each with one JSON line on its stdout (its first line says it
is ready). For faults that must stay inside the child (lowering its descriptor limit)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[2]


class ScriptedChild:
    def __init__(self, script: str, args: list[str], stderr: Path, what: str) -> None:
        """Run `script` with `args`; its stderr into the file `stderr`; `what`: named when it does
        not answer. Waits for its first line (ready), kept as `ready`."""
        self._what = what
        self._err: TextIO = stderr.open("w")
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)))
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.answer(60.0)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._answers.put(json.loads(line))

    def answer(self, timeout: float = 30.0) -> dict[str, Any]:
        try:
            return self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the {self._what} did not answer (exit {self.proc.poll()})") from None

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        """Ask it to stop ("stop"), and kill it if it has not within 20 s."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):  # it has gone already
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()
