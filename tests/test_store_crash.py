"""Crash safety: a writer SIGKILLed at a random moment loses nothing acknowledged as durable,
and the reopened store never serves a chunk that fails its checksum."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.store_writer import WRITER_CONFIG
from tests.store_helpers import CHUNK, expected_payloads, open_store, tokens_for

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 12


def test_sigkill_at_random_points_loses_nothing_acknowledged(tmp_path: Path) -> None:
    rng = random.Random(1234)
    acked: list[int] = []
    next_seed = 0
    for _round in range(ROUNDS):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.store_writer", str(tmp_path), str(next_seed), "400"],
            cwd=REPO, stdout=subprocess.PIPE, text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # started and wrote at least one prefix
        if first.strip():
            acked.append(int(first))
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        acked.extend(int(x) for x in rest.split())
        next_seed += 400
        store = open_store(tmp_path, **WRITER_CONFIG)
        ns = store.namespace("default", "reference-toy-8", "bounded")
        for seed in acked:
            t = tokens_for(seed, 3 * CHUNK)
            assert store.lookup(ns, t).hit_chunks == 3, f"acknowledged prefix {seed} lost"
        # Every chunk in the database verifies: load a sample fully.
        for seed in rng.sample(acked, min(20, len(acked))):
            t = tokens_for(seed, 3 * CHUNK)
            with store.load(ns, t) as s:
                got = [bytes(c.payload) for c in s]
            assert got == expected_payloads(store, ns, t, 3)
        assert store.stats().corrupt_reads == 0
        # Nothing was evicted: a loss can only have been a durability bug, not a budget decision.
        assert store.stats().tiers["lmdb"].evictions == 0
        store.check_invariants()
        store.close()
    assert len(acked) > ROUNDS  # the test really exercised durable writes
