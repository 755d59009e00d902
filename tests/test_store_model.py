"""A hypothesis state machine: the store against a dict model, over two tenants and two models.

The durable tier is large enough to hold everything, so the model predicts every hit exactly,
while the device and DRAM tiers are tiny, so every step also demotes and promotes. After every
step the budgets hold; a load never returns another tenant's or another model's bytes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.store import GlobalStore, TenantQuota
from tests.store_helpers import CHUNK, expected_payloads, open_store, store_prefix

TENANTS = ("t1", "t2")
MODEL_NAMES = ("reference-toy-8", "deepseek-v4.1-flash")
SEQS = [np.random.default_rng(s).integers(0, 512, 6 * CHUNK).astype("<u4") for s in (1, 2)]
QUOTAS = {"t2": TenantQuota(device_bytes=16 * 1024, dram_bytes=32 * 1024)}


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvs-sm-"))
        self.store: GlobalStore = self._open()
        self.stored: dict[tuple[str, str, int], int] = {}  # -> longest stored prefix in chunks

    def _open(self) -> GlobalStore:
        return open_store(self.dir, quotas=QUOTAS, device_capacity_bytes=32 * 1024,
                          dram_capacity_bytes=64 * 1024, lmdb_capacity_bytes=64 << 20,
                          eviction_policy="lru")

    @rule(tenant=st.sampled_from(TENANTS), model=st.sampled_from(MODEL_NAMES),
          seq=st.integers(0, 1), k=st.integers(1, 6))
    def store_prefix(self, tenant: str, model: str, seq: int, k: int) -> None:
        ns = self.store.namespace(tenant, model, "bounded")
        res = store_prefix(self.store, ns, SEQS[seq][: k * CHUNK])
        assert res.durable
        key = (tenant, model, seq)
        self.stored[key] = max(self.stored.get(key, 0), k)

    @rule(tenant=st.sampled_from(TENANTS), model=st.sampled_from(MODEL_NAMES),
          seq=st.integers(0, 1), n=st.integers(0, 6))
    def lookup_and_load(self, tenant: str, model: str, seq: int, n: int) -> None:
        ns = self.store.namespace(tenant, model, "bounded")
        tokens = SEQS[seq][: n * CHUNK]
        want = min(n, self.stored.get((tenant, model, seq), 0))
        assert self.store.lookup(ns, tokens).hit_chunks == want
        with self.store.load(ns, tokens) as session:
            got = [bytes(c.payload) for c in session]
        assert got == expected_payloads(self.store, ns, tokens, want)

    @precondition(lambda self: bool(self.stored))
    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = self._open()

    @invariant()
    def budgets_hold(self) -> None:
        self.store.check_invariants()

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
TestStoreMachine = StoreMachine.TestCase
