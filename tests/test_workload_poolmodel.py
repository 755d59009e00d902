"""The simulated mode's pool model against the real embedded pool: given the same operations on
the same clock, the same decisions (hits, skips and why, evictions, which entries are held), with
tenants of different TTLs and weights sharing a small budget; and its own accounting (byte-seconds,
miss reasons) when a write's tentative evictions are put back."""

from __future__ import annotations

import random

import pytest

from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES, EmbeddedPool
from kvstore.workload.poolmodel import PoolModel
from tests.fixtures.clock import ManualClock

LAYOUT = b"layout01"
UNIT = 1000 + ENTRY_OVERHEAD_BYTES  # what a 1,000-byte snapshot counts against the budget


class ByTenant:
    """A write TTL per tenant; `refresh`: tenants whose hits slide the TTL; every `refuse_every`-th
    write a tenant in `refusing` asks for gets no TTL (a policy skip)."""

    def __init__(self, ttls: dict[str, float], refresh: frozenset[str] = frozenset(),
                 refusing: frozenset[str] = frozenset(), refuse_every: int = 4) -> None:
        self.ttls, self.refresh, self.refusing, self.refuse_every = ttls, refresh, refusing, refuse_every
        self.asked: dict[str, int] = dict.fromkeys(ttls, 0)

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        self.asked[tenant] += 1
        if tenant in self.refusing and self.asked[tenant] % self.refuse_every == 0:
            return 0.0
        return self.ttls[tenant]

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        return self.ttls[tenant] if tenant in self.refresh else None

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"kind": "by-tenant"}


def _ns(tenant: str) -> bytes:
    return tenant.encode().ljust(32, b"\0")


def _bk(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _policy() -> ByTenant:
    return ByTenant({"short": 20.0, "long": 90.0, "heavy": 45.0}, refresh=frozenset({"short"}),
                    refusing=frozenset({"heavy"}))


@pytest.mark.parametrize("weights", [None, {"heavy": 3.0, "long": 0.5}])
def test_the_model_and_the_embedded_pool_make_the_same_decisions(weights: dict[str, float] | None) -> None:
    rng = random.Random(7)
    clock = ManualClock()
    pool_policy, model_policy = _policy(), _policy()
    capacity = 9 * UNIT
    pool = EmbeddedPool(capacity, pool_policy, clock, share_weights=weights)
    model = PoolModel(capacity, model_policy, share_weights=weights)
    tenants = list(pool_policy.ttls)
    decisions: dict[str, set[object]] = {"put": set(), "hit": set()}
    for step in range(4000):
        clock.now += rng.choice([0.0, 0.0, 0.5, 1.0, 3.0, 11.0])
        now = clock.now - 1000.0  # the model's time starts at 0; only differences matter
        tenant = rng.choice(tenants)
        i = rng.randrange(12)
        if rng.random() < 0.6:
            # Mostly 1-3 units; now and then one larger than the budget.
            size = rng.choice([1000, 1000, 2000 + ENTRY_OVERHEAD_BYTES, 3000 + 2 * ENTRY_OVERHEAD_BYTES,
                               capacity])
            got = pool.put(_ns(tenant), _bk(i), tenant, LAYOUT, 16, b"x" * size).skip_reason
            before = dict(model.skipped)
            stored = model.put((tenant, i), tenant, size, now)
            expected = None if stored else next(r for r in model.skipped if model.skipped[r] != before[r])
            assert got == expected, (step, tenant, i, size)
            decisions["put"].add(got)
        else:
            hit = pool.get(_ns(tenant), _bk(i), tenant, LAYOUT).hit
            assert hit == model.get((tenant, i), tenant, 0, now).hit, (step, tenant, i)
            decisions["hit"].add(hit)
        # The same entries held (the pool keeps expired ones until it next looks; they never count).
        held = {(e.tenant, int.from_bytes(k[32:], "big")) for k, e in pool._entries.items() if e.expires_at > clock.now}
        assert held == set(model._entries), step
        st = pool.stats()
        assert (st.evictions, st.refreshes, st.skipped_writes["no-room"], st.skipped_writes["policy"]) == (
            model.evictions, model.refreshes, model.skipped["no-room"], model.skipped["policy"]), step
        assert sum(e.footprint for e in pool._entries.values() if e.expires_at > clock.now) == model.used_bytes
    assert pool_policy.asked == model_policy.asked  # the policy heard of the same writes
    # The sequence reached every kind of decision, evictions included.
    assert decisions == {"put": {None, "no-room", "policy"}, "hit": {True, False}}
    assert model.evictions > 100


def test_a_write_that_cannot_find_room_leaves_no_trace_in_the_model() -> None:
    policy = ByTenant({"a": 100.0, "b": 100.0, "c": 100.0})
    model = PoolModel(4 * UNIT, policy)
    payload = UNIT - ENTRY_OVERHEAD_BYTES
    assert model.put("a0", "a", payload, 0.0) and model.put("a1", "a", payload, 0.0)
    assert model.put("b0", "b", payload, 0.0)
    # c's 3 units against a share of 4/3: one of a's could go (a is over its share), then no one's.
    assert not model.put("c0", "c", 3 * UNIT - ENTRY_OVERHEAD_BYTES, 10.0)
    assert (model.evictions, model.skipped, model.used_bytes) == (0, {"no-room": 1, "policy": 0}, 3 * UNIT)
    assert policy.asked == {"a": 2, "b": 1, "c": 0}
    assert [model.get(k, k[0], payload, 20.0).hit for k in ("a0", "a1", "b0")] == [True, True, True]
    assert model.byte_seconds == pytest.approx(3 * UNIT * 20.0)
    # Then a real eviction: 2 units for c fit by taking a's soonest-expiring entry (a is over its
    # share, b is not), and a read of it says why it missed.
    assert model.put("c0", "c", 2 * UNIT - ENTRY_OVERHEAD_BYTES, 30.0)
    assert model.evictions == 1
    r = model.get("a0", "a", payload, 30.0)
    assert (r.hit, r.reason) == (False, "capacity")
    assert model.get("a1", "a", payload, 30.0).hit


def test_a_write_the_policy_refuses_evicts_nothing_in_the_model() -> None:
    policy = ByTenant({"a": 100.0, "z": 100.0}, refusing=frozenset({"z"}), refuse_every=1)
    model = PoolModel(UNIT, policy)
    payload = UNIT - ENTRY_OVERHEAD_BYTES
    assert model.put("a0", "a", payload, 0.0)
    assert not model.put("z0", "z", payload, 5.0)  # room was found by evicting a0, then put back
    assert (model.evictions, model.skipped["policy"], policy.asked["z"]) == (0, 1, 1)
    r = model.get("a0", "a", payload, 10.0)
    assert r.hit and r.reason is None
    assert model.byte_seconds == pytest.approx(UNIT * 10.0)


def test_the_model_splits_by_share_weight() -> None:
    model = PoolModel(8 * UNIT, ByTenant({"a": 60.0, "b": 60.0}), share_weights={"a": 3.0})
    payload = UNIT - ENTRY_OVERHEAD_BYTES
    for i in range(10):
        assert model.put(("a", i), "a", payload, float(i))
    for i in range(4):
        assert model.put(("b", i), "b", payload, 10.0 + i)  # weight 1 against 3: 2 of the 8
    assert sum(model.get(("a", i), "a", payload, 20.0).hit for i in range(10)) == 6
    assert [i for i in range(4) if model.get(("b", i), "b", payload, 20.0).hit] == [2, 3]
