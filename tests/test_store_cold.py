"""The cold chunks' arrays (store/cold.py): found one at a time and all at once alike, keys that
share their first 8 bytes included, and a thawed chunk no longer cold."""

from __future__ import annotations

import numpy as np

from kvstore.layout import get_model
from kvstore.store.cold import ColdChunks


def test_find_many_agrees_with_find_and_thaw_takes_a_chunk_out() -> None:
    rng = np.random.default_rng(3)
    keys = sorted({rng.bytes(32) for _ in range(500)}
                  | {b"\x07" * 8 + rng.bytes(24) for _ in range(5)})  # five share an 8-byte prefix
    cold = ColdChunks(expected=100)  # grows past it
    layout = get_model("reference-toy-8").layout
    kind = cold.kind(b"n" * 32, "t", layout, 128.0, 4096)
    for i in range(0, len(keys), 64):
        cold.append(b"".join(keys[i : i + 64]), [kind] * len(keys[i : i + 64]))
    assert cold.live == cold.n == len(keys)
    thawed = cold.thaw(keys[10])
    assert thawed is not None and not thawed.cold and thawed.footprint == {"lmdb": 4096}
    assert cold.thaw(keys[10]) is None and cold.live == len(keys) - 1
    absent = [rng.bytes(32) for _ in range(20)] + [b"\x07" * 8 + rng.bytes(24)]
    probe = [*keys, *absent]
    rng.shuffle(probe)
    one_by_one = [cold.find(k) for k in probe]
    assert cold.find_many(probe).tolist() == one_by_one  # all 32 bytes: the vectorised search
    assert cold.find_many([*probe, b"short"]).tolist() == [*one_by_one, -1]  # one at a time
    assert sum(i >= 0 for i in one_by_one) == len(keys) - 1
    assert [e is not None for e in cold.peek_many(probe)] == [i >= 0 for i in one_by_one]
    assert cold.peek(keys[11]) is cold.kind_entry(kind) and cold.kind_entry(kind).cold
    assert list(cold.dead()) == [keys[10]]
