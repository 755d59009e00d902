"""The policy contracts. Policies hold their own bookkeeping state but do no I/O, no logging and
no metrics; the store and the local pool call them and act on the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Protocol

import numpy as np

from policies.key_run import KeyRun


class EvictionPolicy(Protocol):
    """Chooses victims within one tier. Keys are opaque bytes; sizes are the tier footprint."""

    def insert(self, key: bytes, nbytes: int, cost: float) -> None:
        """A chunk entered the tier. `cost` is its recompute value (e.g. tokens it saves)."""
        ...

    def insert_run(self, run: KeyRun, nbytes: np.ndarray, cost: float) -> None:
        """The chunks of `run` (none of them tracked yet) entered the tier before every chunk
        tracked now, in the run's order (`run.order`, else key order), key i with size `nbytes[i]`:
        into a policy that has evicted nothing yet (one run at a time), and into an empty one the
        same as `insert`ing them one by one in that order. Kept compactly (policies/key_run.py)
        until something happens to a key; `nbytes` is kept as given, not copied."""
        ...

    def touch(self, key: bytes) -> None:
        """The chunk was read (a hit)."""
        ...

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """`touch` each key, in order (a key given twice is touched twice): the chunks one load
        read, in one call."""
        ...

    def remove(self, key: bytes) -> None:
        """The chunk left the tier for a reason the policy did not choose (deleted, corrupt)."""
        ...

    def evict(
        self,
        nbytes: int,
        protected: Container[bytes],
        eligible: Callable[[bytes], bool] | None = None,
    ) -> list[bytes] | None:
        """Pick victims whose sizes add up to at least `nbytes`, never a protected key and only
        keys for which `eligible` (if given) is true. The victims stop being tracked. If that
        cannot be done, return None and change nothing."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    @property
    def tracked_bytes(self) -> int:
        """The sizes of the tracked keys, summed."""
        ...


class AdmissionPolicy(Protocol):
    """Decides whether a chunk is worth writing to the durable tier."""

    def admit(self, key: bytes) -> bool:
        """Record one sighting of `key` and say whether to write it now."""
        ...


class TtlPolicy(Protocol):
    """Decides the lifetime of a local-state snapshot in the pool."""

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        """Seconds a snapshot written now should live."""
        ...

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        """Seconds to refresh the TTL to after a hit, or None to leave it as it is."""
        ...

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        """A session came back after `gap_seconds` (learning policies use this)."""
        ...

    def describe(self) -> dict[str, object]:
        """The policy in force, for the dashboard and `check-config`."""
        ...
