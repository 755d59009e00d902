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
    stop.set()
    for t in threads:
        t.join(10.0)
    used = _thread_cpu_seconds(thread.native_id) - before
    assert not stale and len(seen) > 10
    # Spinning, it took 0.3-0.6 s of the second; delivering a record every 20 ms takes a few ms.
    assert used < 0.1, f"the observer thread used {used:.2f} s of CPU in 1 s of flushing"
    q.close()
