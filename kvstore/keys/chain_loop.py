"""The compiled loop of chain.py, in a module of its own so that numba can cache its machine
code (a loop defined inside a function is compiled anew in every process). Imported only by
key_chain._compile, after it has registered the three OpenSSL symbols named here with LLVM."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types

from kvstore.keys.chunk_keys import KEY_BYTES

SHA256_CTX_WORDS = 32  # 256 bytes; sizeof(SHA256_CTX) is 112
# The symbols key_chain.SYMBOLS registers. Pointers travel as integers (uintp): the same registers
# as void* in the C calling convention.
_P = types.uintp
sha256_init: Any = types.ExternalFunction("kvstore_sha256_init", types.int32(_P))
sha256_update: Any = types.ExternalFunction("kvstore_sha256_update", types.int32(_P, _P, _P))
sha256_final: Any = types.ExternalFunction("kvstore_sha256_final", types.int32(_P, _P))


def chain_loop(raw: Any, step: int, n: int, out: Any) -> int:  # pragma: no cover (run compiled)
    """Key i of the `n` chunks of `raw` into bytes 32(i+1).. of `out`, whose first 32 bytes hold
    the key before the first chunk. 1 when every OpenSSL call succeeded."""
    ctx = np.empty(SHA256_CTX_WORDS, np.uint64)
    c, o, r = ctx.ctypes.data, out.ctypes.data, raw.ctypes.data
    ok = 1
    for i in range(n):
        ok &= sha256_init(c)
        ok &= sha256_update(c, o + KEY_BYTES * i, KEY_BYTES)
        ok &= sha256_update(c, r + i * step, step)
        ok &= sha256_final(o + KEY_BYTES * (i + 1), c)
    return ok


def compiled(cache: bool) -> Any:
    return numba.njit(nogil=True, boundscheck=False, cache=cache)(chain_loop)
