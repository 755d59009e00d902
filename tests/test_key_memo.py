"""The key memo: a prompt seen again reuses its chunk keys only where its token bytes are exactly
the remembered ones, in the same namespace; the keys are always the ones hashing gives."""

from __future__ import annotations

import dataclasses
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.keys.chunk_keys import chain_keys, chunk_token_bytes, full_chunk_bytes, prompt_bytes
from kvstore.keys.memo import KeyMemo, footprint_bytes
from kvstore.store import GlobalStore, lookups
from tests.store_helpers import CHUNK, open_store, store_prefix, tokens_for

STEP = 4 * CHUNK
NS_A, NS_B = b"a" * 32, b"b" * 32


def raw_of(tokens: np.ndarray) -> bytes:
    return full_chunk_bytes(tokens, CHUNK)


def keys_of(ns: bytes, tokens: np.ndarray) -> list[bytes]:
    return chain_keys(ns, chunk_token_bytes(tokens, CHUNK))


def test_repeats_extensions_prefixes_and_divergence_reuse_exactly_the_shared_chunks() -> None:
    memo = KeyMemo(1 << 20)
    base = tokens_for(1, 6 * CHUNK)
    assert memo.known(NS_A, raw_of(base), STEP) == []
    memo.remember(NS_A, raw_of(base), keys_of(NS_A, base), STEP)
    assert memo.known(NS_A, raw_of(base), STEP) == keys_of(NS_A, base)  # the same prompt
    longer = np.concatenate([base, tokens_for(2, 3 * CHUNK)])
    assert memo.known(NS_A, raw_of(longer), STEP) == keys_of(NS_A, base)  # extends it: 6 reused
    assert memo.known(NS_A, raw_of(base[: 2 * CHUNK + 5]), STEP) == keys_of(NS_A, base)[:2]  # a prefix
    forked = base.copy()
    forked[3 * CHUNK + 7] += 1  # differs inside chunk 3: chunks 0-2 only
    assert memo.known(NS_A, raw_of(forked), STEP) == keys_of(NS_A, base)[:3]
    assert memo.known(NS_B, raw_of(base), STEP) == []  # another namespace never shares
    assert memo.hits == 4 and memo.reused_keys == 6 + 6 + 2 + 3


def test_a_longer_prompt_replaces_a_shorter_one_and_not_the_other_way() -> None:
    memo = KeyMemo(1 << 20)
    base = tokens_for(3, 4 * CHUNK)
    memo.remember(NS_A, raw_of(base), keys_of(NS_A, base), STEP)
    memo.remember(NS_A, raw_of(base[: 2 * CHUNK]), keys_of(NS_A, base)[:2], STEP)  # kept: the longer
    assert len(memo.known(NS_A, raw_of(base), STEP)) == 4
    longer = np.concatenate([base, tokens_for(4, CHUNK)])
    memo.remember(NS_A, raw_of(longer), keys_of(NS_A, longer), STEP)
    assert memo.known(NS_A, raw_of(longer), STEP) == keys_of(NS_A, longer) and len(memo) == 1
    assert memo.used_bytes == footprint_bytes(5, STEP)


def test_the_memo_stays_within_its_bytes_dropping_the_least_recently_used() -> None:
    size = footprint_bytes(2, STEP)  # one two-chunk prompt
    memo = KeyMemo(2 * size)
    prompts = [tokens_for(10 + i, 2 * CHUNK) for i in range(3)]
    for p in prompts[:2]:
        memo.remember(NS_A, raw_of(p), keys_of(NS_A, p), STEP)
    assert memo.known(NS_A, raw_of(prompts[0]), STEP)  # prompt 0 is now the most recent
    memo.remember(NS_A, raw_of(prompts[2]), keys_of(NS_A, prompts[2]), STEP)
    assert memo.used_bytes <= 2 * size and len(memo) == 2
    assert memo.known(NS_A, raw_of(prompts[1]), STEP) == []  # the least recently used went
    assert memo.known(NS_A, raw_of(prompts[0]), STEP) == keys_of(NS_A, prompts[0])
    off = KeyMemo(0)
    off.remember(NS_A, raw_of(prompts[0]), keys_of(NS_A, prompts[0]), STEP)
    assert off.known(NS_A, raw_of(prompts[0]), STEP) == [] and len(off) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5 * CHUNK), st.integers(0, 3)), min_size=1, max_size=12))
def test_store_keys_with_the_memo_equal_hashing_every_time(tmp_path_factory, steps) -> None:  # type: ignore[no-untyped-def]
    # Prompts share prefixes (three roots, cut anywhere, tails varied): whatever the memo holds,
    # the store's keys and lookups equal a store's without it.
    path: Path = tmp_path_factory.mktemp("memo")
    with_memo = open_store(path / "on")
    without = open_store(path / "off", key_memo_bytes=0)
    roots = [tokens_for(20 + r, 5 * CHUNK) for r in range(3)]
    for root, cut, tail in steps:
        prompt = np.concatenate([roots[root][:cut], tokens_for(30 + tail, tail * CHUNK)])
        for store in (with_memo, without):
            ns = store.namespace("default", "reference-toy-8", "bounded")
            assert store.chunk_keys(ns, prompt) == keys_of(ns.digest, prompt)
        a, b = (s.lookup(s.namespace("default", "reference-toy-8", "bounded"), prompt) for s in (with_memo, without))
        assert a == b
        if tail == 3:  # now and then store the prompt, so that lookups hit
            for store in (with_memo, without):
                store_prefix(store, store.namespace("default", "reference-toy-8", "bounded"), prompt)
    with_memo.close()
    without.close()


def test_a_chunk_held_with_other_token_ids_is_still_a_mismatch_when_its_key_comes_from_the_memo(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(40, 3 * CHUNK)
    store_prefix(store, ns, tokens)  # the Store remembered the keys
    assert store.lookup(ns, tokens).hit_chunks == 3 and store._memo.hits >= 1
    keys = store.chunk_keys(ns, tokens)
    # Fault: the index holds a chunk with other token ids under this key (entries are never changed
    # in place: a damaged one is a new entry, which the memo has not seen checked).
    store._index[keys[1]] = dataclasses.replace(store._index[keys[1]], tokens=tokens_for(41, CHUNK).tobytes())
    hits_before = store._memo.hits
    look = store.lookup(ns, tokens)
    assert store._memo.hits == hits_before + 1  # the keys came from the memo
    assert look.hit_chunks == 1 and look.token_mismatches == 1
    store.close()


def test_token_bytes_from_a_request_are_reused_and_equal_the_copied_encoding() -> None:
    ids = tokens_for(50, 3 * CHUNK + 5)
    wire = ids.tobytes()
    arr = np.frombuffer(wire, dtype="<u4")  # as the service wraps a request's u32le field
    assert full_chunk_bytes(arr, CHUNK) == full_chunk_bytes(ids.copy(), CHUNK) == wire[: 3 * STEP]
    whole = np.frombuffer(wire[: 3 * STEP], dtype="<u4")
    assert full_chunk_bytes(whole, CHUNK) is whole.base  # no copy at all
    assert full_chunk_bytes(arr[1:], CHUNK) == ids[1:].tobytes()[: 3 * STEP]  # a view: copied, right


def _lookup_peak_bytes(store: GlobalStore, ns: Any, tokens: np.ndarray) -> int:
    """The most memory a second lookup of `tokens` allocates at once (the first fills the memo)."""
    store.lookup(ns, tokens)
    tracemalloc.start()
    try:
        store.lookup(ns, tokens)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_lookup_reads_a_requests_bytes_in_place_whatever_its_partial_tail(tmp_path: Path) -> None:
    # A lookup once copied a request's bytes to drop the partial chunk at its end (3.6 MB for 900K
    # tokens, under the interpreter lock): it now reads whole chunks of them by offset. Whatever
    # the tail, and whatever the memo remembers of the prompt, it hits as a copied array does.
    store = open_store(tmp_path)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    prompt = tokens_for(60, 3 * CHUNK)
    store_prefix(store, ns, prompt)
    for tail in (0, 1, 5, CHUNK - 1):
        for seed in (61, 62):  # the memo remembers the first tail's bytes; the second differs
            ids = np.concatenate([prompt, tokens_for(seed, tail)]).astype("<u4")
            wire = np.frombuffer(ids.tobytes(), dtype="<u4")  # as the service wraps a request's field
            assert prompt_bytes(wire) is wire.base
            got, want = store.lookup(ns, wire), store.lookup(ns, ids.copy())
            assert got == want and (got.hit_chunks, got.remainder_tokens) == (3, tail), got
    longer = np.frombuffer(np.concatenate([prompt, tokens_for(63, CHUNK + 3)]).astype("<u4").tobytes(), "<u4")
    assert (store.lookup(ns, longer).hit_chunks, store.lookup(ns, longer).full_chunks) == (3, 4)
    # A long prompt never seen: the lookup allocates nothing near its size.
    big = np.frombuffer(tokens_for(64, 50_000 * CHUNK + 7).astype("<u4").tobytes(), "<u4")  # 3.2 MB
    assert _lookup_peak_bytes(store, ns, big) < big.nbytes // 4
    store.close()


def _in_place(ids: np.ndarray) -> np.ndarray:
    """Token ids as the service reads them in place: a view into the request's bytes, at an odd
    offset as a protobuf field lies."""
    wire = b"\x1a" + ids.astype("<u4").tobytes() + b"\x00"
    return np.frombuffer(memoryview(wire)[1:-1], dtype="<u4")


def test_a_lookup_of_ids_read_in_place_copies_only_what_its_walk_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It copied all of them to bytes first: 3.6 MB for a 900K-token prompt never seen, under the
    # interpreter lock. Hits shorter, as long as and longer than the first part copied, a prompt
    # that parts from the stored one past it, and the counters: as for ids that are bytes.
    monkeypatch.setattr(lookups, "WALK_PROBE_CHUNKS", 2)
    store = open_store(tmp_path)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    stored = tokens_for(70, 5 * CHUNK)
    store_prefix(store, ns, stored)
    other = tokens_for(71, 5 * CHUNK)
    for prompt, hit in ((stored[: 3 * CHUNK + 2], 3), (stored, 5), (np.concatenate([stored, other]), 5),
                        (stored[:CHUNK], 1), (np.concatenate([stored[: 3 * CHUNK], other]), 3), (other, 0),
                        (stored[: 2 * CHUNK + 1], 2)):
        before = store.stats().lookups
        got = store.lookup(ns, _in_place(prompt))
        as_bytes = np.frombuffer(prompt.astype("<u4").tobytes(), dtype="<u4")  # read whole, no copy
        assert got.hit_chunks == hit and got == store.lookup(ns, as_bytes), len(prompt)
        assert store.lookup(ns, prompt.copy()) == got  # an array of its own: copied in part too
        assert store.stats().lookups == before + 3  # one each
    big = _in_place(tokens_for(72, 50_000 * CHUNK + 7))  # 3.2 MB never stored
    assert _lookup_peak_bytes(store, ns, big) < big.nbytes // 50
    # The probe is the patched two chunks (the walk above went past it), then the rest once they hit.
    read: list[int] = []
    real = lookups.prompt_bytes
    monkeypatch.setattr(lookups, "prompt_bytes", lambda t, most=None: read.append(len(got := real(t, most))) or got)
    assert store.lookup(ns, _in_place(stored)).hit_chunks == 5
    assert read == [2 * 4 * CHUNK, 5 * 4 * CHUNK]
    store.close()


def test_entries_checked_once_against_the_same_bytes_are_not_compared_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = open_store(tmp_path)
    ns = store.namespace("default", "reference-toy-8", "bounded")
    tokens = tokens_for(42, 4 * CHUNK)
    store_prefix(store, ns, tokens)
    compared: list[int] = []  # how many entries each lookup compared token by token
    check = GlobalStore._entries_match

    def spy(entries: list[Any], start: int, raw: bytes, step: int, digest: bytes) -> bool:
        compared.append(len(entries) - start)
        return check(entries, start, raw, step, digest)

    monkeypatch.setattr(GlobalStore, "_entries_match", staticmethod(spy))
    assert store.lookup(ns, tokens).hit_chunks == 4
    assert store.lookup(ns, tokens).hit_chunks == 4
    assert compared[-1] == 0  # the second lookup compared nothing: all four were checked before
    keys = store.chunk_keys(ns, tokens)
    store._index[keys[2]] = dataclasses.replace(store._index[keys[2]])  # an equal entry, a new object
    assert store.lookup(ns, tokens).hit_chunks == 4
    assert compared[-1] == 2  # from the new entry on, compared again
    assert store.lookup(ns, tokens).hit_chunks == 4 and compared[-1] == 0
    other = np.concatenate([tokens[: 2 * CHUNK], tokens_for(43, 2 * CHUNK)])  # forks after chunk 2
    assert store.lookup(ns, other).hit_chunks == 2 and compared[-1] == 0
    store.close()
