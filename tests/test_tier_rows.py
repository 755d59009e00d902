"""Chunks moved tensor to tensor: the arenas' `put_rows`, `get_rows` and `put_from`, and the copy
planner under them (kvstore/dataplane/rows.py). Every test runs on the CPU; where CUDA is present the
same tests run with the device tier's pool on the GPU, tensors on the GPU and pinned host memory,
with the pitched copy (cupy) and without it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.dataplane import rows as rows_mod
from kvstore.dataplane.rows import copy_chunks, copy_rows
from kvstore.errors import InvalidInput
from kvstore.tiers.arena import PagedArena
from kvstore.tiers.base import ChunkMeta
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.dram import DramTier
from tests.helpers.tier_data import fragment, key_of, meta_of, payload_of
from tests.store_helpers import CHUNK, expected_payloads, open_store, store_prefix, tokens_for

PAGE = 4096
WIDTH = 2 * PAGE + 1000  # a chunk takes three pages and leaves a gap: chunks lie evenly spaced, never back to back
CUDA = torch.cuda.is_available()
PLACES = ["cpu", "cpu-pinned", "cuda"] if CUDA else ["cpu"]
PITCHED = [None, False] if CUDA and rows_mod.pitched_available() else [None]


def _tensor(data: np.ndarray, place: str) -> torch.Tensor:
    t = torch.from_numpy(data.copy())
    if place == "cuda":
        return t.cuda()
    return t.pin_memory() if place == "cpu-pinned" else t


def _chunks(seed: int, n: int) -> tuple[list[bytes], np.ndarray, list[ChunkMeta]]:
    keys = [key_of(seed, i) for i in range(n)]
    data = np.stack([np.frombuffer(payload_of(k, WIDTH), np.uint8) for k in keys])
    return keys, data, [meta_of(k) for k in keys]


def _read(arena: PagedArena, key: bytes) -> bytes:
    out = bytearray(WIDTH)
    assert arena.get_into(key, memoryview(out)) is not None
    return bytes(out)


@pytest.fixture(params=["device", "dram", "dram-split"])
def arena(request: pytest.FixtureRequest) -> Iterator[PagedArena]:
    a: PagedArena
    if request.param == "device":
        a = DeviceTier(40 * PAGE, PAGE, "auto")  # the GPU's memory where there is one
    elif request.param == "dram":
        a = DramTier(40 * PAGE, PAGE)  # pinned where there is a GPU
    else:
        a = DramTier(80 * PAGE, PAGE, owners={"alice": 1.0, "bob": 1.0})
    yield a
    a.close()


@pytest.mark.parametrize("pitched", PITCHED)
@pytest.mark.parametrize("place", PLACES)
def test_rows_go_in_and_come_back_through_tensors_anywhere(
        arena: PagedArena, place: str, pitched: bool | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if pitched is False:
        monkeypatch.setattr(rows_mod, "cupy_runtime", lambda: None)
    keys, data, metas = _chunks(1, 9)
    arena.put_rows(keys, _tensor(data, place), metas, owner="alice")
    for k, row in zip(keys, data, strict=True):  # the plain byte path reads what the tensor path wrote
        assert _read(arena, k) == row.tobytes()
    out = _tensor(np.zeros((12, WIDTH + 8), np.uint8), place)  # wider rows and more of them than asked
    got = arena.get_rows([*keys[:5], key_of(1, 99), keys[6]], out)
    assert got == metas[:5]  # the head that is held, stopping at the absent key
    assert np.array_equal(out.cpu().numpy()[:5, :WIDTH], data[:5]) and not out.cpu().numpy()[5:].any()
    assert not out.cpu().numpy()[:, WIDTH:].any()  # nothing past a chunk's bytes is written


@pytest.mark.parametrize("place", PLACES)
def test_a_strided_source_and_an_overwrite_keep_every_byte(arena: PagedArena, place: str) -> None:
    keys, data, metas = _chunks(2, 6)
    wide = np.zeros((6, WIDTH + 24), np.uint8)
    wide[:, 8 : 8 + WIDTH] = data
    src = _tensor(wide, place)[:, 8 : 8 + WIDTH]  # rows WIDTH + 24 bytes apart
    arena.put_rows(keys, src, metas, owner="bob")
    arena.put_rows(keys[2:4], _tensor(data[::-1][2:4].copy(), place), metas[2:4], owner="bob")  # replaced
    assert [_read(arena, k) for k in keys] == [*(r.tobytes() for r in data[:2]), data[3].tobytes(),
                                               data[2].tobytes(), *(r.tobytes() for r in data[4:])]
    assert arena.stats().entries == 6


def test_chunks_in_several_runs_are_copied_piece_by_piece() -> None:
    a = DramTier(12 * PAGE, PAGE)
    fragment(a, PAGE)
    keys = [key_of(8, i) for i in range(2)]
    metas = [meta_of(k) for k in keys]
    big = np.stack([np.frombuffer(payload_of(k, 3 * PAGE - 5), np.uint8) for k in keys])  # 3 pages from 1-page holes
    a.put_rows(keys, torch.from_numpy(big), metas)
    out = torch.zeros(2, 3 * PAGE - 5, dtype=torch.uint8)
    assert a.get_rows(keys, out) == metas and np.array_equal(out.numpy(), big)
    b = DramTier(12 * PAGE, PAGE)
    assert b.put_from(a, keys) == 2
    assert b.get_rows(keys, out.zero_()) == metas and np.array_equal(out.numpy(), big)


@pytest.mark.parametrize("direction", ["dram-to-device", "device-to-dram"])
def test_put_from_moves_the_held_head_between_arenas(direction: str) -> None:
    dram, device = DramTier(40 * PAGE, PAGE), DeviceTier(40 * PAGE, PAGE, "auto")
    src, dst = (dram, device) if direction == "dram-to-device" else (device, dram)
    keys, data, metas = _chunks(3, 7)
    src.put_rows(keys, torch.from_numpy(data), metas)
    assert dst.put_from(src, [*keys[:4], key_of(3, 77), *keys[4:]]) == 4  # up to the first chunk src lacks
    out = torch.zeros(7, WIDTH, dtype=torch.uint8)
    assert dst.get_rows(keys, out) == metas[:4] and np.array_equal(out.numpy()[:4], data[:4])
    assert dst.put_from(src, []) == 0 and src.stats().entries == 7  # a copy: the source keeps its chunks
    with pytest.raises(InvalidInput, match="itself"):
        src.put_from(src, keys)


def test_put_from_into_a_split_arena_lands_in_the_owners_part() -> None:
    src = DeviceTier(40 * PAGE, PAGE, "auto")
    dst = DramTier(80 * PAGE, PAGE, owners={"alice": 1.0, "bob": 1.0})
    keys, data, metas = _chunks(4, 3)
    src.put_rows(keys, torch.from_numpy(data), metas)
    assert dst.put_from(src, keys, owner="bob") == 3
    assert dst.locate_many(keys, "bob") and not dst.locate_many(keys, "alice")
    assert [_read(dst, k) for k in keys] == [r.tobytes() for r in data]


def test_put_from_refuses_a_key_given_twice_and_leaks_no_page() -> None:
    # Before, each occurrence took pages of its own and one entry kept them: deleting the key left
    # the other occurrence's pages used for good.
    src, dst = DramTier(40 * PAGE, PAGE), DeviceTier(40 * PAGE, PAGE, "auto")
    keys, data, metas = _chunks(6, 2)
    src.put_rows(keys, torch.from_numpy(data), metas)
    with pytest.raises(InvalidInput, match="given twice"):
        dst.put_from(src, [keys[0], keys[1], keys[0]])
    assert dst.stats().used_bytes == 0 and dst.stats().entries == 0
    assert dst.put_from(src, keys) == 2
    dst.delete_many(keys)
    assert dst.stats().used_bytes == 0


def test_bad_rows_are_refused_with_the_reason() -> None:
    a = DramTier(40 * PAGE, PAGE)
    keys, data, metas = _chunks(5, 2)
    with pytest.raises(InvalidInput, match="uint8 tensor of 2 rows"):
        a.put_rows(keys, torch.from_numpy(data).float(), metas)
    with pytest.raises(InvalidInput, match="given twice"):
        a.put_rows([keys[0], keys[0]], torch.from_numpy(data), metas)
    a.put_rows(keys, torch.from_numpy(data), metas)
    with pytest.raises(InvalidInput, match="too small"):
        a.get_rows(keys, torch.zeros(2, WIDTH - 1, dtype=torch.uint8))
    with pytest.raises(InvalidInput, match="contiguous rows"):
        a.get_rows(keys, torch.zeros(WIDTH, 2, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="one shape"):
        copy_rows(torch.zeros(2, 3, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="overrun"):
        copy_chunks(torch.zeros(10, dtype=torch.uint8), [[(8, 4)]], torch.zeros(10, dtype=torch.uint8), [[(0, 4)]])


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_a_store_demotes_from_the_device_tier_to_dram_tier_to_tier_and_reads_every_byte_back(
        tmp_path: Path, device: str) -> None:
    """With a GPU, "auto" puts the device tier there and its victims go to pinned DRAM by DMA."""
    store = open_store(tmp_path, device=device, lmdb_capacity_bytes=4 << 20)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    first, second = tokens_for(61, 12 * CHUNK), tokens_for(62, 12 * CHUNK)
    store_prefix(store, ns, first)
    store_prefix(store, ns, second)  # pushes the first prefix's device chunks down to DRAM
    stats = store.stats()
    assert stats.tiers["device"].evictions > 0 and stats.tiers["dram"].demotions > 0
    for tokens in (first, second):
        with store.load(ns, tokens) as session:
            got = [bytes(c.payload) for c in session]
        assert got == expected_payloads(store, ns, tokens, 12)
    store.check_invariants()
    store.close()


def test_the_benchs_device_section_moves_and_checks_every_byte_on_the_cpu_too() -> None:
    """`kvstore bench store --sections device` runs on a GPU only; its code runs here on the CPU so
    that a GPU's short lease is not spent finding its mistakes."""
    from kvstore.bench.store_device import device_figures
    from kvstore.layout import DEEPSEEK_V41_FLASH, REFERENCE_TOY8
    from kvstore.workload.payloads import realistic_chunk

    payload = realistic_chunk(DEEPSEEK_V41_FLASH, seed=1)
    figures = device_figures(DEEPSEEK_V41_FLASH, payload, 6, repeats=1, device_name="cpu",
                             large=(REFERENCE_TOY8, 3))
    targets = figures.pop("device_targets")
    assert figures["codecs_bit_identical"]
    checks = [t for t in targets if t["name"].startswith("every device path moved the right bytes")]
    assert len(checks) == 2 and all(t["ok"] for t in checks)
    assert figures["large_device_layout"] == REFERENCE_TOY8.name and figures["large_device_chunks"] == 3
    for key in ("d2d_copy_gbps", "device_put_gbps", "device_get_gbps", "pinned_h2d_gbps", "tier_h2d_gbps",
                "pinned_d2h_gbps", "tier_d2h_gbps", "device_put_host_gbps", "device_get_host_gbps",
                "large_device_get_gbps", "codec_fp8_ue8m0_cuda_gbps", "codec_fp4_ue8m0_cpu_gbps"):
        assert figures[key] > 0, key


def test_a_copy_that_fails_gives_its_pages_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed copy (injected) leaves no page taken and no entry: the arena is as if nothing came."""
    a, b = DramTier(40 * PAGE, PAGE), DeviceTier(40 * PAGE, PAGE, "cpu")
    keys, data, metas = _chunks(9, 4)
    b.put_rows(keys, torch.from_numpy(data), metas)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected: the copy failed")

    monkeypatch.setattr("kvstore.tiers.arena.copy_chunks", broken)
    for attempt in (lambda: a.put_rows(keys, torch.from_numpy(data), metas), lambda: a.put_from(b, keys)):
        with pytest.raises(RuntimeError, match="injected"):
            attempt()
        assert a.stats().used_bytes == 0 and a.stats().entries == 0
    monkeypatch.undo()
    a.put_rows(keys, torch.from_numpy(data), metas)  # every page is there to take again
    assert [_read(a, k) for k in keys] == [r.tobytes() for r in data]
