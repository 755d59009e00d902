"""Observers see every finished call, in order, after the call has answered: a slow observer does
not hold up the caller, `flush` waits for delivery, nothing is dropped when the queue is full, and
one failing observer does not stop the others."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.observe.queue import ObserverQueue
from tests.fixtures.service import Service, make_config, start_service
from tests.helpers.waiting import wait_until
from tests.store_helpers import tokens_for

TOY = "reference-toy-8"


def test_records_arrive_in_order_and_flush_waits_for_them() -> None:
    seen: list[int] = []
    q: ObserverQueue[int] = ObserverQueue(lambda: [seen.append])
    for i in range(500):
        q.submit(i)
    assert q.flush(10.0)
    assert seen == list(range(500))
    q.close()


def test_a_full_queue_delivers_inline_and_drops_nothing() -> None:
    gate, entered = threading.Event(), threading.Event()
    seen: list[int] = []

    def slow(i: int) -> None:
        if i == 0:
            entered.set()
            assert gate.wait(10.0)  # the worker is stuck on record 0
        seen.append(i)

    q: ObserverQueue[int] = ObserverQueue(lambda: [slow], max_pending=3)
    q.submit(0)
    assert entered.wait(10.0)
    for i in range(1, 10):  # 1-3 wait in the queue, 4-9 find it full and are delivered by the caller
        q.submit(i)
    assert seen == list(range(4, 10))
    gate.set()
    assert q.flush(10.0)
    assert sorted(seen) == list(range(10))
    q.close()


def test_a_failing_observer_is_logged_and_the_others_still_see_the_record(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def broken(r: str) -> None:
        raise RuntimeError("observer bug")

    q: ObserverQueue[str] = ObserverQueue(lambda: [broken, seen.append])
    q.submit("a")
    q.submit("b")
    assert q.flush(10.0) and seen == ["a", "b"]
    assert "call observer failed" in caplog.text
    q.close()


def test_close_delivers_what_waits_and_later_records_are_delivered_by_their_callers() -> None:
    seen: list[int] = []
    q: ObserverQueue[int] = ObserverQueue(lambda: [seen.append])
    for i in range(50):
        q.submit(i)
    q.close()
    assert seen == list(range(50))
    q.submit(50)
    assert seen[-1] == 50 and q.pending == 0


def test_a_slow_observer_does_not_hold_up_the_call(tmp_path: Path) -> None:
    svc: Service = start_service(make_config(), tmp_path / "data")
    gate = threading.Event()
    seen: list[str] = []

    def slow(rec: object) -> None:
        assert gate.wait(30.0)
        seen.append(getattr(rec, "method", ""))

    observers: list[Callable[[object], None]] = [slow]
    svc.app.observers.extend(observers)
    try:
        kv = svc.client()
        r = kv.lookup(TOY, tokens_for(1, 64))  # answered while the observer is still blocked
        assert r.hit_tokens == 0 and seen == []
        gate.set()
        assert svc.app.flush_observers(30.0) and seen == ["Lookup"]
    finally:
        gate.set()
        svc.stop(1.0)


def test_closing_while_the_first_call_starts_the_thread_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.observe.queue as oq

    starting = threading.Event()

    class SlowStart(threading.Thread):  # fault injection: the thread takes a while to start
        def start(self) -> None:
            starting.set()
            time.sleep(0.2)
            super().start()

    monkeypatch.setattr(oq.threading, "Thread", SlowStart)
    seen: list[int] = []
    q: ObserverQueue[int] = ObserverQueue(lambda: [seen.append])
    first = threading.Thread(target=q.submit, args=(1,))
    first.start()
    assert starting.wait(10.0)
    q.close()  # while the first submit is still starting the thread
    first.join()
    for i in range(2, 5):
        q.submit(i)  # after close: delivered by the caller
    assert sorted(seen) == [1, 2, 3, 4]


def _thread_cpu_seconds(native_id: int) -> float:
    """A thread's CPU time (user + system), from /proc: `time.thread_time` reads only the caller's."""
    import os

    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_flushing_readers_do_not_make_the_observer_thread_spin() -> None:
    # Every admin read flushes. While any flush was in progress the thread's poll, a wait on the
    # flushers' `_hurry` event, returned at once: the thread spun, taking the interpreter from calls.
    seen: list[int] = []
    q: ObserverQueue[int] = ObserverQueue(lambda: [seen.append])
    q.submit(0)
    assert q.flush(10.0)
    thread = q._thread
    assert thread is not None and thread.native_id is not None
    stop = threading.Event()
    stale: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            n = len(seen)
            assert q.flush(10.0)
            if len(seen) < n:
                stale.append(n)

    def caller() -> None:  # calls still arrive now and then: some flushes have a record to wait for
        i = 1
        while not stop.is_set():
            q.submit(i)
            assert q.flush(10.0)
            if seen[-1] != i:  # flush returned before its record was delivered
                stale.append(i)
            i += 1
            time.sleep(0.02)

    threads = [threading.Thread(target=reader) for _ in range(4)] + [threading.Thread(target=caller)]
    before = _thread_cpu_seconds(thread.native_id)
    for t in threads:
        t.start()
    time.sleep(1.0)
    wait_until(lambda: len(seen) > 10, timeout=30)  # a loaded machine's caller may have done fewer by now
    stop.set()
    for t in threads:
        t.join(10.0)
    used = _thread_cpu_seconds(thread.native_id) - before
    assert not stale and len(seen) > 10
    # Spinning, it took 0.3-0.6 s of the second; delivering a record every 20 ms takes a few ms.
    assert used < 0.1, f"the observer thread used {used:.2f} s of CPU in 1 s of flushing"
    q.close()


class _Weighed:
    """A record that keeps `size` bytes alive until lightened (as a cold Lookup's copied ids)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.retained_bytes = n, size

    def lightened(self) -> _Weighed:
        return _Weighed(self.n, 10)


def test_records_past_the_byte_budget_are_queued_lightened_and_counted_never_dropped() -> None:
    # Bounded by count only, 10,000 waiting records of 4 MB requests could hold 40 GB. Past the
    # byte budget a record is queued lightened (counted): its observers still see it.
    gate, entered = threading.Event(), threading.Event()
    seen: list[_Weighed] = []

    def slow(r: _Weighed) -> None:
        if r.n == 0:
            entered.set()
            assert gate.wait(10.0)  # the worker is stuck on record 0
        seen.append(r)

    q: ObserverQueue[_Weighed] = ObserverQueue(lambda: [slow], max_pending_bytes=1000)
    q.submit(_Weighed(0, 300))
    assert entered.wait(10.0)
    for i in range(1, 11):
        q.submit(_Weighed(i, 300))
    # 0 (held until delivered), 1 and 2 fit (900 bytes); 3-10 found the budget spent and wait
    # lightened, 10 bytes each.
    assert q.shed == 8 and q.pending == 10 and q.pending_bytes == 3 * 300 + 8 * 10
    gate.set()
    assert q.flush(10.0)
    assert [r.n for r in seen] == list(range(11))
    assert [r.retained_bytes for r in seen] == [300] * 3 + [10] * 8
    assert q.pending_bytes == 0
    q.submit(_Weighed(11, 5000))  # alone, a record larger than the budget is queued whole
    assert q.flush(10.0) and seen[-1].retained_bytes == 5000 and q.shed == 8
    q.close()


def test_queued_cold_million_token_lookups_do_not_keep_their_requests(tmp_path: Path) -> None:
    # With the admin port on, each finished Lookup's record waits for the observers. A cold
    # 1M-token Lookup's kept its whole 4 MB request alive (the deferred miss keys' closure held a
    # view of it): with the observers behind, 49 of them held ~200 MB, and a tenant sending them
    # grew the server's memory without bound. Now a record keeps a copy of the ids of the chunks
    # the explainer examines, and past the queue's byte budget (16 MiB) not even that.
    import tracemalloc

    from kvstore.observe.call_observer import Observability

    cfg = make_config(store={"chunk_tokens": 128, "key_memo_bytes": 0},  # the memo would add its own bytes
                      service={"max_message_bytes": 5 << 20, "max_staged_bytes": 64 << 20})
    svc: Service = start_service(cfg, tmp_path / "data", admin_port=0)
    gate, entered = threading.Event(), threading.Event()

    def blocked(rec: object) -> None:
        entered.set()
        assert gate.wait(60.0)

    svc.app.observers.insert(0, blocked)
    tracemalloc.start()
    try:
        kv = svc.client(timeout_seconds=60.0)
        prompts = [tokens_for(50 + i, 1_000_000) for i in range(50)]
        kv.lookup(TOY, prompts[0])
        assert entered.wait(30.0)  # the observer thread holds this one
        before = tracemalloc.get_traced_memory()[0]
        for p in prompts[1:]:
            kv.lookup(TOY, p)
        del p
        grown = tracemalloc.get_traced_memory()[0] - before
        queue = svc.app._observe
        assert queue is not None and queue.pending == 49
        assert grown < 40 << 20, f"49 queued records grew traced memory {grown / 2**20:.0f} MB"
        from kvstore.observe.queue import MAX_PENDING_BYTES

        # Lightened records still wait (their noted keys, ~20 KB each): past the budget, only they.
        assert queue.pending_bytes <= MAX_PENDING_BYTES + 49 * (32 << 10) and queue.shed >= 40
        shed = queue.shed
    finally:
        tracemalloc.stop()
        gate.set()
    try:
        assert svc.app.flush_observers(60.0)
        obs = next(o for o in svc.app.observers if isinstance(o, Observability))
        registry = obs.metrics.registry
        # Every request is still counted; only the shed ones' explanations are cut short.
        assert registry.get_sample_value("kvstore_requests_total", {"method": "lookup", "case": "cold"}) == 50
        assert registry.get_sample_value("kvstore_explanations_shed_total") == shed
        explained = [obs.explainer.get(rid) for rid in obs.explainer.recent_ids(50)]
        cut = [e for e in explained if e is not None and "observers were behind" in e.chunks[-1].detail]
        assert len(cut) == shed
        e = cut[0]
        assert [(c.first_chunk, c.last_chunk, c.reason) for c in e.chunks] == [
            (0, 255, "never_stored"), (256, 7811, "unexamined")]
        whole = [e for e in explained if e is not None and e not in cut]
        assert [(c.first_chunk, c.last_chunk, c.reason) for c in whole[0].chunks] == [
            (0, 4095, "never_stored"), (4096, 7811, "unexamined")]
    finally:
        svc.stop(1.0)


class _Heavy(_Weighed):
    """A record with no lighter copy (a Lookup's noted keys: ~20 KB)."""

    def lightened(self) -> _Heavy:
        return self


def test_records_too_heavy_to_wait_past_the_byte_budget_are_delivered_by_their_callers() -> None:
    # Records that cannot be lightened were bounded by count only (10,000 of ~20 KB: ~200 MB).
    gate, entered = threading.Event(), threading.Event()
    seen: list[int] = []

    def slow(r: _Weighed) -> None:
        if r.n == 0:
            entered.set()
            assert gate.wait(10.0)
        seen.append(r.n)

    q: ObserverQueue[_Weighed] = ObserverQueue(lambda: [slow], max_pending_bytes=1000)
    q.submit(_Heavy(0, 300))
    assert entered.wait(10.0)
    for i in range(1, 11):
        q.submit(_Heavy(i, 300))
    # 1 and 2 wait beside 0 (900 bytes); 3-5 past the budget, within as much again (1,800); 6-10
    # would have gone beyond: delivered by their callers, at once.
    assert seen == list(range(6, 11)) and q.pending_bytes == 1800 and q.shed == 0
    gate.set()
    assert q.flush(10.0) and sorted(seen) == list(range(11)) and q.pending_bytes == 0
    q.close()
