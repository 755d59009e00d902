"""The key log (policies/key_log.py) against a dict: keys found one at a time and all at once, in
the tail and in the index, keys that share their first 8 bytes or come back after a kill included;
slots walked in append order; `tidy` merging and compacting without changing either."""

from __future__ import annotations

import numpy as np
import pytest

from policies.key_log import KeyLog
from policies.key_run import KeyRun


def _keys(rng: np.random.Generator, n: int) -> list[bytes]:
    keys = {rng.bytes(32) for _ in range(n)} | {b"\x07" * 8 + rng.bytes(24) for _ in range(n // 10)}
    return sorted(keys, key=lambda k: rng.random())


@pytest.mark.parametrize("tail_keys", [1, 3, 256])
def test_a_log_agrees_with_a_dict_through_appends_kills_and_tidies(tail_keys: int) -> None:
    rng = np.random.default_rng(tail_keys)
    pool = _keys(rng, 400)
    log = KeyLog(32, {"size": np.int64}, tail_keys=tail_keys)
    model: dict[bytes, int] = {}  # live key -> size
    order: list[bytes] = []  # live keys, oldest first
    moved_seen = 0
    for step in range(3000):
        key = pool[int(rng.integers(len(pool)))]
        if key in model and rng.random() < 0.5:
            s = log.find(key)
            assert s >= 0 and log.key(s) == key and int(log.cols["size"][s]) == model[key]
            log.kill(s)
            del model[key]
            order.remove(key)
        elif key not in model:
            model[key] = int(rng.integers(1, 1000))
            order.append(key)
            log.append(key, size=model[key])
        if step % 7 == 0:
            moved_seen += log.tidy() is not None
        assert log.live == len(model)
        if step % 50 == 0:
            probe = pool[:200]
            want = [k in model for k in probe]
            assert [log.find(k) >= 0 for k in probe] == want
            assert (log.find_many(probe) >= 0).tolist() == want
            assert log.find_many(probe).tolist() == [log.find(k) for k in probe]
            walked, s = [], log.oldest()
            while s >= 0:
                walked.append(log.key(s))
                s = log.next_live(s)
            assert walked == order  # append order, dead slots skipped
    assert moved_seen  # the dead were dropped at least once
    assert log.find(b"short") == -1 and log.find(b"\x00" * 32) == -1


def test_revive_undoes_a_kill_in_place_and_tidy_says_where_slots_went() -> None:
    rng = np.random.default_rng(5)
    keys = _keys(rng, 50)
    log = KeyLog(32, {"freq": np.uint8}, tail_keys=4)
    slots = [log.append(k, freq=i % 3) for i, k in enumerate(keys)]
    log.tidy()  # merged into the index
    log.kill(slots[0])
    log.kill(slots[1])
    assert log.oldest() == slots[2]
    log.revive(slots[0])
    assert log.oldest() == slots[0] and log.find(keys[0]) == slots[0] and log.find(keys[1]) == -1
    for s in slots[2:40]:
        log.kill(s)
    moved = log.tidy()
    assert moved is not None and moved[slots[1]] == -1
    assert [log.key(int(moved[s])) for s in (slots[0], *slots[40:])] == [keys[0], *keys[40:]]
    assert [int(log.cols["freq"][log.find(k)]) for k in keys[40:]] == [i % 3 for i in range(40, len(keys))]
    again = log.append(keys[5], freq=2)  # a key back after its slot was dropped
    assert log.find(keys[5]) == again and log.find_many([keys[5], keys[6]]).tolist() == [again, -1]


def test_extend_appends_rows_in_order() -> None:
    rng = np.random.default_rng(6)
    keys = _keys(rng, 20)
    log = KeyLog(32, {"size": np.int64}, tail_keys=2)
    log.append(keys[0], size=1)
    rows = np.frombuffer(b"".join(keys[1:]), dtype=np.uint8).reshape(-1, 32)
    first = log.extend(rows, size=np.arange(2, len(keys) + 1, dtype=np.int64))
    assert first == 1 and log.live == len(keys)
    log.tidy()
    assert [int(log.cols["size"][log.find(k)]) for k in keys] == list(range(1, len(keys) + 1))
    with pytest.raises(ValueError):
        KeyLog(4, {})


def test_a_run_finds_many_keys_as_it_finds_each() -> None:
    # Keys whose first 8 bytes collide (the binary search lands on a neighbour), keys absent, a
    # key given twice and one of another width: the same answers as `find`, one by one.
    rng = np.random.default_rng(3)
    keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(200)]
    keys += [keys[7][:8] + bytes(rng.integers(0, 256, 8, dtype=np.uint8)) for _ in range(5)]
    run = KeyRun.of(keys)
    absent = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(20)]
    probe = keys[::3] + absent + [keys[7], keys[7], keys[-1][:8] + b"\xff" * 8]
    assert run.find_many(probe).tolist() == [run.find(key) for key in probe]
    assert sorted(run.find_many(keys).tolist()) == list(range(len(keys)))
    assert run.find_many([*probe, b"short"]).tolist() == [run.find(key) for key in probe] + [-1]
    assert run.find_many([]).tolist() == []
