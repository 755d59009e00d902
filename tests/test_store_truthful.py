"""A Store reply says what a Lookup right after it finds: a Store larger than the tiers keeps its
longest storable prefix, never pushes out its own chunks, says why the rest was skipped, and does
not stall other calls while it makes room."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.keys.chunk_keys import Namespace
from kvstore.store import GlobalStore, TenantQuota, store_lock
from kvstore.store.store_lock import CHUNKS_PER_LOCK_HOLD, StoreLock
from policies.base import EvictionPolicy
from tests.store_helpers import CHUNK, RecordingFates, expected_payloads, open_store, store_prefix, tokens_for

V41 = "deepseek-v4.1-flash"  # 14,240 B chunks at CHUNK tokens: 4 fit the device, 8 DRAM, 63 LMDB
VOCAB = 129_280
SMALL: dict[str, Any] = dict(device_capacity_bytes=64 * 1024, dram_capacity_bytes=128 * 1024,
                             lmdb_capacity_bytes=1 << 20)
WAIT_SECONDS = 20.0  # only a bound on a hang: each test asserts what happened, never how fast


def prompt(seed: int, chunks: int) -> np.ndarray:
    return tokens_for(seed, chunks * CHUNK, vocab=VOCAB)


def lmdb_chunks(store: GlobalStore, ns: Namespace) -> int:
    """How many chunks of the namespace's layout the LMDB tier holds when full."""
    lmdb = store._tiers["lmdb"]
    return lmdb.capacity_bytes // lmdb.footprint(store.layout(ns).chunk_bytes, store.layout(ns).layout_id)


def reach_and_held(store: GlobalStore, ns: Namespace, tokens: np.ndarray) -> tuple[int, int]:
    """(leading chunks held, chunks held anywhere in the prefix)."""
    held = store.held(store.chunk_keys(ns, tokens))
    return (held.index(False) if False in held else len(held)), sum(held)


def assert_reply_is_what_a_lookup_finds(store: GlobalStore, ns: Namespace, tokens: np.ndarray, res: Any) -> int:
    n = len(tokens) // CHUNK
    hit = store.lookup(ns, tokens).hit_chunks
    assert res.stored_chunks + res.already_present == hit, (res, hit)
    assert res.stored_chunks + res.skipped_chunks + res.already_present == n, res
    assert sum(res.skipped_by_reason.values()) == res.skipped_chunks, res
    assert all(reason in res.skipped_reason for reason in res.skipped_by_reason), res
    assert reach_and_held(store, ns, tokens) == (hit, hit)  # nothing stored past the prefix
    with store.load(ns, tokens) as session:
        assert [bytes(c.payload) for c in session] == expected_payloads(store, ns, tokens, hit)
    return hit


def test_a_store_larger_than_every_tier_keeps_its_longest_prefix_and_says_so(tmp_path: Path) -> None:
    store = open_store(tmp_path, **SMALL)
    ns = store.namespace("default", V41, "bounded")
    tokens = prompt(1, 100)
    res = store_prefix(store, ns, tokens)
    hit = assert_reply_is_what_a_lookup_finds(store, ns, tokens, res)
    assert hit >= lmdb_chunks(store, ns)  # everything LMDB can hold, from the head
    assert res.skipped_by_reason == {"no-room": 100 - hit}
    assert not res.durable
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("tenant", ["alice", "bob"])
def test_a_store_into_a_full_lmdb_makes_room_from_older_prefixes_only(tmp_path: Path, tenant: str) -> None:
    store = open_store(tmp_path, **SMALL)
    alice = store.namespace("alice", V41, "bounded")
    fit = lmdb_chunks(store, alice)
    first = prompt(2, fit)
    assert store_prefix(store, alice, first).stored_chunks == fit
    ns = store.namespace(tenant, V41, "bounded")
    tokens = prompt(3, 100)
    res = store_prefix(store, ns, tokens)
    hit = assert_reply_is_what_a_lookup_finds(store, ns, tokens, res)
    assert hit >= fit and res.skipped_by_reason == {"no-room": 100 - hit}
    reach, held = reach_and_held(store, alice, first)
    assert reach == held  # the older prefix lost its tail, never its head
    store.check_invariants()
    store.close()


def test_an_older_prefix_is_evicted_from_its_tail(tmp_path: Path) -> None:
    store = open_store(tmp_path, **SMALL)
    alice = store.namespace("alice", V41, "bounded")
    fit = lmdb_chunks(store, alice)
    first = prompt(4, fit)
    store_prefix(store, alice, first)
    bob = store.namespace("bob", V41, "bounded")
    res = store_prefix(store, bob, prompt(5, 20))
    assert res.stored_chunks == 20 and res.durable
    reach, held = reach_and_held(store, alice, first)
    assert reach == held and fit - 20 <= held < fit
    store.check_invariants()


def test_a_store_over_its_tenants_quota_keeps_what_the_quota_allows(tmp_path: Path) -> None:
    probe = open_store(tmp_path / "probe", **SMALL)
    layout = probe.layout(probe.namespace("small", V41, "bounded"))
    fp = probe._tiers["lmdb"].footprint(layout.chunk_bytes, layout.layout_id)
    probe.close()
    quotas = {"small": TenantQuota(device_bytes=0, dram_bytes=0, lmdb_bytes=20 * fp)}
    store = open_store(tmp_path / "store", quotas=quotas, **SMALL)
    fates = RecordingFates()
    store.set_fate_sink(fates)
    ns = store.namespace("small", V41, "bounded")
    tokens = prompt(6, 40)
    res = store_prefix(store, ns, tokens)
    assert assert_reply_is_what_a_lookup_finds(store, ns, tokens, res) == 20
    assert res.skipped_by_reason == {"over-quota": 20} and not res.durable
    keys = store.chunk_keys(ns, tokens)
    assert sorted(fates.seen) == sorted(("over_quota", k, ns.digest, "") for k in keys[20:])
    store.check_invariants()


def test_a_chunk_the_admission_policy_keeps_out_cuts_the_prefix_there(tmp_path: Path) -> None:
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0,
                       admission_policy="second-sighting")
    ns = store.namespace("default", V41, "bounded")
    tokens = prompt(7, 3)
    res = store_prefix(store, ns, tokens)
    assert assert_reply_is_what_a_lookup_finds(store, ns, tokens, res) == 0
    assert res.skipped_by_reason == {"not-admitted": 1, "after-gap": 2}
    # Every chunk was sighted once, so the second Store of the prompt writes all of it.
    again = store_prefix(store, ns, tokens)
    assert assert_reply_is_what_a_lookup_finds(store, ns, tokens, again) == 3
    assert again.durable and again.skipped_by_reason == {}
    store.check_invariants()


def test_a_commit_never_evicts_its_own_chunks(tmp_path: Path) -> None:
    store = open_store(tmp_path, **SMALL)
    fates = RecordingFates()
    store.set_fate_sink(fates)
    ns = store.namespace("default", V41, "bounded")
    tokens = prompt(8, 100)
    store_prefix(store, ns, tokens[: 10 * CHUNK])  # the head is already held
    res = store_prefix(store, ns, tokens)
    own = set(store.chunk_keys(ns, tokens))
    assert not [f for f in fates.seen if f[0].startswith("dropped") and f[1] in own]
    assert res.already_present == 10
    assert assert_reply_is_what_a_lookup_finds(store, ns, tokens, res) >= lmdb_chunks(store, ns)
    assert res.skipped_chunks > 0  # the tiers really were too small for it
    store.check_invariants()


def test_another_tenants_lookup_completes_while_a_commit_deletes_its_victims(tmp_path: Path) -> None:
    store = open_store(tmp_path, **SMALL)
    alice = store.namespace("alice", V41, "bounded")
    fit = lmdb_chunks(store, alice)
    store_prefix(store, alice, prompt(9, fit))
    carol = store.namespace("carol", "reference-toy-8", "bounded")
    store_prefix(store, carol, tokens_for(11, 4 * CHUNK))

    # Fault injection: the first LMDB delete of evicted chunks blocks until carol's lookup is done
    # (or the bound passes), and records whether that lookup could finish meanwhile.
    deleting, looked_up = threading.Event(), threading.Event()
    finished_during_delete: list[bool] = []
    lmdb = store._durable
    real_delete_many: Callable[[Iterable[bytes]], None] = lmdb.delete_many  # type: ignore[attr-defined]

    def blocking_delete_many(keys: Iterable[bytes]) -> None:
        if not deleting.is_set():
            deleting.set()
            finished_during_delete.append(looked_up.wait(WAIT_SECONDS))
        real_delete_many(keys)

    lmdb.delete_many = blocking_delete_many  # type: ignore[attr-defined]
    hits: list[int] = []

    def carol_looks_up() -> None:
        if deleting.wait(WAIT_SECONDS):
            hits.append(store.lookup(carol, tokens_for(11, 4 * CHUNK)).hit_chunks)
            looked_up.set()

    looker = threading.Thread(target=carol_looks_up)
    looker.start()
    bob = store.namespace("bob", V41, "bounded")
    res = store_prefix(store, bob, prompt(12, 40))
    looker.join()
    assert finished_during_delete == [True], "the lookup waited for the commit's LMDB deletes"
    assert len(hits) == 1
    assert assert_reply_is_what_a_lookup_finds(store, bob, prompt(12, 40), res) == 40
    store.check_invariants()


class _HoldCounter:
    """Observes the store's lock and one tier's eviction policy: the victims chosen in each hold."""

    def __init__(self, lock: Any, policy: EvictionPolicy) -> None:
        self._lock = lock
        self._policy = policy
        self._depth = 0
        self.current = 0
        self.per_hold: list[int] = []

    def __enter__(self) -> None:
        self._lock.__enter__()
        self._depth += 1
        if self._depth == 1:
            self.current = 0

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.per_hold.append(self.current)
        self._lock.__exit__()

    def acquire(self, *a: Any, **k: Any) -> bool:
        self.__enter__()
        return True

    def release(self) -> None:
        self.__exit__()

    @property
    def waiting(self) -> bool:
        return bool(self._lock.waiting)

    def evict(self, nbytes: int, protected: Any, eligible: Any = None) -> list[bytes] | None:
        victims = self._policy.evict(nbytes, protected, eligible)
        self.current += len(victims or ())
        return victims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def __len__(self) -> int:
        return len(self._policy)

    def __contains__(self, key: object) -> bool:
        return key in self._policy


def test_a_large_commit_evicts_a_bounded_number_of_chunks_per_lock_hold(tmp_path: Path) -> None:
    store = open_store(tmp_path, **SMALL)
    alice = store.namespace("alice", V41, "bounded")
    fit = lmdb_chunks(store, alice)
    store_prefix(store, alice, prompt(13, fit))
    counter = _HoldCounter(store._lock, store._policies["lmdb"])
    store._lock = counter  # type: ignore[assignment]
    store._policies["lmdb"] = counter  # type: ignore[assignment]
    bob = store.namespace("bob", V41, "bounded")
    res = store_prefix(store, bob, prompt(14, 200))
    assert sum(counter.per_hold) >= fit  # the commit evicted every older chunk from LMDB...
    # ...a bounded number per lock hold: a chunk evicts at most one LMDB chunk of the same size for
    # itself, and one for a victim of a memory tier demoted into LMDB.
    assert max(counter.per_hold) <= 2 * CHUNKS_PER_LOCK_HOLD
    store._lock = counter._lock
    store._policies["lmdb"] = counter._policy
    assert assert_reply_is_what_a_lookup_finds(store, bob, prompt(14, 200), res) >= fit
    store.check_invariants()


def test_the_store_lock_knows_when_another_thread_waits_for_it() -> None:
    lock = StoreLock()
    with lock, lock:  # reentrant
        assert not lock.waiting
        got = threading.Event()

        def take() -> None:
            with lock:
                got.set()

        t = threading.Thread(target=take)
        t.start()
        for _ in range(int(WAIT_SECONDS / 0.01)):  # until it is blocked on the lock
            if lock.waiting:
                break
            threading.Event().wait(0.01)
        assert lock.waiting and not got.is_set()
    t.join(WAIT_SECONDS)
    assert got.is_set() and not lock.waiting


class _TurnCounter:
    """The store's lock, counting the turns taken under it (outermost holds)."""

    def __init__(self, lock: StoreLock) -> None:
        self.lock = lock
        self.turns = 0
        self._depth = 0

    @property
    def waiting(self) -> bool:
        return self.lock.waiting

    def __enter__(self) -> None:
        self.lock.__enter__()
        self._depth += 1
        self.turns += self._depth == 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        self.lock.__exit__()


def test_a_commits_turns_under_the_lock_are_bounded_by_items_time_and_waiters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(tmp_path, **SMALL)
    counter = _TurnCounter(store._lock)
    store._lock = counter  # type: ignore[assignment]
    done: list[int] = []
    monkeypatch.setattr(store_lock, "TURN_SECONDS", 1e9)
    store._in_turns(list(range(100)), done.append)  # no one waits: full turns
    assert done == list(range(100)) and counter.turns == -(-100 // CHUNKS_PER_LOCK_HOLD)
    counter.turns = 0
    monkeypatch.setattr(store_lock, "TURN_SECONDS", 0.0)
    store._in_turns(list(range(10)), lambda i: None)  # each item past its turn's time: one turn each
    assert counter.turns == 10
    # Another call waits for the lock during a long turn: the turn ends after the item under way,
    # and each turn after it is of one item until the waiter has the lock (when the waiter's thread
    # runs is the machine's to say: the commit may take the lock back a few times before).
    monkeypatch.setattr(store_lock, "TURN_SECONDS", 1e9)
    counter.turns = 0
    got_at: list[int] = []
    seen: list[int] = []
    turn_of: list[int] = []

    def wait_for_the_lock() -> None:
        with store._lock:
            got_at.append(len(seen))

    waiter = threading.Thread(target=wait_for_the_lock)

    def step(i: int) -> None:
        seen.append(i)
        turn_of.append(counter.turns)
        if i == 2:
            waiter.start()
            for _ in range(int(WAIT_SECONDS / 0.001)):  # until it is blocked on the lock
                if store._lock.waiting:
                    break
                threading.Event().wait(0.001)

    store._in_turns(list(range(CHUNKS_PER_LOCK_HOLD)), step)
    waiter.join(WAIT_SECONDS)
    assert got_at, seen
    let_in = got_at[0]  # items done before the waiter had the lock
    assert turn_of[:3] == [1, 1, 1] and turn_of[3] > 1, turn_of  # the turn ended after item 2
    # Until the waiter was in, a turn of its own for each item (the waiter's hold counts as one);
    # the rest in one turn.
    assert turn_of[3:let_in] == list(range(2, let_in - 1)), (let_in, turn_of)
    assert len(set(turn_of[let_in:])) <= 1, (let_in, turn_of)
    assert seen == list(range(CHUNKS_PER_LOCK_HOLD))
