"""Eviction and admission policies: one contract suite over every eviction policy, then what each
policy is for (recency, scan resistance, cost per byte) and the admission policies; a policy given
its keys as a run, or keeping only its newest keys as objects, answers as one given them all."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.config.policies import EVICTION_POLICIES, build_admission, build_eviction
from kvstore.errors import ConfigError
from policies.admission import AlwaysAdmit, SecondSightingAdmit
from policies.base import EvictionPolicy
from policies.cost_aware import CostAwarePolicy
from policies.key_run import KeyRun
from policies.lru import LruPolicy
from policies.s3fifo import S3FifoPolicy


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def drain(policy: EvictionPolicy) -> list[bytes]:
    """Every tracked key in the order the policy would evict them (on a copy): one eviction of
    exactly the tracked bytes (evict() refuses more than is tracked)."""
    if not len(policy):
        return []
    p = copy.deepcopy(policy)
    out = p.evict(p.tracked_bytes, set())
    assert out is not None and len(p) == 0 and len(out) == len(policy), (out, len(p), len(policy))
    return out


def filled(name: str, n: int = 20, size: int = 10) -> EvictionPolicy:
    p = build_eviction(name)
    for i in range(n):
        p.insert(k(i), size, 1.0)
    return p


@pytest.fixture(params=EVICTION_POLICIES)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# --- the contract, over every eviction policy -----------------------------------------------------------


def test_factory_builds_each_name_and_rejects_unknown() -> None:
    assert isinstance(build_eviction("lru"), LruPolicy)
    assert isinstance(build_eviction("s3fifo"), S3FifoPolicy)
    assert isinstance(build_eviction("cost-aware"), CostAwarePolicy)
    with pytest.raises(ConfigError, match=r"store\.eviction_policy"):
        build_eviction("arc")
    assert isinstance(build_admission("always"), AlwaysAdmit)
    assert isinstance(build_admission("second-sighting"), SecondSightingAdmit)
    with pytest.raises(ConfigError, match=r"store\.admission_policy"):
        build_admission("never")


def test_len_and_contains_follow_insert_and_remove(name: str) -> None:
    p = build_eviction(name)
    assert len(p) == 0 and k(1) not in p
    p.insert(k(1), 10, 1.0)
    p.insert(k(2), 10, 1.0)
    assert len(p) == 2 and k(1) in p and k(2) in p and "x" not in p
    p.remove(k(1))
    p.remove(k(99))  # unknown: ignored
    p.touch(k(99))
    assert len(p) == 1 and k(1) not in p


def test_evict_frees_enough_and_victims_stop_being_tracked(name: str) -> None:
    p = filled(name)
    victims = p.evict(25, set())
    assert victims is not None and len(victims) == 3 and len(set(victims)) == 3
    assert all(v not in p for v in victims)
    assert len(p) == 17
    assert p.evict(0, set()) == []


def test_evict_never_returns_protected_or_ineligible_keys(name: str) -> None:
    p = filled(name)
    protected = {k(i) for i in range(0, 20, 2)}
    victims = p.evict(50, protected, lambda key: key != k(1))
    assert victims is not None
    assert not set(victims) & protected and k(1) not in victims
    assert sum(10 for _ in victims) >= 50


def test_removed_keys_are_never_returned(name: str) -> None:
    p = filled(name)
    for i in range(10):
        p.remove(k(i))
    victims = p.evict(100, set())
    assert victims is not None and set(victims) == {k(i) for i in range(10, 20)}
    assert len(p) == 0


@pytest.mark.parametrize("case", ["too-much", "all-protected", "none-eligible", "mostly-protected"])
def test_refusal_returns_none_and_changes_nothing(name: str, case: str) -> None:
    p = filled(name)
    for i in range(0, 20, 3):
        p.touch(k(i))
    before = drain(p)
    protected: set[bytes] = set()
    eligible: Callable[[bytes], bool] | None = None
    need = 50
    if case == "too-much":
        need = 201
    elif case == "all-protected":
        protected = {k(i) for i in range(20)}
    elif case == "none-eligible":
        eligible = lambda key: False  # noqa: E731
    else:
        protected = {k(i) for i in range(17)}  # 3 keys (30 bytes) left, 50 needed
    assert p.evict(need, protected, eligible) is None
    assert len(p) == 20
    assert drain(p) == before  # same keys, and the same future order


def test_evict_work_is_proportional_to_the_victims(name: str) -> None:
    # The store may track millions of chunks: count the keys a small eviction looks at.
    p = filled(name, n=20_000)
    for i in range(0, 20_000, 7):
        p.touch(k(i))
    looked: list[bytes] = []

    def eligible(key: bytes) -> bool:
        looked.append(key)
        return True

    victims = p.evict(30, {k(1)}, eligible)
    assert victims is not None and len(victims) == 3
    assert len(looked) < 50


def test_reinsert_updates_the_size(name: str) -> None:
    p = filled(name, n=2, size=10)
    p.insert(k(0), 30, 1.0)
    assert len(p) == 2
    victims = p.evict(40, set())
    assert victims is not None and set(victims) == {k(0), k(1)}
    assert p.evict(1, set()) is None


class _PolicyModel(RuleBasedStateMachine):
    """The tracked set of a policy against a dict; every evict checked against the contract."""

    policy_name = "lru"
    KEYS = st.integers(0, 15).map(k)

    def __init__(self) -> None:
        super().__init__()
        self.policy = build_eviction(self.policy_name)
        self.model: dict[bytes, int] = {}

    @rule(key=KEYS, size=st.integers(1, 40), cost=st.floats(0.0, 100.0))
    def insert(self, key: bytes, size: int, cost: float) -> None:
        self.policy.insert(key, size, cost)
        self.model[key] = size

    @rule(key=KEYS)
    def touch(self, key: bytes) -> None:
        self.policy.touch(key)

    @rule(key=KEYS)
    def remove(self, key: bytes) -> None:
        self.policy.remove(key)
        self.model.pop(key, None)

    @precondition(lambda self: bool(self.model))
    @rule(
        need=st.integers(0, 200),
        protected=st.sets(KEYS, max_size=8),
        ineligible=st.one_of(st.none(), st.sets(KEYS, max_size=8)),
    )
    def evict(self, need: int, protected: set[bytes], ineligible: set[bytes] | None) -> None:
        eligible = None if ineligible is None else (lambda key: key not in ineligible)
        before = drain(self.policy)
        victims = self.policy.evict(need, protected, eligible)
        available = sum(
            s for key, s in self.model.items()
            if key not in protected and (ineligible is None or key not in ineligible)
        )
        if victims is None:
            assert available < need, "refused although it could comply"
            assert drain(self.policy) == before, "a refusal changed the policy"
            return
        assert len(set(victims)) == len(victims)
        assert all(v in self.model for v in victims)
        assert not set(victims) & protected
        assert ineligible is None or not set(victims) & ineligible
        assert sum(self.model[v] for v in victims) >= need
        for v in victims:
            del self.model[v]

    @invariant()
    def tracked_set_matches(self) -> None:
        assert len(self.policy) == len(self.model)
        for i in range(16):
            assert (k(i) in self.policy) == (k(i) in self.model)


def _machine_for(policy_name: str) -> type[RuleBasedStateMachine]:
    return type(f"Model_{policy_name}", (_PolicyModel,), {"policy_name": policy_name})


_SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestLruModel = _machine_for("lru").TestCase
TestLruModel.settings = _SETTINGS
TestS3FifoModel = _machine_for("s3fifo").TestCase
TestS3FifoModel.settings = _SETTINGS
TestCostAwareModel = _machine_for("cost-aware").TestCase
TestCostAwareModel.settings = _SETTINGS


# --- what each policy is for ------------------------------------------------------------------------------


def test_lru_evicts_least_recent_and_reverse_touch_keeps_prefix_heads() -> None:
    p = LruPolicy()
    for i in range(6):
        p.insert(k(i), 10, 1.0)
    for i in reversed(range(3)):  # a hit on the prefix 0,1,2: the store touches last chunk first
        p.touch(k(i))
    assert p.evict(30, set()) == [k(3), k(4), k(5)]
    assert p.evict(10, set()) == [k(2)]  # the prefix's suffix goes before its head


def _run_scan(policy: EvictionPolicy, hot: int, scan: int, capacity: int) -> set[bytes]:
    """Hot keys read often, then a one-time scan of `scan` keys through a cache of `capacity`."""
    used = 0

    def put(key: bytes) -> None:
        nonlocal used
        if used + 10 > capacity:
            victims = policy.evict(used + 10 - capacity, set())
            assert victims is not None
            used -= 10 * len(victims)
        policy.insert(key, 10, 128.0)
        used += 10

    for i in range(hot):
        put(k(i))
    for _ in range(8):
        for i in range(hot):
            policy.touch(k(i))
    for j in range(scan):
        put(k(10_000 + j))
    return {k(i) for i in range(hot) if k(i) in policy}


@pytest.mark.parametrize("cls", [S3FifoPolicy, CostAwarePolicy])
def test_a_one_time_scan_does_not_flush_hot_keys(cls: type[EvictionPolicy]) -> None:
    survivors = _run_scan(cls(), hot=40, scan=300, capacity=1000)  # scan = 3x the cache
    assert len(survivors) == 40


def test_s3fifo_survives_any_scan_length_but_gdsf_ages_hot_keys_out() -> None:
    # S3-FIFO: a scan only ever cycles the small queue. GDSF: each turnover of the cache raises
    # the clock by one scan chunk's value, so hot keys outlive about `reads` turnovers.
    assert len(_run_scan(S3FifoPolicy(), hot=40, scan=5000, capacity=1000)) == 40
    assert len(_run_scan(CostAwarePolicy(), hot=40, scan=5000, capacity=1000)) == 0


def test_lru_is_flushed_by_the_same_scan() -> None:
    assert _run_scan(LruPolicy(), hot=40, scan=300, capacity=1000) == set()


def test_s3fifo_one_hit_wonders_leave_from_the_small_queue_and_are_remembered() -> None:
    p = S3FifoPolicy()
    for i in range(10):
        p.insert(k(i), 10, 1.0)
    p.touch(k(0))
    victims = p.evict(10, set())
    # k(0) was read: it moves to main instead of being evicted; k(1) is the first unread one.
    assert victims == [k(1)]
    assert p.in_main(k(0)) and p.in_ghost(k(1))
    p.insert(k(1), 10, 1.0)  # back soon after eviction: straight into main
    assert p.in_main(k(1)) and not p.in_ghost(k(1))


def test_s3fifo_ghost_memory_is_bounded() -> None:
    p = S3FifoPolicy()
    for i in range(5000):
        p.insert(k(i), 10, 1.0)
        if len(p) > 100:
            assert p.evict(10, set()) is not None
    assert len(p._ghost) <= len(p)
    assert p._ghost_bytes <= p.tracked_bytes


def test_cost_aware_keeps_more_value_per_byte() -> None:
    p = CostAwarePolicy()
    p.insert(k(1), 100, 128.0)  # 1.28 per byte
    p.insert(k(2), 100, 12.8)  # 0.128 per byte
    p.insert(k(3), 1000, 128.0)  # 0.128 per byte, but bigger
    assert p.evict(100, set()) == [k(2)]
    clock = p.clock
    assert clock > 0  # the clock rose to the victim's priority: later chunks start higher
    assert p.evict(1, set()) == [k(3)]
    assert p.clock >= clock


def test_cost_aware_heap_stays_compact_under_many_touches() -> None:
    p = CostAwarePolicy()
    for i in range(10):
        p.insert(k(i), 10, 1.0)
    for _ in range(1000):
        p.touch(k(3))
    assert len(p._heap) <= 2 * len(p) + 64 + 1
    assert drain(p)[-1] == k(3)


# --- admission -------------------------------------------------------------------------------------------


def test_always_admit() -> None:
    a = AlwaysAdmit()
    assert a.admit(b"x") and a.admit(b"x")


def test_second_sighting_admits_on_the_second_offer() -> None:
    a = SecondSightingAdmit(window_keys=100)
    assert not a.admit(b"a")
    assert not a.admit(b"b")
    assert a.admit(b"a")
    assert a.admit(b"a")  # still remembered
    assert not a.admit(b"c")


def test_second_sighting_memory_is_bounded_and_forgets_old_keys() -> None:
    a = SecondSightingAdmit(window_keys=100)
    assert not a.admit(b"old")
    for i in range(1000):
        assert not a.admit(k(i))
        assert len(a) <= 100
    assert not a.admit(b"old")  # forgotten after far more than the window of other keys
    for i in range(40):
        a.admit(k(50_000 + i))
    assert a.admit(b"old")  # within the window it is remembered


@pytest.mark.parametrize("others", [50, 60, 99])
def test_second_sighting_remembers_a_key_in_the_older_generation(others: int) -> None:
    # window_keys=100 is two generations of 50: after 50 or more other keys the first sighting is
    # only in the older one, and still counts.
    a = SecondSightingAdmit(window_keys=100)
    assert not a.admit(b"x")
    for i in range(others):
        assert not a.admit(k(i))
    assert a.admit(b"x")
    for i in range(others, others + 60):
        a.admit(k(i))
    assert a.admit(b"x")  # the second sighting moved it to the newer generation


# --- a run of keys (a restart's chunks) behaves as the same keys inserted one by one ------------------------


class _RunTwins(RuleBasedStateMachine):
    """Two policies of one kind: `one` had RUN_KEYS inserted one by one, `run` took them as a
    `KeyRun` (or, with `with_run` off, one by one too) and keeps only `young_keys` keys as objects
    (None: all); every operation after is applied to both, and every answer must be the same. With
    `ordered`, the run is taken in an order of its own (`KeyRun.order`, as a restart's deepest chunks
    first), and `one` had its keys inserted in that order."""

    policy_name = "lru"
    young_keys: int | None = None
    with_run = True
    one_size = False  # every key of the run of one size (one layout), or of a few
    ordered = False
    KEYS = st.integers(0, 23).map(k)
    RUN_KEYS = 16  # k(0)..k(15) in the run, k(16).. only ever inserted later

    def __init__(self) -> None:
        super().__init__()
        self.one = build_eviction(self.policy_name)
        self.run = build_eviction(self.policy_name, young_keys=self.young_keys)
        self.sizes = [10 if self.one_size else 10 + (i % 3) * 5 for i in range(self.RUN_KEYS)]
        # 5 is prime to RUN_KEYS: a permutation that is neither key order nor its reverse.
        order = [(5 * i + 3) % self.RUN_KEYS for i in range(self.RUN_KEYS)] if self.ordered else range(self.RUN_KEYS)
        for i in order:
            self.one.insert(k(i), self.sizes[i], 128.0)
            if not self.with_run:
                self.run.insert(k(i), self.sizes[i], 128.0)
        if self.with_run:  # the sizes by key index (k(i) sorts as i)
            self.run.insert_run(KeyRun.of([k(i) for i in order], in_given_order=self.ordered),
                                np.array(self.sizes, dtype=np.int64), 128.0)

    @rule(key=KEYS, size=st.integers(1, 40), cost=st.floats(0.0, 100.0))
    def insert(self, key: bytes, size: int, cost: float) -> None:
        self.one.insert(key, size, cost)
        self.run.insert(key, size, cost)

    @rule(key=KEYS)
    def touch(self, key: bytes) -> None:
        self.one.touch(key)
        self.run.touch(key)

    @rule(keys=st.lists(KEYS, max_size=12))
    def touch_many(self, keys: list[bytes]) -> None:
        # One call for what a load read (a key twice, one not tracked): as the touches in turn.
        for key in keys:
            self.one.touch(key)
        self.run.touch_many(keys)

    @rule(key=KEYS)
    def remove(self, key: bytes) -> None:
        self.one.remove(key)
        self.run.remove(key)

    @rule(need=st.integers(0, 120), protected=st.sets(KEYS, max_size=8),
          ineligible=st.one_of(st.none(), st.sets(KEYS, max_size=8)))
    def evict(self, need: int, protected: set[bytes], ineligible: set[bytes] | None) -> None:
        eligible = None if ineligible is None else (lambda key: key not in ineligible)
        assert self.one.evict(need, protected, eligible) == self.run.evict(need, protected, eligible)

    @invariant()
    def same_answers(self) -> None:
        assert len(self.one) == len(self.run)
        for i in range(24):
            assert (k(i) in self.one) == (k(i) in self.run)
        assert drain(self.one) == drain(self.run)  # the same order from here on


def _twins_for(policy_name: str, young_keys: int | None = None, with_run: bool = True,
               one_size: bool = False, ordered: bool = False) -> type[RuleBasedStateMachine]:
    return type(f"Twins_{policy_name}_{young_keys}_{with_run}_{one_size}_{ordered}", (_RunTwins,),
                {"policy_name": policy_name, "young_keys": young_keys, "with_run": with_run, "one_size": one_size,
                 "ordered": ordered})


TestLruRunTwins = _twins_for("lru").TestCase
TestLruRunTwins.settings = _SETTINGS
TestS3FifoRunTwins = _twins_for("s3fifo").TestCase
TestS3FifoRunTwins.settings = _SETTINGS
TestCostAwareRunTwins = _twins_for("cost-aware").TestCase
TestCostAwareRunTwins.settings = _SETTINGS
TestCostAwareOneSizeRunTwins = _twins_for("cost-aware", one_size=True).TestCase  # a run's priorities unsorted
TestCostAwareOneSizeRunTwins.settings = _SETTINGS
# A run in an order of its own (a restart's: deepest chunks first), not its keys' order.
TestLruOrderedRunTwins = _twins_for("lru", ordered=True).TestCase
TestLruOrderedRunTwins.settings = _SETTINGS
TestS3FifoOrderedRunTwins = _twins_for("s3fifo", ordered=True).TestCase
TestS3FifoOrderedRunTwins.settings = _SETTINGS
TestCostAwareOrderedRunTwins = _twins_for("cost-aware", ordered=True).TestCase
TestCostAwareOrderedRunTwins.settings = _SETTINGS
TestCostAwareOneSizeOrderedRunTwins = _twins_for("cost-aware", one_size=True, ordered=True).TestCase
TestCostAwareOneSizeOrderedRunTwins.settings = _SETTINGS
TestS3FifoYoungOrderedRunTwins = _twins_for("s3fifo", young_keys=2, ordered=True).TestCase
TestS3FifoYoungOrderedRunTwins.settings = _SETTINGS
# Keys past the two newest kept in arrays (policies/key_log.py), with and without a run before them:
# the logs spill, merge their index and drop their dead at every few steps.
TestLruYoungTwins = _twins_for("lru", young_keys=2).TestCase
TestLruYoungTwins.settings = _SETTINGS
TestS3FifoYoungTwins = _twins_for("s3fifo", young_keys=2).TestCase
TestS3FifoYoungTwins.settings = _SETTINGS
TestCostAwareYoungTwins = _twins_for("cost-aware", young_keys=2).TestCase
TestCostAwareYoungTwins.settings = _SETTINGS
TestLruYoungOnlyTwins = _twins_for("lru", young_keys=1, with_run=False).TestCase
TestLruYoungOnlyTwins.settings = _SETTINGS
TestS3FifoYoungOnlyTwins = _twins_for("s3fifo", young_keys=1, with_run=False).TestCase
TestS3FifoYoungOnlyTwins.settings = _SETTINGS
TestCostAwareYoungOnlyTwins = _twins_for("cost-aware", young_keys=1, with_run=False).TestCase
TestCostAwareYoungOnlyTwins.settings = _SETTINGS


def test_a_run_costs_arrays_not_objects(name: str) -> None:
    # 100,000 keys taken as a run, then a few evicted and touched: the policy holds no Python
    # object per key of the run (the caller's arrays aside), only for the keys that left it.
    n = 100_000
    keys = np.arange(n, dtype=">u8").view(np.uint8).reshape(n, 8)
    p = build_eviction(name)
    p.insert_run(KeyRun(keys), np.full(n, 10, dtype=np.int64), 1.0)
    assert len(p) == n and k(5) in p and k(n) not in p
    victims = p.evict(30, {k(0)})
    assert victims is not None and len(victims) == 3 and k(0) not in victims
    p.touch(k(500))
    p.remove(k(600))
    assert len(p) == n - 4 and k(600) not in p and k(500) in p
    ordinary = {"lru": lambda q: len(q._sizes), "s3fifo": lambda q: len(q._small) + len(q._main),
                "cost-aware": lambda q: len(q._entries)}[name]
    assert ordinary(p) <= 2  # k(500) once touched (LRU, GDSF), k(0) once passed over (S3-FIFO)


def test_young_keys_keep_few_objects_and_the_same_order(name: str) -> None:
    # 20,000 keys inserted one by one, some touched, a few evicted: with young_keys=64 the policy
    # holds an object for at most 64 keys a queue (the rest in its logs), and would evict every
    # key in the same order as a policy that keeps them all as objects.
    plain, young = build_eviction(name), build_eviction(name, young_keys=64)
    for i in range(20_000):
        for p in (plain, young):
            p.insert(k(i), 10 + i % 7, float(i % 5))
            if i % 11 == 0:
                p.touch(k(i // 2))
            if i % 1000 == 999:
                assert p.evict(100, {k(i // 3)}) is not None
    assert plain.evict(100, set()) == young.evict(100, set())
    ordinary = {"lru": lambda q: len(q._sizes), "s3fifo": lambda q: len(q._small) + len(q._main) + len(q._ghost),
                "cost-aware": lambda q: len(q._entries)}[name]
    assert len(young) == len(plain) and ordinary(young) <= 3 * 64 and ordinary(plain) > 10_000
    assert drain(young) == drain(plain)
