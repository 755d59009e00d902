"""The compiled SHA-256 chain of chunk keys gives exactly the keys of keys.chain_keys (the
reference), and falls back to hashlib, with the same keys, wherever it cannot be used."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.keys import chain as key_chain
from kvstore.keys.chunk_keys import chain_keys, split_chunks

STEP = 512  # 128 tokens


def chunks(n: int, seed: int, step: int = STEP) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n * step, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 256])
def test_the_chain_equals_the_reference_for_short_and_long_runs(n: int) -> None:
    prev = bytes(range(32))
    raw = chunks(n, n)
    want = chain_keys(prev, split_chunks(raw, STEP))
    assert key_chain.chain_from(prev, raw, STEP) == want
    assert key_chain.chain_hashlib(prev, raw, STEP) == want


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.sampled_from([8, 32, 512, 1024]), st.binary(min_size=32, max_size=32),
       st.integers(0, 2**32 - 1))
def test_any_run_of_any_chunk_size_chains_as_the_reference(n: int, step: int, prev: bytes, seed: int) -> None:
    raw = chunks(n, seed, step)
    assert key_chain.chain_from(prev, raw, step) == chain_keys(prev, split_chunks(raw, step))


@pytest.mark.parametrize("n", [0, 2, 40])  # hashlib below MIN_KERNEL_CHUNKS, the compiled loop above
def test_chained_count_is_how_many_chunks_from_the_first_hash_to_their_keys(n: int) -> None:
    prev = bytes(range(32))
    parts = split_chunks(chunks(n, 7), STEP)
    keys = chain_keys(prev, parts)
    assert key_chain.chained_count(prev, parts, keys) == n
    assert key_chain.chained_count(prev, parts, keys[: n // 2]) == n // 2  # the keys bound it
    assert key_chain.chained_count(prev, parts[: n // 2], keys) == n // 2
    if n:
        wrong = [*parts[:-1], bytes(STEP)]  # the last chunk's token ids are not its key's
        assert key_chain.chained_count(prev, wrong, keys) == n - 1
        assert key_chain.chained_count(b"\0" * 32, parts, keys) == 0  # another chain altogether
        # A chunk of another size ends the hashed run even where it chains (the caller checks on).
        odd = [*parts[:-1], parts[-1][:8]]
        assert key_chain.chained_count(prev, odd, chain_keys(prev, odd)) == n - 1


def test_a_partial_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="whole number of 512-byte chunks"):
        key_chain.chain_from(bytes(32), bytes(STEP * 4 + 3), STEP)


def test_openssl_is_in_use_wherever_a_shared_libcrypto_is_loaded() -> None:
    # numba is a dependency; the loop falls back only where no shared libcrypto exists (a Python
    # with OpenSSL linked in statically), so here it must be the compiled loop.
    kernel = key_chain.load_kernel()
    assert kernel == ("openssl" if key_chain._libcrypto() is not None else "hashlib")


def test_a_disabled_jit_hashes_through_hashlib_with_the_same_keys() -> None:
    probe = ("from kvstore.keys import chain as key_chain; import hashlib; raw = bytes(range(256)) * 40; "
             "print(key_chain.load_kernel(), key_chain.chain_from(bytes(32), raw, 512)[-1].hex())")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "NUMBA_DISABLE_JIT": "1"},
                         capture_output=True, text=True, check=True, timeout=60)
    name, last = out.stdout.split()
    raw = bytes(range(256)) * 40
    assert name == "hashlib" and last == chain_keys(bytes(32), split_chunks(raw, STEP))[-1].hex()


def test_a_loop_that_disagrees_with_hashlib_on_the_probe_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.keys.chain_loop as loop

    def wrong(cache: bool) -> Any:  # fault: a loop whose keys are not SHA-256's
        def kernel(raw: Any, step: int, n: int, out: Any) -> int:
            out[32:] = 7
            return 1

        return kernel

    monkeypatch.setattr(loop, "compiled", wrong)
    kernel, name, why = key_chain._compile()
    assert kernel is None and name == "hashlib" and "disagreed with hashlib" in why


def test_a_library_without_the_low_level_calls_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(key_chain, "_libcrypto", lambda: sys.executable)  # fault: not a libcrypto
    kernel, name, why = key_chain._compile()
    assert kernel is None and name == "hashlib" and "no low-level SHA-256 calls" in why
