"""A Load whose prefix has a corrupt chunk in LMDB in the middle of a stream message: the chunks
before it still arrive (the hit ends there), none after it, and none of the corrupt one's bytes."""

from __future__ import annotations

from collections.abc import Callable

import lmdb

from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens


def test_the_chunks_before_a_corrupt_one_arrive(make_service: Callable[..., Service]) -> None:
    # LMDB only, no promotion: every chunk is read from disk, and the four fit in one message.
    cfg = make_config(store={"device_capacity_bytes": 0, "dram_capacity_bytes": 0, "promote_on_hit": False,
                             "compression": "none"})
    svc = make_service(cfg)
    prompt = tokens(7, 4 * CHUNK)
    chunks = payloads(7, 4, svc.chunk_bytes(TOY))
    assert 4 * len(chunks[0]) < cfg.service.stream_message_bytes
    svc.client().store(TOY, prompt, chunks)
    store = svc.app.store
    keys = store.chunk_keys(store.namespace("default", TOY, svc.app.config.replay.mode), prompt)
    svc.stop()
    env = lmdb.open(str(svc.data_dir / "lmdb"), max_dbs=8)
    db = env.open_db(b"chunks")
    with env.begin(write=True, db=db) as txn:
        old = txn.get(keys[2])
        assert old is not None
        value = bytearray(old)
        value[-100] ^= 0x10  # inside the third chunk's payload: its checksum fails
        txn.put(keys[2], bytes(value))
    env.close()

    again = make_service(cfg, data_dir=svc.data_dir)
    loaded = [bytes(c) for c in again.client().load(TOY, prompt).chunks]
    assert len(loaded) == 2, f"{len(loaded)} chunks arrived, not the 2 before the corrupt one"
    assert loaded == chunks[:2]
    assert again.app.store.stats().corrupt_reads == 1
