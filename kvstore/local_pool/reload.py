"""Re-read the config file without a restart, for the local pool's TTL policy.

`ConfigReloader` watches one config file: on SIGHUP (a handler installed from the main thread)
and when the file changes (a polling thread compares mtime, size and inode, so edits in place and
editors that replace the file are both seen). A new file is validated in full with
`kvstore.config.load_config`; if it is invalid, one clear log line says why and the old config
stays in force. If it is valid and its [local_pool.ttl] settings differ, the callback receives the
new `LocalPoolConfig`; the service rebuilds the TTL policy from it and calls
`pool.set_ttl_policy`, which applies to new writes only.

Only the TTL policy is applied live. A change to any other [local_pool] key (URL, byte budget,
timeouts, ...) is logged as needing a restart; alone, it does not call the callback (a rebuilt
adaptive policy would forget what it learnt), and with a TTL change the callback still receives
the whole section.

This module knows nothing about pools, policies or how the service applies a config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from kvstore.config import load_config
from kvstore.config.local_pool import LocalPoolConfig
from kvstore.errors import ConfigError

log = logging.getLogger(__name__)

HOT_FIELDS = frozenset({"ttl"})  # [local_pool] keys that take effect without a restart

_FileSig = tuple[int, int, int] | None  # (mtime_ns, size, inode), None while the file is missing


def differences(old: object, new: object, prefix: str) -> list[str]:
    """`key: old -> new` for every leaf setting that differs between two config sections."""
    if not (dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new)):
        return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]
    out: list[str] = []
    for f in dataclasses.fields(old):
        out += differences(getattr(old, f.name), getattr(new, f.name), f"{prefix}.{f.name}")
    return out


class ConfigReloader:
    def __init__(
        self,
        path: str | Path,
        on_change: Callable[[LocalPoolConfig], None],
        current: LocalPoolConfig,
        poll_seconds: float = 1.0,
    ) -> None:
        self._path = Path(path)
        self._on_change = on_change
        self._current = current
        self._poll = poll_seconds
        # One reload at a time (signal, poller, direct calls); re-entrant because a SIGHUP handler
        # may run on the main thread while it is inside reload_now().
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sig = self._signature()
        self._old_handler: Any = None
        self._handler_installed = False

    @property
    def current(self) -> LocalPoolConfig:
        return self._current

    def reload_now(self) -> bool:
        """Read and validate the file; on success apply a changed [local_pool]. False when the
        new file was rejected (the old config stays)."""
        with self._lock:
            self._sig = self._signature()
            try:
                new = load_config(self._path).local_pool
            except ConfigError as e:
                log.error("config reload rejected, keeping the previous [local_pool]: %s", e)
                return False
            if new == self._current:
                return True
            changed = sorted(f.name for f in dataclasses.fields(LocalPoolConfig)
                             if getattr(new, f.name) != getattr(self._current, f.name))
            what = "; ".join(differences(self._current, new, "local_pool"))
            cold = [k for k in changed if k not in HOT_FIELDS]
            # Nothing to apply when only restart-only keys changed: a rebuilt TTL policy would lose
            # what an adaptive one has learnt.
            if len(cold) < len(changed):
                try:
                    self._on_change(new)
                except Exception:
                    log.exception("config reload: applying the new [local_pool] failed; keeping the previous")
                    return False
            self._current = new
            log.info("config reloaded from %s: %s", self._path, what)
            if cold:
                log.warning("config reload: local_pool %s take effect only after a restart", ", ".join(cold))
            return True

    # --- watching ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the polling thread (also serves SIGHUPs promptly)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="kvstore-config-reload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.uninstall_sighup()

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

    def _on_sighup(self, signum: int, frame: FrameType | None) -> None:
        if self._thread is not None:
            self._wake.set()  # let the poller read the file, not the signal handler
        else:
            self.reload_now()

    def _loop(self) -> None:
        while not self._stop.is_set():
            woken = self._wake.wait(self._poll)
            self._wake.clear()
            if self._stop.is_set():
                return
            if woken or self._signature() != self._sig:
                self._settle()
                try:
                    self.reload_now()
                except Exception:  # keep watching whatever went wrong with one reload
                    log.exception("config reload failed")

    def _settle(self) -> None:
        """Wait (briefly) until the file stops changing: an editor or `cat >` may be mid-write,
        and a half-written file may even parse (as another, valid config)."""
        for _ in range(20):
            before = self._signature()
            if self._stop.wait(0.05) or self._signature() == before:
                return

    def _signature(self) -> _FileSig:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)
