"""In the async and nometasync durability modes a commit does not wait for the disk: close() flushes,
so a clean shutdown loses nothing, whatever the kernel does after it. LMDB's own close does not
sync, and a reopen in the same process reads the page cache, so only a spy on the environment
sees whether the flush happened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.tier_data import key_of, meta_of, open_tier, payload_of


class _EnvSpy:
    """The tier's LMDB environment, recording its sync and close calls in order."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self.calls: list[str] = []

    def sync(self, force: bool = False) -> None:
        self.calls.append(f"sync(force={force})")
        self._env.sync(force)

    def close(self) -> None:
        self.calls.append("close")
        self._env.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


@pytest.mark.parametrize("mode", ["async", "nometasync"])
def test_close_flushes_to_disk_before_closing_in_the_modes_that_do_not_sync_on_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    tier = open_tier(tmp_path, durability=mode)
    keys = [key_of(1, i) for i in range(2)]
    tier.put_many((k, memoryview(payload_of(k)), meta_of(k)) for k in keys)
    spy = _EnvSpy(tier._env)
    monkeypatch.setattr(tier, "_env", spy)
    tier.close()
    assert spy.calls == ["sync(force=True)", "close"]
    again = open_tier(tmp_path, durability=mode)
    assert again.stats().entries == 2
    again.close()
