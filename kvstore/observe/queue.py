"""Delivers each finished call's record to the app's observers after the call has answered.

The observers (the TTL policy's return tracker; with the admin port on, metrics, the ledger and
the miss explainer; the request trace) cost ~40 us a call in a hot loop with the admin port on,
and about twice that in a running service. Run in the handler, that is time every caller waits
for an answer that does not depend on it. Instead a call appends its record to this queue (no
lock, and no wake-up unless the thread has been idle a while) and returns; one daemon thread
delivers the records to every observer, in the order the calls finished, in batches that start
`BATCH_DELAY_SECONDS` after the first record arrived. In one process the observers still need
the interpreter (the GIL): delivered at once, they took it from the reply being sent (and a
wake-up per call cost as much as the delivery saved); a few milliseconds later, the replies are
out. What an observer must know of the moment a call answered travels in its record: the time
(`CallRecord.at`), and for a lookup that missed, which of its missed chunks the store held.

Readers that must see every call finished so far (a metrics scrape, the ledger and explain APIs,
tests) call `flush()` first. No record is dropped: when `max_pending` records are waiting (observers
slower than the calls), the submitting call delivers its record itself, and the calls slow down
instead of memory growing. `close()` delivers what is waiting and stops the thread.

Bounded by bytes too. A record may say roughly what it keeps alive (`retained_bytes`) and offer a
lighter copy of itself (`lightened()`): a cold 1M-token Lookup's facts hold a copy of the ids of
the chunks the miss explainer will hash (~2 MB), and its observers cost ~5x the call; a long
prompt's record holds its token ids (4 MB for 1M tokens) until an observer hashes them. When the
records waiting hold `max_pending_bytes`, a new record is queued lightened (counted in `shed`): its
observers still see it, and count it exactly, but skip the expensive part (the explainer examines
only the chunks noted as it answered). Past the budget, records that cannot be lightened (or
their lighter copies) wait within as much again; one that would go beyond is delivered by its
submitting call, as when the queue is full. So a tenant sending such calls cannot grow the queue's
memory past twice its budget, nor leave the metrics tens of seconds behind.

What it does not know: what observers do, what a record holds, or gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

log = logging.getLogger("kvstore.service")

R = TypeVar("R")
MAX_PENDING = 10_000
# What the records waiting may keep alive before new ones are queued lightened: 8 cold 1M-token
# Lookups' copied ids (~2 MB each), ~30 ms of the observers' work; or four 1M-token prompts' ids
# (lightened: hashed by their caller). Only a record with a deferred part (a miss past 256 chunks,
# with the admin port or the trace on; a prompt not yet hashed) can be lightened; the others
# (up to ~20 KB each: their noted keys) count too, and past twice the budget their callers deliver them.
MAX_PENDING_BYTES = 16 << 20
# How long records gather before a batch is delivered. By then the calls that made them have long
# answered, and one wake-up serves the whole batch. Observers still need the interpreter: a batch
# can hold up a call that arrives while it runs (the tail), not the calls in between (the median).
BATCH_DELAY_SECONDS = 0.005
ACTIVE_SECONDS = 0.2  # after a batch, the thread polls every batch delay for this long, then sleeps
IDLE_RECHECK_SECONDS = 1.0  # a safety net: an idle thread looks at the queue at least this often


class ObserverQueue(Generic[R]):
    def __init__(self, observers: Callable[[], Sequence[Callable[[R], None]]], max_pending: int = MAX_PENDING,
                 batch_delay_seconds: float = BATCH_DELAY_SECONDS,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        """`observers`: read at each delivery (observers come and go, as the admin port does)."""
        assert max_pending >= 1
        assert max_pending_bytes >= 0
        assert batch_delay_seconds > 0  # the thread polls at this interval while calls arrive
        self._observers = observers
        self._max = max_pending
        self._max_bytes = max_pending_bytes
        self._delay = batch_delay_seconds
        self._pending: deque[tuple[R, int]] = deque()  # each record with the bytes it was weighed at
        self._bytes = 0  # what the records waiting keep alive (`retained_bytes`)
        self._bytes_lock = threading.Lock()  # submitting calls and the thread add and take concurrently
        self.shed = 0  # records queued lightened because the waiting ones held `max_pending_bytes`
        self._wake = threading.Event()  # set by a call that finds the thread idle, by flush and close
        self._hurry = threading.Event()  # set while someone flushes or closes: no batch delay
        self._done = threading.Condition()  # notified after each batch (flush waits on it)
        self._idle = False
        self._busy = False
        self._flushers = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, record: R) -> None:
        """Queue a record (a deque append, a short lock for its bytes; no wake-up unless the thread
        is idle), lightened when the records waiting hold `max_pending_bytes`."""
        if self._closed or len(self._pending) >= self._max:
            self._deliver(record)  # full (observers slower than calls) or closed: deliver it here
            return
        size = _retained_bytes(record)
        with self._bytes_lock:
            over = bool(self._bytes) and self._bytes + size > self._max_bytes  # one alone always fits
            if not over:
                self._bytes += size
        if over:
            # Outside the lock: lightening may take milliseconds (hashing a long prompt), which
            # other calls and the delivering thread need not wait for.
            lighter = _lightened(record)
            with self._bytes_lock:
                if lighter is not record:
                    record, size = lighter, _retained_bytes(lighter)
                    self.shed += 1
                # Past the budget only light records wait, within as much again.
                over = bool(self._bytes) and self._bytes + size > 2 * self._max_bytes
                if not over:
                    self._bytes += size
        if over:  # still too heavy to wait: delivered here, as by a call that finds the queue full
            self._deliver(record)
            return
        self._pending.append((record, size))
        if self._thread is None:
            self._start()
        elif self._idle:
            self._wake.set()
        if self._closed:  # closed while appending: the thread may be gone, so deliver here
            self._drain()

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        """Wait until every record submitted so far has been delivered; False on timeout."""
        with self._done:
            if not self._pending and not self._busy:  # nothing to wait for: the thread is left alone
                return True
            self._flushers += 1
            self._hurry.set()
        self._wake.set()
        try:
            with self._done:
                return self._done.wait_for(lambda: not self._pending and not self._busy, timeout=timeout_seconds)
        finally:
            with self._done:
                self._flushers -= 1
                if not self._flushers and not self._closed:
                    self._hurry.clear()

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Deliver what is waiting, then stop; later records are delivered by their callers."""
        self._closed = True
        self._hurry.set()
        self._wake.set()
        with self._start_lock:  # a thread being started is started before it is joined
            thread = self._thread
        if thread is not None:
            thread.join(timeout_seconds)
        self._drain()  # the thread never started, or did not finish in time

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        """What the records waiting keep alive, as they said (`retained_bytes`)."""
        return self._bytes

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed:
                thread = threading.Thread(target=self._run, name="kvstore-observers", daemon=True)
                thread.start()
                self._thread = thread  # only once started: close() joins what it finds here

    def _drain(self) -> None:
        while True:
            try:
                item = self._pending.popleft()
            except IndexError:  # empty (the thread may have taken the last one)
                return
            self._deliver_pending(item)

    def _run(self) -> None:
        last_batch = time.monotonic()
        while True:
            if self._pending:
                # Let the calls that made these records send their answers first (delivery would
                # otherwise take the interpreter from them), then deliver the whole batch.
                self._hurry.wait(self._delay)
                self._busy = True
                while self._pending:
                    self._deliver_pending(self._pending.popleft())
                self._busy = False
                with self._done:
                    self._done.notify_all()
                last_batch = time.monotonic()
            elif self._closed:
                return
            elif time.monotonic() - last_batch < ACTIVE_SECONDS:
                # Calls are arriving: look again after one batch delay, so that they need not wake
                # this thread (a wake-up per call cost each call as much as the delivery saved).
                # Not on `_hurry`: set while anyone flushes (every admin read), it would make this
                # a busy loop; a flush or close sets `_wake`, cleared before the queue is looked at.
                self._wake.wait(self._delay)
                self._wake.clear()
            else:  # quiet: sleep until a call finds the thread idle and wakes it
                self._idle = True
                if not self._pending and not self._closed:  # a call that saw `_idle` False appended first
                    self._wake.wait(IDLE_RECHECK_SECONDS)
                self._wake.clear()
                self._idle = False
                last_batch = time.monotonic()

    def _deliver_pending(self, item: tuple[R, int]) -> None:
        record, size = item
        try:
            self._deliver(record)
        finally:  # its bytes are let go once it has been delivered
            with self._bytes_lock:
                self._bytes -= size

    def _deliver(self, record: R) -> None:
        for observe in tuple(self._observers()):
            try:
                observe(record)
            except Exception:  # an observer's bug must not stop the others, or the queue
                log.exception("call observer failed")


def _retained_bytes(record: Any) -> int:
    """What a record says it keeps alive (0 for one that does not say)."""
    size = getattr(record, "retained_bytes", 0)
    return size if isinstance(size, int) else 0


def _lightened(record: Any) -> Any:
    """A record's lighter copy (itself for one that has none)."""
    lighten = getattr(record, "lightened", None)
    return lighten() if callable(lighten) else record
