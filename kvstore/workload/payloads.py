"""Realistic payloads for benchmarks: FP4 records quantized from Gaussian activations.

Random bytes would make compression look useless and real FP4 data look random; quantizing a
Gaussian through the real codecs gives the value-nibble and scale-byte statistics that the LMDB
tier's compression sees in production.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore import codecs
from kvstore.layout import CacheLayout


def realistic_chunk(layout: CacheLayout, seed: int = 0) -> bytes:
    """One chunk payload in `layout`'s record format (segments of fp4 / scale bytes)."""
    gen = torch.Generator().manual_seed(seed)
    out = bytearray(layout.chunk_bytes)
    offset = 0
    for g in layout.groups:
        n = layout.chunk_tokens // g.ratio
        parts: list[np.ndarray] = []
        segs = list(g.segments)
        i = 0
        while i < len(segs):
            seg = segs[i]
            nxt = segs[i + 1] if i + 1 < len(segs) else None
            if seg.kind == "fp4" and nxt is not None and nxt.kind == "e4m3_scale":
                x = torch.randn(n, seg.nbytes * 2, generator=gen)  # [n, D]
                packed, scales = codecs.quantize_main_kv(x)
                parts += [packed.numpy(), scales.numpy()]
                i += 2
            elif seg.kind == "fp4" and nxt is not None and nxt.kind == "ue8m0_scale":
                x = torch.randn(n, seg.nbytes * 2, generator=gen)
                packed, scales = codecs.quantize_fp4_ue8m0(x, group=seg.nbytes * 2 // nxt.nbytes)
                parts += [packed.numpy(), scales.numpy()]
                i += 2
            else:
                rng = np.random.default_rng(seed + i)
                parts.append(rng.integers(0, 256, (n, seg.nbytes), dtype=np.uint8))
                i += 1
        records = np.concatenate([p.reshape(n, -1).astype(np.uint8) for p in parts], axis=1)
        assert records.shape == (n, g.record_bytes)
        out[offset : offset + records.nbytes] = records.tobytes()
        offset += records.nbytes
    assert offset == layout.chunk_bytes
    return bytes(out)
