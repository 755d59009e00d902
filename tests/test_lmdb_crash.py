"""Crash test: a child process putting chunks in "sync" mode is SIGKILLed at a random moment.

The child prints each key only after the put_many holding it returned (acknowledged as
durable). After the kill the parent reopens the directory and checks that every acknowledged
chunk is there with the right bytes, and that no entry at all fails its checksum, whatever the
transaction the child was in the middle of. A SIGKILL loses what was in flight, not what the OS
already has; it does not simulate a power cut (that needs a fault-injecting block device).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.tier_data import check_chunk, open_tier

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 24


def run_round(path: Path, seed: int, kill_after_s: float) -> list[bytes]:
    """Start a writer, kill it kill_after_s after it is ready; the keys it acknowledged."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.tier_crash_writer", str(path), str(seed)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first == b"ready\n", (first, child.stderr.read() if child.stderr else b"")
        time.sleep(kill_after_s)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
    assert child.returncode == -signal.SIGKILL
    # Only complete lines count: a key cut off mid-print was not acknowledged.
    return [bytes.fromhex(line) for line in out.decode().split("\n")[:-1]]


def test_every_acknowledged_chunk_survives_a_sigkill(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    acked: list[bytes] = []
    for round_no in range(ROUNDS):
        acked += run_round(tmp_path, seed=round_no, kill_after_s=rng.uniform(0.0, 0.25))
        tier = open_tier(tmp_path)
        try:
            scanned = list(tier.scan(verify=True))
            assert [sc.problem for sc in scanned if not sc.ok] == []
            present = {sc.key for sc in scanned}
            missing = [k.hex() for k in acked if k not in present]
            assert not missing, f"round {round_no}: acknowledged but lost: {missing[:3]}"
            errors = {k.hex(): err for k in acked if (err := check_chunk(tier, k))}
            assert not errors, f"round {round_no}: {errors}"
            assert tier.stats().corrupt_total == 0
        finally:
            tier.close()
    assert len(acked) > ROUNDS  # the kills did land in the middle of real work
