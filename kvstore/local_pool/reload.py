"""Re-read the config file without a restart, for the local pool's TTL policy.

`ConfigReloader` watches one config file: on SIGHUP (a handler installed from the main thread)
and when the file changes (a polling thread compares mtime, size and inode, so edits in place and
editors that replace the file are both seen). A new file is validated in full with
`kvstore.config.parse_config_file`, once two reads a moment apart agree (a writer may be
mid-write, and part of a file may parse as another config); an empty file is refused (truncated
by `cat new > file` before its bytes came, it would put back every default). If it is invalid, one
clear log line says why and the old config stays in force. If it is valid and the TTL policy's
inputs differ ([local_pool.ttl], or a tenant's `local_ttl_seconds`), the callback receives the
new `KvstoreConfig` and answers which of those keys it applied (a tenant the service does not
serve yet has no TTL to change); the service rebuilds the TTL policy from it and calls
`pool.set_ttl_policy`: new writes get the new TTL, stored snapshots keep theirs until a hit
refreshes them.

Only the TTL policy is applied live. The whole file is compared: a change to any other key (the
pool's URL, a tenant's tokens, a new tenant, a [service] limit, ...) is logged as a warning that
names each such key and says it needs a restart (names only: values may be secrets), as it does
each TTL input the callback did not apply. Alone, a restart-only change does not call the callback
(a rebuilt adaptive policy would forget what it learnt); with a TTL change the callback still
receives the whole config, and applies only the TTL inputs. An accepted file's contradictions
(`config_warnings`) are logged, as at start.

This module knows nothing about pools, policies or how the service applies a config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from types import FrameType
from typing import Any

from kvstore.config import KvstoreConfig, parse_config_file, read_config_file
from kvstore.config.fields import join
from kvstore.config.warnings import config_warnings
from kvstore.errors import ConfigError, ConfigFileError

log = logging.getLogger(__name__)

FileSignature = tuple[int, int, int]  # (mtime_ns, size, inode)
MISSING: FileSignature = (-1, -1, -1)  # while the file is missing
# Two reads this far apart must agree before a file is applied; at most this many tries (a writer
# that takes longer is waited for by the poller: the file's signature changes again).
SETTLE_SECONDS = 0.1
SETTLE_READS = 20

# Applies a re-read config; answers the dotted keys it applied (None: every changed TTL input).
OnChange = Callable[[KvstoreConfig], Collection[str] | None]

class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()  # a table key (a tenant, a TTL override) on one side only


def differences(old: object, new: object, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, old, new) for every leaf setting that differs between two configs or
    sections; a table entry on one side only (a tenant added or removed) is one difference, its
    missing side `_ABSENT`."""
    if dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new) and type(old) is type(new):
        out: list[tuple[str, object, object]] = []
        for f in dataclasses.fields(old):
            out += differences(getattr(old, f.name), getattr(new, f.name), join(prefix, f.name))
        return out
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(old.keys() | new.keys(), key=str):
            out += differences(old.get(k, _ABSENT), new.get(k, _ABSENT), join(prefix, str(k)))
        return out
    return [] if old == new else [(prefix, old, new)]


def applied_live(key: str) -> bool:
    """Whether a changed setting takes effect without a restart: the TTL policy's inputs. A
    tenant's `local_ttl_seconds` differs key by key only for a tenant in both files (a new tenant
    is one difference, `tenants.<name>`, and needs a restart)."""
    parts = key.split(".")
    return key.startswith("local_pool.ttl.") or (len(parts) == 3 and parts[0] == "tenants"
                                                  and parts[2] == "local_ttl_seconds")


class ConfigReloader:
    def __init__(
        self,
        path: str | Path,
        on_change: OnChange,
        current: KvstoreConfig,
        poll_seconds: float = 1.0,
        *,
        read_at: FileSignature | None = None,
        with_flags: Callable[[KvstoreConfig], KvstoreConfig] | None = None,
    ) -> None:
        """`current`: the config in force, as the service started with it. `read_at`: the file's
        `file_signature` taken before `current` was read from it (None: now), so that an edit made
        while the service started is a change. `with_flags`: what the command line sets over the
        file, applied to each config read again (else a key a flag overrides reads as changed)."""
        self._path = Path(path)
        self._on_change = on_change
        self._with_flags = with_flags or (lambda cfg: cfg)
        self._current = current
        self._started = self._current  # what restart-only keys are in force as, until a restart
        self._poll = poll_seconds
        # One reload at a time (signal, poller, direct calls); re-entrant because a SIGHUP handler
        # may run on the main thread while it is inside reload_now().
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sig = file_signature(self._path) if read_at is None else read_at
        self._old_handler: Any = None
        self._handler_installed = False

    @property
    def current(self) -> KvstoreConfig:
        """The config last read (restart-only changes included: each is warned about once)."""
        return self._current

    def reload_now(self) -> bool:
        """Read and validate the file; on success apply changed TTL policy inputs and warn about
        every other change. False when the new file was rejected (the old config stays)."""
        with self._lock:
            self._sig = file_signature(self._path)
            try:
                raw = self._settled()
                if raw is None:  # stopping
                    return False
                if not raw.strip():
                    raise ConfigFileError(f"config file {self._path} is empty: still being written?")
                new = self._with_flags(parse_config_file(raw, self._path))
            except ConfigError as e:
                log.error("config reload rejected, keeping the previous config: %s", e)
                return False
            if new == self._current:
                return True
            changed = differences(self._current, new)
            live = [(k, a, b) for k, a, b in changed if applied_live(k)]
            # Nothing to apply when only restart-only keys changed: a rebuilt TTL policy would lose
            # what an adaptive one has learnt.
            done: Collection[str] = ()
            if live:
                try:
                    applied = self._on_change(new)
                except Exception:
                    log.exception("config reload: applying the new TTL settings failed; keeping the previous")
                    return False
                done = {k for k, _, _ in live} if applied is None else set(applied)
                said = [f"{k}: {a!r} -> {b!r}" for k, a, b in live if k in done]
                if said:
                    log.info("config reloaded from %s: %s", self._path, "; ".join(said))
            # A TTL input the callback did not apply (a tenant not served yet) waits for a restart too;
            # a restart-only key is named only while it differs from what the service started with
            # (a file put back as it was needs no restart).
            pending = {k for k, _, _ in differences(self._started, new)}
            cold = [k for k, _, _ in changed if k not in done and (applied_live(k) or k in pending)]
            in_force = set(config_warnings(self._current))
            self._current = new
            if cold:
                log.warning("config reload: %s changed in %s but take effect only after a restart (not applied)",
                            ", ".join(cold), self._path)
            # Valid but contradictory, as serve says at start: each one this file brings (those
            # already in force were said before).
            for w in config_warnings(new):
                if w not in in_force:
                    log.warning("config reload: %s", w)
            return True

    def _settled(self) -> bytes | None:
        """The file's bytes once two reads `SETTLE_SECONDS` apart agree; None when stopping."""
        raw = read_config_file(self._path)
        for _ in range(SETTLE_READS):
            if self._stop.wait(SETTLE_SECONDS):
                return None
            again = read_config_file(self._path)
            if again == raw:
                return raw
            raw = again
        raise ConfigFileError(f"config file {self._path} kept changing for {SETTLE_READS * SETTLE_SECONDS:g} s: "
                              "still being written?")

    # --- watching ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the polling thread (also serves SIGHUPs promptly)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="kvstore-config-reload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        # The handler first: it sets `_wake` on this (the main) thread, and a SIGHUP that came
        # while this thread held `_wake`'s lock below would wait on it for ever.
        self.uninstall_sighup()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def install_sighup(self) -> None:
        """Reload on SIGHUP. Main thread only (Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ConfigReloader.install_sighup() must be called from the main thread")
        self._old_handler = signal.signal(signal.SIGHUP, self._on_sighup)
        self._handler_installed = True

    def uninstall_sighup(self) -> None:
        if self._handler_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, self._old_handler)
            self._handler_installed = False

    def reload_soon(self) -> None:
        """Read the file again now, on the poller's thread once started (what a SIGHUP does)."""
        if self._thread is not None:
            self._wake.set()  # let the poller read the file, not the signal handler
        else:
            self.reload_now()

    def _on_sighup(self, signum: int, frame: FrameType | None) -> None:
        self.reload_soon()

    def _loop(self) -> None:
        while not self._stop.is_set():
            woken = self._wake.wait(self._poll)
            self._wake.clear()
            if self._stop.is_set():
                return
            if woken or file_signature(self._path) != self._sig:
                try:
                    self.reload_now()
                except Exception:  # keep watching whatever went wrong with one reload
                    log.exception("config reload failed")


def file_signature(path: str | Path) -> FileSignature:
    """What tells an edit of the file at `path` (in place, or by an editor that replaces it)."""
    try:
        st = os.stat(path)
    except OSError:
        return MISSING
    return (st.st_mtime_ns, st.st_size, st.st_ino)
