"""The store (bookkeeper) over real tiers: LMDB in a temp dir, arenas in CPU memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidInput, UnknownModel
from kvstore.layout import get_model
from kvstore.store import GlobalStore, TenantQuota
from kvstore.store.types import TenantStats
from kvstore.tiers.base import ChunkMeta
from tests.store_helpers import (
    CHUNK,
    MODELS,
    RecordingFates,
    expected_payloads,
    open_store,
    payload_for,
    small_config,
    store_prefix,
    tokens_for,
)

REPO = Path(__file__).resolve().parents[1]


def load_all(store: GlobalStore, ns, tokens) -> list[tuple[str, bytes]]:  # type: ignore[no-untyped-def]
    with store.load(ns, tokens) as session:
        return [(c.tier, bytes(c.payload)) for c in session]


def test_store_lookup_load_round_trip(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(1, 5 * CHUNK + 3)
    assert store.lookup(ns, tokens).hit_tokens == 0
    res = store_prefix(store, ns, tokens)
    assert res.stored_chunks == 5 and res.durable and res.remainder_tokens == 3
    look = store.lookup(ns, tokens)
    assert look.hit_tokens == 5 * CHUNK
    assert look.remainder_tokens == 3 and look.full_chunks == 5
    got = load_all(store, ns, tokens)
    assert [p for _, p in got] == expected_payloads(store, ns, tokens, 5)
    # A longer prompt sharing the prefix hits the prefix only.
    longer = np.concatenate([tokens[: 5 * CHUNK], tokens_for(2, 4 * CHUNK)])
    assert store.lookup(ns, longer).hit_tokens == 5 * CHUNK
    # A different first chunk misses entirely: keys are chained.
    other = tokens.copy()
    other[0] = (other[0] + 1) % 512
    assert store.lookup(ns, other).hit_tokens == 0
    store.check_invariants()
    store.close()


def test_bad_input_is_rejected_and_nothing_is_written(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    with pytest.raises(UnknownModel):
        store.namespace("default", "no-such-model", "bounded")
    with pytest.raises(InvalidInput, match="outside the model's vocab"):
        store.tokens(ns, [1, 2, 512])
    with pytest.raises(InvalidInput, match="replay mode"):
        store.namespace("default", "reference-toy-8", "sometimes")
    tokens = tokens_for(3, 2 * CHUNK)
    txn = store.begin_store(ns, tokens)
    with pytest.raises(InvalidInput, match="needs"):
        txn.write(0, b"\x00" * 10)
    with pytest.raises(InvalidInput, match="outside"):
        txn.write(7, b"\x00" * store.layout(ns).chunk_bytes)
    txn.write(0, payload_for(ns, 0, tokens[:CHUNK], store.layout(ns).chunk_bytes))
    with pytest.raises(InvalidInput, match="never sent"):
        txn.commit()
    assert store.lookup(ns, tokens).hit_tokens == 0
    assert store.stats().chunks == 0


def test_abort_and_exception_leave_nothing_visible(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(4, 3 * CHUNK)
    nbytes = store.layout(ns).chunk_bytes
    txn = store.begin_store(ns, tokens)
    for i in txn.chunks_needed:
        txn.write(i, payload_for(ns, i, tokens[i * CHUNK : (i + 1) * CHUNK], nbytes))
    txn.abort()
    assert store.lookup(ns, tokens).hit_tokens == 0
    with pytest.raises(RuntimeError), store.begin_store(ns, tokens) as txn2:
        txn2.write(0, payload_for(ns, 0, tokens[:CHUNK], nbytes))
        raise RuntimeError("stream broke")
    assert store.lookup(ns, tokens).hit_tokens == 0
    store.close()
    # Nothing reached the durable tier either.
    again = open_store(tmp_path)
    assert again.lookup(ns, tokens).hit_tokens == 0


def test_pressure_demotes_down_the_tiers_and_loads_from_each(tmp_path: Path) -> None:
    # toy chunk of 16 tokens = 1,272 B -> one 4 KiB page. Device holds 2, DRAM 3.
    store = open_store(tmp_path, device_capacity_bytes=2 * 4096, dram_capacity_bytes=3 * 4096,
                       eviction_policy="lru")
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(5, 8 * CHUNK)
    res = store_prefix(store, ns, tokens)
    assert res.stored_chunks == 8 and res.durable
    store.check_invariants()
    look = store.lookup(ns, tokens)
    assert look.hit_chunks == 8
    assert look.chunk_tiers.count("device") == 2
    assert look.chunk_tiers.count("dram") == 3
    assert look.chunk_tiers.count("lmdb") == 3
    got = load_all(store, ns, tokens)
    assert [p for _, p in got] == expected_payloads(store, ns, tokens, 8)
    assert {t for t, _ in got} == {"device", "dram", "lmdb"}
    stats = store.stats()
    # The commit placed its head in the fastest tiers at once: nothing of its own was pushed down.
    assert stats.tiers["device"].evictions == 0 and stats.tiers["dram"].demotions == 0
    # While the whole prefix was pinned nothing could make room: no promotion happened.
    assert stats.tiers["device"].promotions == 0
    assert look.chunk_tiers[:2] == ("device", "device")
    # A second prefix pushes the first one down to LMDB; loading the first one's head (now
    # only in LMDB) promotes it into the device tier.
    store_prefix(store, ns, tokens_for(55, 8 * CHUNK))
    stats = store.stats()
    assert stats.tiers["device"].evictions > 0 and stats.tiers["dram"].demotions > 0
    assert store.lookup(ns, tokens).chunk_tiers[0] == "lmdb"
    with store.load(ns, tokens, max_chunks=1) as session:
        assert [c.tier for c in session] == ["lmdb"]
    assert store.stats().tiers["device"].promotions == 1
    assert store.lookup(ns, tokens).chunk_tiers[0] == "device"
    store.check_invariants()


def test_capacity_drops_from_the_last_tier(tmp_path: Path) -> None:
    chunk_fp = 4096  # toy chunk footprint in the arenas; LMDB charges its own footprint
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=chunk_fp,
                       lmdb_capacity_bytes=1 << 20)
    toy = store.layout(store.namespace("default", "reference-toy-8", "bounded"))
    lmdb_fp = store._tiers["lmdb"].footprint(toy.chunk_bytes, toy.layout_id)
    store.close()
    store = open_store(tmp_path / "b", device_capacity_bytes=0, dram_capacity_bytes=chunk_fp,
                       lmdb_capacity_bytes=max(1 << 20, 4 * lmdb_fp))
    ns = store.namespace("default", "reference-toy-8", "bounded")
    cap_chunks = store._tiers["lmdb"].capacity_bytes // lmdb_fp
    for seed in range(cap_chunks + 3):
        store_prefix(store, ns, tokens_for(100 + seed, CHUNK))
        store.check_invariants()
    assert store.stats().tiers["lmdb"].evictions >= 3


def test_tenant_quota_is_never_exceeded(tmp_path: Path) -> None:
    quotas = {"small": TenantQuota(device_bytes=4096, dram_bytes=2 * 4096)}
    store = open_store(tmp_path, quotas=quotas)
    small = store.namespace("small", "reference-toy-8", "bounded")
    big = store.namespace("big", "reference-toy-8", "bounded")
    for seed in range(6):
        store_prefix(store, small, tokens_for(200 + seed, 2 * CHUNK))
        store_prefix(store, big, tokens_for(300 + seed, 2 * CHUNK))
        store.check_invariants()
    tb = store.stats().tenant_bytes
    assert tb["small"]["device"] <= 4096 and tb["small"]["dram"] <= 2 * 4096
    assert tb["big"]["device"] > 4096  # the other tenant is not held to it


def test_the_store_reports_refused_and_dropped_chunks_to_its_fate_sink(tmp_path: Path) -> None:
    quotas = {"tiny": TenantQuota(device_bytes=0, dram_bytes=0, lmdb_bytes=0)}
    store = open_store(tmp_path, quotas=quotas, device_capacity_bytes=0, dram_capacity_bytes=0,
                       lmdb_capacity_bytes=16 * 4096)
    fates = RecordingFates()
    store.set_fate_sink(fates)
    tiny = store.namespace("tiny", "reference-toy-8", "bounded")
    toks = tokens_for(400, 2 * CHUNK)
    assert store_prefix(store, tiny, toks).skipped_chunks == 2
    keys = store.chunk_keys(tiny, toks)
    assert sorted(fates.seen) == sorted(("over_quota", k, tiny.digest, "") for k in keys)
    assert not store.contains(keys[0])
    # Chunks pushed out of the last tier that held them are reported once, with the tier and reason.
    fates.seen.clear()
    ns = store.namespace("default", "reference-toy-8", "bounded")
    for seed in range(40):
        store_prefix(store, ns, tokens_for(500 + seed, 2 * CHUNK))
    dropped = [f for f in fates.seen if f[0].startswith("dropped")]
    assert dropped and all(f[0] == "dropped:capacity" and f[3] == "lmdb" for f in dropped)
    assert not any(store.contains(f[1]) for f in dropped) and len({f[1] for f in dropped}) == len(dropped)
    store.check_invariants()


def test_pinned_chunks_are_not_evicted_and_stale_pins_expire(tmp_path: Path) -> None:
    now = [0.0]
    store = GlobalStore(small_config(device_capacity_bytes=2 * 4096, dram_capacity_bytes=0,
                                     pin_timeout_seconds=5.0), tmp_path, MODELS, clock=lambda: now[0])
    ns = store.namespace("default", "reference-toy-8", "bounded")
    a = tokens_for(6, 2 * CHUNK)
    store_prefix(store, ns, a)
    assert store.lookup(ns, a).chunk_tiers == ("device", "device")
    session = store.pin_prefix(ns, a)  # a replay's read pins both device chunks (a load's, only while read)
    store_prefix(store, ns, tokens_for(7, 2 * CHUNK))
    # The pinned chunks stayed on the device; the new ones went to LMDB only.
    assert store.lookup(ns, a).chunk_tiers == ("device", "device")
    now[0] = 10.0
    assert store.expire_pins() == 1
    assert store.stats().pins_expired == 1
    session.close()  # a late release after expiry is harmless
    store.check_invariants()


def test_pin_prefix_pins_and_reads_like_a_load_without_counting_a_lookup(tmp_path: Path) -> None:
    store = GlobalStore(small_config(device_capacity_bytes=2 * 4096, dram_capacity_bytes=0), tmp_path, MODELS)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    a = tokens_for(8, 3 * CHUNK)
    store_prefix(store, ns, a[: 2 * CHUNK])
    store.lookup(ns, a)
    before = store.stats()
    with store.pin_prefix(ns, a, 5) as session:  # max_chunks beyond the hit: the hit decides
        assert len(session) == 2 and store.stats().pins_active == 1
        store_prefix(store, ns, tokens_for(9, 2 * CHUNK))  # pressure: the pinned chunks stay put
        assert store.lookup(ns, a).chunk_tiers == ("device", "device")
        got = [bytes(c.payload) for c in session]
    assert got == expected_payloads(store, ns, a, 2)
    after = store.stats()
    assert after.pins_active == 0
    # Only the test's own lookup under pressure was counted; the pin added no lookup nor hit tokens.
    assert (after.lookups, after.lookup_hit_tokens) == (before.lookups + 1, before.lookup_hit_tokens + 2 * CHUNK)
    with store.load(ns, a) as counted:
        assert len(counted) == 2
    assert store.stats().lookups == after.lookups + 1  # a load is counted
    store.check_invariants()
    store.close()


def test_each_tenants_counters_are_its_own_and_the_totals_the_services(tmp_path: Path) -> None:
    """What a tenant's Stats answers (`tenant_stats`) counts its own walks, token mismatches, corrupt
    reads, pins and refused admissions, never another tenant's; `stats()` keeps the totals."""
    now = [0.0]
    # Alice's chunks go to LMDB only (no DRAM for her), bob's to DRAM only (no LMDB for him).
    quotas = {"alice": TenantQuota(dram_bytes=0), "bob": TenantQuota(lmdb_bytes=0)}
    store = GlobalStore(small_config(device_capacity_bytes=0, pin_timeout_seconds=5.0), tmp_path, MODELS,
                        quotas=quotas, clock=lambda: now[0])
    alice = store.namespace("alice", "reference-toy-8", "bounded")
    bob = store.namespace("bob", "reference-toy-8", "bounded")
    a, b = tokens_for(30, 4 * CHUNK + 3), tokens_for(31, 2 * CHUNK)
    store_prefix(store, alice, a)
    store_prefix(store, bob, b)
    assert (store.tenant_stats("alice").admissions_refused, store.tenant_stats("bob").admissions_refused) == (0, 2)
    quiet = store.tenant_stats("bob")

    store.lookup(alice, a)
    store.lookup(alice, a[: 2 * CHUNK])
    with store.load(alice, a, max_chunks=1) as s:  # counted with the whole cached prefix it found
        assert len(s) == 1
    with store.pin_prefix(alice, a):  # a replay's read: a pin, not a walk
        assert (store.tenant_stats("alice").pins_active, store.tenant_stats("bob").pins_active) == (1, 0)
    stale = store.load(alice, a)
    now[0] = 10.0
    assert store.expire_pins() == 1
    stale.close()
    # Chunk 2 rewritten with other token ids: alice's next load finds it corrupt.
    nbytes = store.layout(alice).chunk_bytes
    key = store.chunk_keys(alice, a)[2]
    store._durable.put(key, memoryview(b"\x01" * nbytes), ChunkMeta(alice.digest, alice.layout_id,
                                                                    tokens_for(32, CHUNK).tobytes()))
    with store.load(alice, a) as s:
        assert len([c for c in s]) == 2
    mine = store.tenant_stats("alice")
    assert (mine.lookups, mine.lookup_hit_tokens, mine.lookup_miss_tokens) == (5, 18 * CHUNK, 12)
    assert (mine.corrupt_reads, mine.pins_active, mine.pins_expired, mine.token_mismatches) == (1, 0, 1, 0)
    assert store.tenant_stats("bob") == quiet

    store._index[store.chunk_keys(bob, b)[1]].tokens = tokens_for(33, CHUNK).tobytes()
    assert store.lookup(bob, b).token_mismatches == 1
    theirs = store.tenant_stats("bob")
    assert (theirs.lookups, theirs.lookup_hit_tokens, theirs.lookup_miss_tokens, theirs.token_mismatches) == (
        1, CHUNK, CHUNK, 1)
    assert store.tenant_stats("alice") == mine
    total = store.stats()
    assert (total.lookups, total.lookup_hit_tokens, total.token_mismatches, total.corrupt_reads) == (
        6, 19 * CHUNK, 1, 1)
    assert (total.pins_active, total.pins_expired, total.admissions_refused) == (0, 1, 2)
    assert store.tenant_stats("carol") == TenantStats()
    store.close()


def test_a_reopened_store_reads_each_value_only_when_a_load_needs_it(tmp_path: Path) -> None:
    """Recovery reads LMDB's index records, never a value: a damaged payload is found by the first
    load that reads it (a miss from there, counted), and the chunks read before it are checked
    against their keys, then promoted like any LMDB hit."""
    import lmdb

    store = open_store(tmp_path)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(21, 4 * CHUNK)
    store_prefix(store, ns, tokens)
    keys = store.chunk_keys(ns, tokens)
    want = expected_payloads(store, ns, tokens, 4)
    store.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
        value = bytearray(txn.get(keys[2]))
        value[-9] ^= 0x04
        txn.put(keys[2], bytes(value))
    env.close()

    store = open_store(tmp_path)
    # Nothing read yet: every chunk cold (store/cold.py), knowing no token ids.
    assert store._cold.live == 4 and [store._peek(k).tokens for k in keys] == [None] * 4  # type: ignore[union-attr]
    assert store.lookup(ns, tokens).chunk_tiers == ("lmdb",) * 4
    with store.load(ns, tokens) as s:
        got = [bytes(c.payload) for c in s]
    assert got == want[:2]
    assert store.stats().corrupt_reads == 1
    look = store.lookup(ns, tokens)
    assert look.hit_chunks == 2 and look.chunk_tiers[0] != "lmdb"  # read, checked, promoted
    store.check_invariants()
    store.close()


def test_restart_in_a_new_process_finds_every_chunk(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    ns_a = store.namespace("alice", "reference-toy-8", "bounded")
    ns_b = store.namespace("bob", "deepseek-v4.1-flash", "exact")
    ta, tb = tokens_for(8, 4 * CHUNK), tokens_for(9, 3 * CHUNK, vocab=129_280)
    store_prefix(store, ns_a, ta)
    store_prefix(store, ns_b, tb)
    store.close()
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import numpy as np
        from pathlib import Path
        from tests.store_helpers import open_store, expected_payloads, tokens_for, CHUNK
        s = open_store(Path({str(tmp_path)!r}))
        for tenant, model, mode, seed, n, vocab in [("alice", "reference-toy-8", "bounded", 8, 4, 512),
                                                   ("bob", "deepseek-v4.1-flash", "exact", 9, 3, 129280)]:
            ns = s.namespace(tenant, model, mode)
            t = tokens_for(seed, n * CHUNK, vocab)
            assert s.lookup(ns, t).hit_chunks == n, (tenant, s.lookup(ns, t))
            with s.load(ns, t) as sess:
                got = [bytes(c.payload) for c in sess]
            assert got == expected_payloads(s, ns, t, n)
            # Another tenant with the same tokens misses.
            assert s.lookup(s.namespace("mallory", model, mode), t).hit_tokens == 0
        s.check_invariants()
        print("ok", s.stats().chunks)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "7"]


def test_foreign_layout_and_token_mismatch_are_ignored_and_reported(tmp_path: Path) -> None:
    toy = get_model("reference-toy-8")
    other = replace(toy, name="other-model", layout=replace(toy.layout, name="other-layout"))
    store = GlobalStore(small_config(), tmp_path, [*MODELS, other])
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(10, 2 * CHUNK)
    store_prefix(store, ns, tokens)
    store_prefix(store, store.namespace("default", "other-model", "bounded"), tokens)
    keys = store.chunk_keys(ns, tokens)
    nbytes = store.layout(ns).chunk_bytes
    # Chunk 1 rewritten with other token ids: a key hit whose tokens differ is a miss.
    wrong = tokens_for(11, CHUNK).tobytes()
    store._durable.put(keys[1], memoryview(b"\x01" * nbytes), ChunkMeta(ns.digest, ns.layout_id, wrong))
    store.close()
    # Reopened by a store that does not serve "other-model": its entries are ignored and reported.
    store = open_store(tmp_path)
    assert store.stats().ignored_on_open.get("layout") == 2
    # The reopened store read index records only, which hold no token ids: the lookup hits on the
    # keys, and the load's read of chunk 1 finds that its token ids are not those its key binds.
    assert store.lookup(ns, tokens).hit_chunks == 2
    with store.load(ns, tokens) as s:
        got = [bytes(c.payload) for c in s]
    assert got == expected_payloads(store, ns, tokens, 1)
    assert store.stats().corrupt_reads == 1
    look = store.lookup(ns, tokens)
    assert look.hit_chunks == 1 and look.token_mismatches == 0
    # A store that keeps running compares the token ids it holds on every lookup.
    store_prefix(store, ns, tokens)
    store._index[keys[1]].tokens = wrong
    look = store.lookup(ns, tokens)
    assert look.hit_chunks == 1 and look.token_mismatches == 1
    assert store.stats().token_mismatches == 1
    store.close()


def test_a_run_of_chunks_in_one_memory_tier_is_joined_in_one_copy(tmp_path: Path) -> None:
    # Device holds 2 toy chunks, DRAM 3, the rest only LMDB (as in the pressure test above).
    store = open_store(tmp_path, device_capacity_bytes=2 * 4096, dram_capacity_bytes=3 * 4096,
                       eviction_policy="lru")
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(12, 8 * CHUNK)
    store_prefix(store, ns, tokens)
    want = expected_payloads(store, ns, tokens, 8)
    assert store.lookup(ns, tokens).chunk_tiers == ("device",) * 2 + ("dram",) * 3 + ("lmdb",) * 3

    def head(tier: str) -> bytes:
        return tier.encode() + b":"

    with store.load(ns, tokens) as session:
        assert session.read_joined(0, 2, head) == ("device", b"device:" + want[0] + want[1])
        assert session.read_joined(2, 3, head) == ("dram", b"dram:" + b"".join(want[2:5]))
        assert session.read_chunks == 5
        assert session.read_joined(4, 2, head) is None  # DRAM and LMDB: read one by one
        assert session.read_joined(5, 3, head) is None  # LMDB verifies every read into a buffer
        assert session.read_chunks == 5
    store.check_invariants()
    store.close()


def test_read_many_into_reads_across_tiers_and_stops_at_a_lost_chunk(tmp_path: Path) -> None:
    # Device holds 2 toy chunks, DRAM 3, the rest only LMDB: the LMDB run is read in one call.
    store = open_store(tmp_path, device_capacity_bytes=2 * 4096, dram_capacity_bytes=3 * 4096,
                       eviction_policy="lru")
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(13, 8 * CHUNK)
    store_prefix(store, ns, tokens)
    want = expected_payloads(store, ns, tokens, 8)
    nbytes = store.layout(ns).chunk_bytes
    bufs = [memoryview(bytearray(nbytes)) for _ in range(8)]
    with store.load(ns, tokens) as session:
        assert session.read_many_into(0, bufs) == ["device"] * 2 + ["dram"] * 3 + ["lmdb"] * 3
        assert [bytes(b) for b in bufs] == want and session.read_chunks == 8
    # Chunk 6 rewritten in LMDB with other token ids: the read stops there and books the loss.
    keys = store.chunk_keys(ns, tokens)
    wrong = tokens_for(14, CHUNK).tobytes()
    store._durable.put(keys[6], memoryview(b"\x01" * nbytes), ChunkMeta(ns.digest, ns.layout_id, wrong))
    with store.load(ns, tokens) as session:
        assert session.read_many_into(5, bufs[5:]) == ["lmdb"]
        assert bytes(bufs[5]) == want[5] and session.read_chunks == 1
    assert store.stats().corrupt_reads == 1
    assert store.lookup(ns, tokens).hit_chunks == 6
    store.check_invariants()
    store.close()


def test_a_lookup_stops_hashing_soon_after_the_hit_ends(tmp_path: Path) -> None:
    """Only the head of a long prompt is held: the walk hashes runs that double while every key is
    held, so it stops in the run where the hit ends; the Store after it still gets every key."""
    from kvstore.keys.chunk_keys import chain_keys, chunk_token_bytes
    from kvstore.store.lookups import WALK_FIRST_RUN

    store = open_store(tmp_path, lmdb_capacity_bytes=64 << 20)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(31, 400 * CHUNK)
    store_prefix(store, ns, tokens[: 20 * CHUNK])
    store.close()
    store = open_store(tmp_path, lmdb_capacity_bytes=64 << 20)  # a fresh memo: the prompt's first sight
    look = store.lookup(ns, tokens)
    assert (look.hit_chunks, look.full_chunks) == (20, 400)
    raw = tokens.astype("<u4").tobytes()
    hashed = store._memo.known(ns.digest, raw, 4 * CHUNK)
    assert len(hashed) == 1 + WALK_FIRST_RUN + 2 * WALK_FIRST_RUN  # runs of 1, 16, 32: the hit ends in the last
    want = chain_keys(ns.digest, chunk_token_bytes(tokens, CHUNK))
    assert hashed == want[: len(hashed)]
    assert store.chunk_keys(ns, tokens) == want
    assert store.lookup(ns, tokens[: 5 * CHUNK]).hit_chunks == 5
    store.close()


def test_a_reopened_store_keeps_its_chunks_cold_until_it_changes_something_about_them(tmp_path: Path) -> None:
    # Recovered chunks are arrays, not entries (store/cold.py): looked up and loaded, they stay so
    # (each read checks its token ids against its key); promoted or evicted, they are thawed.
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = [tokens_for(40 + i, 3 * CHUNK) for i in range(3)]
    for t in tokens:
        store_prefix(store, ns, t)
    lmdb_cap = 9 * store._tiers["lmdb"].footprint(store.layout(ns).chunk_bytes, store.layout(ns).layout_id)
    store.close()

    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=0)
    assert store._cold.live == 9 and not store._index and store.stats().chunks == 9
    store.check_invariants()
    for _ in range(2):  # the second load reads them cold again
        assert load_all(store, ns, tokens[0]) == [("lmdb", p) for p in expected_payloads(store, ns, tokens[0], 3)]
    assert store._cold.live == 9 and not store._index and store.contains(store.chunk_keys(ns, tokens[0])[2])
    store.check_invariants()
    # A Store of a prefix that is all cold sends nothing: held.
    with store.begin_store(ns, tokens[1]) as txn:
        assert txn.chunks_needed == []
    store.close()

    # With room in memory, a load promotes (thaws) what it read; pressure on LMDB evicts cold chunks.
    store = open_store(tmp_path, device_capacity_bytes=0, dram_capacity_bytes=4 * 4096, lmdb_capacity_bytes=lmdb_cap)
    assert load_all(store, ns, tokens[2]) == [("lmdb", p) for p in expected_payloads(store, ns, tokens[2], 3)]
    assert store._cold.live == 6 and set(store._index) == set(store.chunk_keys(ns, tokens[2]))
    assert store.lookup(ns, tokens[2]).chunk_tiers == ("dram",) * 3
    store.check_invariants()
    fresh = tokens_for(50, 3 * CHUNK)
    assert store_prefix(store, ns, fresh).stored_chunks == 3  # LMDB full: three cold chunks make room
    # DRAM full too: two promoted chunks make room there, held by LMDB only now, so cold again (folded).
    assert store._cold.live == 3 + 2 and store._cold.folded == 2 and store.stats().chunks == 12 - 3
    store.check_invariants()
    assert [p for _, p in load_all(store, ns, fresh)] == expected_payloads(store, ns, fresh, 3)
    store.close()


@pytest.mark.parametrize("write_policy", ["write-back", "write-through"])
def test_an_lmdb_read_outlived_by_its_pin_is_a_miss_never_a_loss_of_the_chunk_stored_again(
    tmp_path: Path, write_policy: str,
) -> None:
    # A Load reads LMDB outside the lock. Its client was slow: the pin lapsed, other Stores evicted
    # the chunk (its value deleted) and the prompt was stored again before the read was booked.
    now = [0.0]
    fp = 4337  # a toy chunk's LMDB footprint at this chunk size (a leaf's half-full share + its index record)
    cfg = small_config(device_capacity_bytes=0, dram_capacity_bytes=2 * 4096,
                       lmdb_capacity_bytes=(3 if write_policy == "write-back" else 5) * fp,
                       write_policy=write_policy, pin_timeout_seconds=30.0, eviction_policy="lru")
    store = GlobalStore(cfg, tmp_path, MODELS, clock=lambda: now[0])
    ns = store.namespace("alice", "reference-toy-8", "bounded")
    prompt = tokens_for(1, CHUNK)
    key = store.chunk_keys(ns, prompt)[0]
    store_prefix(store, ns, prompt)
    for seed in (2, 3, 4):  # out of DRAM (into LMDB under write-back)
        store_prefix(store, ns, tokens_for(seed, CHUNK))
    session = store.load(ns, prompt)
    read = store._durable.get_into
    raced = []

    def slow_read(k: bytes, out: memoryview) -> ChunkMeta | None:
        if k != key or raced:
            return read(k, out)
        raced.append(k)
        now[0] += 31.0
        store.expire_pins()
        for seed in range(5, 11):
            store_prefix(store, ns, tokens_for(seed, CHUNK))
        meta = read(k, out)
        assert meta is None  # evicted: its value deleted
        store_prefix(store, ns, prompt)
        return meta

    store._durable.get_into = slow_read  # type: ignore[method-assign]
    try:
        assert [c.tier for c in session] == []  # a miss for this Load...
    finally:
        store._durable.get_into = read  # type: ignore[method-assign]
        session.close()
    assert raced and store.stats().corrupt_reads == 0  # ...not a corrupt chunk
    with store._lock:
        entry = store._peek(key)
        assert entry is not None
        if write_policy == "write-through":  # the value stored again is still charged to LMDB
            assert "lmdb" in entry.footprint
    assert store.lookup(ns, prompt).hit_chunks == 1
    store.check_invariants()
    store.close()
