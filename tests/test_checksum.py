"""The payload checksum: sum64, and the fused copy-and-sum of the read path (compiled by numba,
with numpy as the fallback) giving the same sums and copies as each other and as sum64."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.tiers import checksum


def words(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 2**64, size=n, dtype=np.uint64).tobytes()


def test_sum64_wraps_and_pads_a_partial_word() -> None:
    top = (2**64 - 1).to_bytes(8, "little")
    assert checksum.sum64(memoryview(top + (2).to_bytes(8, "little"))) == 1  # wrapped
    assert checksum.sum64(memoryview(b"")) == 0
    assert checksum.sum64(memoryview(b"\x01\x02\x03")) == 0x030201  # zero-padded tail


@pytest.mark.parametrize("n_words", [1, 7, 1272, 14_240])
def test_the_fused_kernel_copies_and_sums_like_two_numpy_passes(n_words: int) -> None:
    assert checksum.load_kernel() in ("numba", "numpy")
    src = words(n_words, n_words)
    ro = memoryview(src)  # read-only, as the views of the LMDB map are
    dst = bytearray(len(src))
    got = checksum.copy_sum64(ro, memoryview(dst))
    assert dst == src and got == checksum.sum64(ro)
    dst2 = np.empty(n_words, np.uint64)
    assert checksum._copy_sum_numpy(np.frombuffer(src, np.uint64), dst2) == got
    assert dst2.tobytes() == src


@pytest.mark.parametrize("n", [0, 3, 8, 1001, 113_920])
def test_the_copy_a_value_is_built_with_copies_and_sums_any_length(n: int) -> None:
    src = np.random.default_rng(n).bytes(n)
    for view in (memoryview(src), memoryview(bytearray(src))):  # read-only and writable sources
        dst = bytearray(b"\xff" * n)
        assert checksum.copy_sum64_released(view, memoryview(dst)) == checksum.sum64(memoryview(src))
        assert dst == src
    with pytest.raises(ValueError, match="destination"):
        checksum.copy_sum64_released(memoryview(src), memoryview(bytearray(n + 1)))


def test_the_kernel_reads_words_at_an_offset_without_slicing() -> None:
    src = bytes(16) + words(100, 3)
    dst = bytearray(800)
    assert checksum.copy_words_sum64(memoryview(src), 16, 100, memoryview(dst)) == checksum.sum64(memoryview(src[16:]))
    assert dst == src[16:]


def test_bad_buffers_are_refused_before_the_unchecked_loop_runs() -> None:
    src = memoryview(words(4, 1))
    with pytest.raises(ValueError, match="destination of 8 bytes"):
        checksum.copy_sum64(src, memoryview(bytearray(8)))  # would write past the buffer
    with pytest.raises(ValueError, match="whole 8-byte words"):
        checksum.copy_sum64(memoryview(b"123"), memoryview(bytearray(3)))
    with pytest.raises(ValueError):
        checksum.copy_words_sum64(src, 16, 4, memoryview(bytearray(32)))  # runs past the source


def test_a_single_flipped_bit_changes_the_sum() -> None:
    src = bytearray(words(1272, 9))
    base = checksum.copy_sum64(memoryview(bytes(src)), memoryview(bytearray(len(src))))
    for bit in (0, 7, 5000, len(src) * 8 - 1):
        src[bit // 8] ^= 1 << (bit % 8)
        assert checksum.copy_sum64(memoryview(bytes(src)), memoryview(bytearray(len(src)))) != base
        src[bit // 8] ^= 1 << (bit % 8)


def test_numba_is_in_use_here_and_a_disabled_jit_falls_back_to_numpy() -> None:
    # numba is a dependency, so the suite runs the compiled kernel; NUMBA_DISABLE_JIT (a debugging
    # switch) would run the loop as Python, so the numpy path takes over instead.
    assert checksum.load_kernel() == "numba"
    probe = "from kvstore.tiers import checksum; print(checksum.load_kernel())"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "NUMBA_DISABLE_JIT": "1"},
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "numpy"
