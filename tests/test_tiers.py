"""The tier contract, run over every tier (device, DRAM, LMDB) with tiny capacities.

Real resources throughout: the arenas allocate real tensors, LMDB runs in a temp directory. The
only fault injected is an iterable that fails half-way through a batch.
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.config.store import StoreConfig
from kvstore.errors import InvalidInput, StorageError
from kvstore.layout import DEEPSEEK_V41_FLASH
from kvstore.tiers.arena import FreeRuns
from kvstore.tiers.base import ChunkMeta, Tier
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.factory import build_tiers
from kvstore.tiers.lmdb_tier import LmdbTier
from tests.helpers.tier_data import LAYOUT, fragment, key_of, meta_of, payload_of

PAGE = 4096
CHUNK = LAYOUT.chunk_bytes  # 10,176 B: 3 pages of 4 KiB
CAPACITY_CHUNKS = 6
TIER_KINDS = ["device", "dram", "lmdb"]


def make_tier(kind: str, tmp_path: Path) -> Tier:
    pages = CAPACITY_CHUNKS * 3
    if kind == "device":  # on the GPU where there is one: the contract holds for its pool too
        return DeviceTier(pages * PAGE, PAGE, "auto")
    if kind == "dram":
        return DramTier(pages * PAGE, PAGE)
    # the map may not grow past 2 MiB, so "more than fits" is reachable for LMDB too
    return LmdbTier(tmp_path / "lmdb", CAPACITY_CHUNKS * CHUNK, [LAYOUT], durability="sync",
                    compression="none", initial_map_bytes=1 << 20, max_map_bytes=2 << 20)


@pytest.fixture(params=TIER_KINDS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    t = make_tier(request.param, tmp_path)
    yield t
    t.close()


def put(t: Tier, seed: int, i: int) -> bytes:
    k = key_of(seed, i)
    t.put(k, memoryview(payload_of(k)), meta_of(k))
    return k


def read(t: Tier, key: bytes) -> tuple[ChunkMeta | None, bytes]:
    out = bytearray(CHUNK)
    meta = t.get_into(key, memoryview(out))
    return meta, bytes(out)


def test_put_then_get_returns_the_bytes_and_meta(tier: Tier) -> None:
    k = put(tier, 1, 0)
    meta, data = read(tier, k)
    assert meta == meta_of(k)
    assert data == payload_of(k)


def test_absent_key_is_none_and_leaves_the_buffer_alone(tier: Tier) -> None:
    out = bytearray(b"\xaa" * CHUNK)
    assert tier.get_into(key_of(9, 9), memoryview(out)) is None
    assert out == b"\xaa" * CHUNK


def test_delete_removes_and_deleting_an_absent_key_is_a_no_op(tier: Tier) -> None:
    k = put(tier, 1, 0)
    tier.delete(k)
    assert read(tier, k)[0] is None
    tier.delete(k)
    tier.delete(key_of(9, 9))
    assert tier.stats().entries == 0
    assert tier.stats().used_bytes == 0


def test_put_over_an_existing_key_replaces_it(tier: Tier) -> None:
    k = key_of(1, 0)
    other = payload_of(key_of(2, 0))
    tier.put(k, memoryview(payload_of(k)), meta_of(k))
    tier.put(k, memoryview(other), meta_of(k))
    assert read(tier, k)[1] == other
    assert tier.stats().entries == 1


def test_footprint_bounds_used_bytes(tier: Tier) -> None:
    fp = tier.footprint(CHUNK, b"")
    assert fp >= CHUNK
    keys = [put(tier, 1, i) for i in range(4)]
    st = tier.stats()
    assert st.entries == 4
    assert 4 * CHUNK <= st.used_bytes <= 4 * fp
    assert st.capacity_bytes == tier.capacity_bytes > 0
    for k in keys:
        tier.delete(k)
    assert tier.stats().used_bytes == 0


def test_put_many_stores_every_item(tier: Tier) -> None:
    keys = [key_of(3, i) for i in range(5)]
    tier.put_many((k, memoryview(payload_of(k)), meta_of(k)) for k in keys)
    for k in keys:
        assert read(tier, k) == (meta_of(k), payload_of(k))


def test_put_many_with_a_repeated_key_keeps_the_last_payload(tier: Tier) -> None:
    k = key_of(3, 0)
    first, last = payload_of(key_of(3, 1)), payload_of(key_of(3, 2))
    tier.put_many([(k, memoryview(first), meta_of(k)), (k, memoryview(last), meta_of(k))])
    assert read(tier, k)[1] == last
    assert tier.stats().entries == 1


def test_put_many_is_all_or_none_when_the_items_fail_half_way(tier: Tier) -> None:
    keep = put(tier, 1, 0)

    def items() -> Iterator[tuple[bytes, memoryview, ChunkMeta]]:
        for i in range(3):
            k = key_of(4, i)
            yield k, memoryview(payload_of(k)), meta_of(k)
        raise RuntimeError("the stream broke")

    with pytest.raises(RuntimeError):
        tier.put_many(items())
    assert all(read(tier, key_of(4, i))[0] is None for i in range(3))
    assert read(tier, keep)[1] == payload_of(keep)
    assert tier.stats().entries == 1


def test_more_than_fits_raises_storage_error_and_stores_nothing(tier: Tier) -> None:
    keep = put(tier, 1, 0)
    keys = [key_of(5, i) for i in range(60)]  # past the arenas, and (x5 bytes) past a 2 MiB map
    big = [(k, memoryview(payload_of(k) * 5), meta_of(k)) for k in keys] if isinstance(tier, LmdbTier) \
        else [(k, memoryview(payload_of(k)), meta_of(k)) for k in keys]
    with pytest.raises(StorageError):
        tier.put_many(big)
    assert all(tier.get_into(k, memoryview(bytearray(5 * CHUNK))) is None for k in keys)
    assert read(tier, keep)[1] == payload_of(keep)
    assert tier.stats().entries == 1


@pytest.mark.parametrize("kind", ["bytearray", "offset-memoryview", "numpy-u8", "numpy-f32", "torch"])
def test_get_into_any_host_buffer(tier: Tier, kind: str) -> None:
    k = put(tier, 1, 0)
    expect = np.frombuffer(payload_of(k), dtype=np.uint8)
    if kind == "bytearray":
        buf = bytearray(CHUNK + 100)
        assert tier.get_into(k, memoryview(buf)) is not None
        got = np.frombuffer(buf, dtype=np.uint8)[:CHUNK]
        assert not any(buf[CHUNK:])  # only out[:payload_bytes] is written
    elif kind == "offset-memoryview":
        big = bytearray(CHUNK + 64)
        assert tier.get_into(k, memoryview(big)[64:]) is not None
        got = np.frombuffer(big, dtype=np.uint8)[64:]
    elif kind == "numpy-u8":
        arr = np.zeros(CHUNK, dtype=np.uint8)
        assert tier.get_into(k, arr.data) is not None
        got = arr
    elif kind == "numpy-f32":
        farr = np.zeros(CHUNK // 4, dtype=np.float32)
        assert tier.get_into(k, farr.data) is not None
        got = farr.view(np.uint8)
    else:
        t = torch.zeros(CHUNK, dtype=torch.uint8)
        assert tier.get_into(k, t.numpy().data) is not None
        got = t.numpy()
    assert np.array_equal(got, expect)


def test_a_buffer_too_small_is_invalid_input(tier: Tier) -> None:
    k = put(tier, 1, 0)
    with pytest.raises(InvalidInput):
        tier.get_into(k, memoryview(bytearray(CHUNK - 1)))


def test_join_payloads_is_the_head_and_the_payloads_or_none(tier: Tier) -> None:
    keys = [put(tier, 10, i) for i in range(3)]
    joined = tier.join_payloads(b"head", keys)
    if isinstance(tier, LmdbTier) or getattr(tier, "backend", "") == "cuda:0":
        assert joined is None  # LMDB verifies every read into the caller's buffer; a GPU's pages are not host bytes
        return
    assert joined == b"head" + b"".join(payload_of(k) for k in keys)
    assert tier.join_payloads(b"head", [*keys, key_of(10, 99)]) is None  # one absent: nothing
    assert tier.join_payloads(b"", []) == b""


def test_stats_count_entries(tier: Tier) -> None:
    for i in range(3):
        put(tier, 6, i)
    st = tier.stats()
    assert (st.entries, st.corrupt_total) == (3, 0)
    assert st.used_bytes <= st.capacity_bytes or isinstance(tier, LmdbTier)


# --- arena specifics --------------------------------------------------------------------------


def test_arena_chunks_survive_fragmentation() -> None:
    """Fill, free every other chunk, then put chunks that need pages from several free runs."""
    t = DramTier(12 * PAGE, PAGE)
    held = fragment(t, PAGE)
    big = [key_of(8, i) for i in range(2)]
    for k in big:  # 3 pages each, from 1-page holes
        t.put(k, memoryview(payload_of(k, 3 * PAGE - 5)), meta_of(k))
    for k in big:
        out = bytearray(3 * PAGE)
        assert t.get_into(k, memoryview(out)) == meta_of(k)
        assert bytes(out[: 3 * PAGE - 5]) == payload_of(k, 3 * PAGE - 5)
    for k in held:
        out = bytearray(PAGE)
        assert t.get_into(k, memoryview(out)) is not None and bytes(out) == payload_of(k, PAGE)
    assert t.stats().used_bytes == 12 * PAGE
    # a chunk held in several runs joins from all of them, in order
    assert t.join_payloads(b"h", [big[1], held[0]]) == b"h" + payload_of(big[1], 3 * PAGE - 5) + payload_of(
        held[0], PAGE)


def test_free_runs_keep_their_invariants_under_random_use() -> None:
    rng = random.Random(3)
    n = 64
    free = FreeRuns(n)
    held: list[list[tuple[int, int]]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or free.free_pages == 0):
            for start, count in held.pop(rng.randrange(len(held))):
                free.release(start, count)
        else:
            runs = free.take(rng.randint(1, 9))
            if runs is not None:
                held.append(runs)
        owned = sorted(p for runs in held for s, c in runs for p in range(s, s + c))
        assert len(owned) == len(set(owned)) == n - free.free_pages
        assert all(0 <= p < n for p in owned)
    for runs in held:
        for start, count in runs:
            free.release(start, count)
    assert free.run_count == 1 and free.free_pages == n  # everything coalesced back


def test_arena_prefers_one_contiguous_run() -> None:
    free = FreeRuns(32)
    a = free.take(4)
    b = free.take(6)
    assert a == [(28, 4)] and b == [(22, 6)]  # off the top: taken last first, they lie in order
    assert a is not None
    free.release(*a[0])
    assert free.take(3) == [(29, 3)]  # best fit: the 4-page hole, not the 22-page run below
    assert free.take(5) == [(17, 5)]


def test_the_device_copy_path_works_without_a_gpu() -> None:
    """The torch copy path a CUDA pool takes, exercised on a CPU pool (no GPU in CI)."""
    t = DeviceTier(12 * PAGE, PAGE, "cpu")
    t._host = None  # as for a CUDA pool: copies go through torch, not host memoryviews
    keys = [key_of(9, i) for i in range(4)]
    for k in keys:
        t.put(k, memoryview(payload_of(k)), meta_of(k))
    t.delete(keys[1])
    k = key_of(9, 9)
    t.put(k, memoryview(payload_of(k, 2 * PAGE + 7)), meta_of(k))
    for key in (keys[0], keys[2], keys[3]):
        assert read(t, key) == (meta_of(key), payload_of(key))
    out = bytearray(3 * PAGE)
    assert t.get_into(k, memoryview(out)) == meta_of(k)
    assert bytes(out[: 2 * PAGE + 7]) == payload_of(k, 2 * PAGE + 7)


def test_a_zero_capacity_arena_holds_nothing() -> None:
    t = DramTier(0, PAGE)
    assert t.capacity_bytes == 0 and t.footprint(CHUNK, b"") == 3 * PAGE
    with pytest.raises(StorageError):
        put(t, 1, 0)


def test_an_empty_chunk_holds_no_page_and_can_be_replaced_and_deleted() -> None:
    t = DramTier(4 * PAGE, PAGE)
    key = bytes(32)
    meta = ChunkMeta(bytes(32), DEEPSEEK_V41_FLASH.layout_id, b"")
    t.put(key, memoryview(b""), meta)
    assert t.stats().used_bytes == 0
    t.put(key, memoryview(b"x" * 10), meta)
    assert t.stats().used_bytes == PAGE
    t.put(key, memoryview(b""), meta)
    t.delete(key)
    assert t.stats().entries == 0 and t.stats().used_bytes == 0


def test_device_tier_reports_where_it_lives() -> None:
    t = DeviceTier(4 * PAGE, PAGE, "auto")
    assert t.backend == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert DeviceTier(4 * PAGE, PAGE, "cpu").backend == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_tier_asked_for_cuda_without_cuda_fails_fast() -> None:
    with pytest.raises(StorageError, match="CUDA"):
        DeviceTier(4 * PAGE, PAGE, "cuda")


def test_dram_tier_pins_only_with_cuda() -> None:
    assert DramTier(4 * PAGE, PAGE).pinned == torch.cuda.is_available()


def test_factory_builds_the_three_tiers_from_config(tmp_path: Path) -> None:
    cfg = StoreConfig(device="cpu", device_capacity_bytes=8 * PAGE, dram_capacity_bytes=16 * PAGE,
                      lmdb_capacity_bytes=1 << 20, page_bytes=PAGE, lmdb_durability="nometasync",
                      compression="zstd")
    device, dram, lmdb_tier = build_tiers(cfg, tmp_path, [LAYOUT])
    try:
        assert (device.name, dram.name, lmdb_tier.name) == ("device", "dram", "lmdb")
        assert (device.capacity_bytes, dram.capacity_bytes) == (8 * PAGE, 16 * PAGE)
        assert lmdb_tier.capacity_bytes == 1 << 20 and lmdb_tier.durability == "nometasync"
        assert (tmp_path / "lmdb" / "data.mdb").exists()
        for t in (device, dram, lmdb_tier):
            k = put(t, 1, 0)
            assert read(t, k)[1] == payload_of(k)
    finally:
        for t in (device, dram, lmdb_tier):
            t.close()


def _resident_bytes(address: int, nbytes: int) -> int:
    """How many bytes of [address, address + nbytes) are in memory (mincore, page by page)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    pages = (address + nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page


@pytest.mark.parametrize("prefault", [True, False])
def test_host_arenas_are_backed_at_start_when_asked(tmp_path: Path, prefault: bool) -> None:
    # A fresh arena took stores at a quarter of a touched one's speed (first-touch page faults):
    # prefaulted, its pages are resident before the first store; not, a capacity costs nothing.
    cfg = StoreConfig(device="cpu", device_capacity_bytes=0, dram_capacity_bytes=64 << 20,
                      lmdb_capacity_bytes=4 << 20, prefault_arenas=prefault)
    lines: list[str] = []
    device, dram, lmdb = build_tiers(cfg, tmp_path, [DEEPSEEK_V41_FLASH], lines.append)
    try:
        if dram.pinned:  # with a GPU: page-locked at allocation, by the driver; nothing to touch
            assert dram.prefaulted.is_set() == prefault and not any("backing" in line for line in lines)
            assert dram.prefault() == (0, False)
        elif prefault:
            assert dram.prefaulted.wait(30)
            # The pool's own pages, not the process's memory, which other tests' threads may free
            # meanwhile.
            resident = _resident_bytes(dram._pool.data_ptr(), 64 << 20)
            assert resident >= 60 << 20, resident
            assert any("backing 64.0 MiB" in line for line in lines)
            assert _wait_for(lambda: any("backed in" in line for line in lines))
        else:
            resident = _resident_bytes(dram._pool.data_ptr(), 64 << 20)
            assert resident < 16 << 20, resident
            assert not any("arenas" in line for line in lines)
    finally:
        for t in (device, dram, lmdb):
            t.close()


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_prefaulting_beside_stores_never_writes_a_page_a_chunk_holds() -> None:
    arena = DramTier(4 << 20, 4096)
    cb = 50_000
    keys = [bytes([i]) * 32 for i in range(40)]
    payloads = {k: np.random.default_rng(k[0]).integers(0, 256, cb, dtype=np.uint8).tobytes() for k in keys}
    meta = ChunkMeta(b"n" * 32, DEEPSEEK_V41_FLASH.layout_id, b"")
    for k in keys[:20]:
        arena.put(k, memoryview(payloads[k]), meta)
    t = threading.Thread(target=arena.prefault, kwargs={"slice_bytes": 64 << 10})
    t.start()
    for k in keys[20:]:  # stores while the free pages are being written
        arena.put(k, memoryview(payloads[k]), meta)
    t.join()
    assert arena.prefaulted.is_set()
    out = bytearray(cb)
    for k in keys:
        assert arena.get_into(k, memoryview(out)) is not None and bytes(out) == payloads[k]
    arena.close()


def test_huge_page_advice_needs_a_whole_aligned_huge_page() -> None:
    from kvstore.tiers.arena import advise_huge_pages

    assert advise_huge_pages(4096, 1 << 20) is False  # no 2 MiB-aligned page inside


def test_closing_an_arena_while_it_is_prefaulted_is_safe() -> None:
    arena = DramTier(64 << 20, 4096)
    t = threading.Thread(target=arena.prefault, kwargs={"slice_bytes": 1 << 20})
    t.start()
    arena.close()  # the next slice finds the pool gone and stops
    t.join(30)
    assert not t.is_alive()
