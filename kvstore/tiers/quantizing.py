"""A tier wrapper that stores bf16 segments quantized (opt-in, lossy) and reads them back as bf16.

Configured per tier (`StoreConfig.quantize_<tier>`, off by default) and built by the factory
around any tier. The store keeps seeing the layout's chunk bytes: `put` takes the bf16 payload,
`get_into` writes a bf16 payload of the same size (dequantized, so not the bytes that were
stored: see kvstore/tiers/quantize.py for the error bounds), and `footprint()` reports what the
value of its layout really takes in the wrapped tier, so budgets stay honest (and one tenant's
layout never changes what another's chunks are charged). Payloads of layouts
without bf16 segments (or of unknown layouts or sizes) pass through untouched.

Stored values are not self-describing: the wrapper reads a tier's values in the mode it was
built with. A durable tier reopened in another mode reports values of the old mode as another
format version, and one reopened without the wrapper has values of the wrong size: either way the
store ignores (and counts) them like any foreign value, and they are never misread.

The wrapper decides nothing; it only changes the bytes on their way in and out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from kvstore.layout import CacheLayout
from kvstore.tiers import value_format as vf
from kvstore.tiers.base import ChunkMeta, DurableTier, ScanBatch, ScannedChunk, Tier, TierName, TierStats
from kvstore.tiers.quantize import QuantizeMode, QuantPlan, plan_for


class QuantizingTier:
    def __init__(self, inner: Tier, mode: QuantizeMode, layouts: Iterable[CacheLayout]) -> None:
        self._inner = inner
        self.name: TierName = inner.name
        self.mode = mode
        self._plans: dict[bytes, QuantPlan] = {}
        for layout in layouts:
            self.add_layout(layout)

    def add_layout(self, layout: CacheLayout) -> None:
        plan = plan_for(layout, self.mode)
        if plan is not None:
            self._plans[layout.layout_id] = plan
        self._inner.add_layout(layout)

    def forget_layout(self, layout_id: bytes) -> None:
        self._plans.pop(layout_id, None)
        self._inner.forget_layout(layout_id)

    @property
    def backend(self) -> str:
        return str(getattr(self._inner, "backend", ""))

    @property
    def capacity_bytes(self) -> int:
        return self._inner.capacity_bytes

    def footprint(self, payload_bytes: int, layout_id: bytes) -> int:
        # What `_encode` stores for this layout: quantized by its plan, else as it is.
        plan = self._plans.get(layout_id)
        stored = plan.stored_bytes if plan is not None and plan.payload_bytes == payload_bytes else payload_bytes
        return self._inner.footprint(stored, layout_id)

    def _encode(self, payload: memoryview, meta: ChunkMeta) -> memoryview:
        plan = self._plans.get(meta.layout_id)
        if plan is None:
            return payload
        # The store validates sizes against the layout; a read assumes this mode's stored size.
        assert len(payload) == plan.payload_bytes, (len(payload), plan.payload_bytes)
        return memoryview(plan.quantize(payload))

    def put_from(self, src: Tier, keys: Sequence[bytes], owner: str = "") -> int:
        return 0  # chunks are re-encoded on the way in: read from `src` and `put`

    def put(self, key: bytes, payload: memoryview, meta: ChunkMeta, owner: str = "") -> None:
        self._inner.put(key, self._encode(payload, meta), meta, owner)

    def put_many(self, items: Iterable[tuple[bytes, memoryview, ChunkMeta]]) -> None:
        self._inner.put_many([(k, self._encode(p, m), m) for k, p, m in items])

    def get_into(self, key: bytes, out: memoryview) -> ChunkMeta | None:
        # The wrapped tier writes the stored bytes to the head of `out` (they are never longer
        # than the payload); a quantized value is then copied aside and expanded in place.
        return self._expand(self._inner.get_into(key, out), out)

    def _expand(self, meta: ChunkMeta | None, out: memoryview) -> ChunkMeta | None:
        out = vf.byte_view(out)  # a read's destination may be any writable buffer
        if meta is not None:
            plan = self._plans.get(meta.layout_id)
            if plan is not None:
                plan.dequantize_into(memoryview(bytearray(out[: plan.stored_bytes])), out)
        return meta

    def join_payloads(self, head: bytes, keys: Sequence[bytes]) -> bytes | None:
        return None  # stored bytes are not the payload: every read goes through get_into

    def delete(self, key: bytes) -> None:
        self._inner.delete(key)

    def stats(self) -> TierStats:
        return self._inner.stats()

    def close(self) -> None:
        self._inner.close()


class QuantizingDurableTier(QuantizingTier):
    """The same, around the durable tier: scans report payload sizes as the store knows them."""

    def __init__(self, inner: DurableTier, mode: QuantizeMode, layouts: Iterable[CacheLayout]) -> None:
        super().__init__(inner, mode, layouts)
        self._durable = inner

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[ChunkMeta | None]:
        metas = self._durable.get_many_into(keys, outs)
        return [self._expand(meta, out) for meta, out in zip(metas, outs, strict=True)]

    def delete_many(self, keys: Iterable[bytes]) -> None:
        self._durable.delete_many(keys)

    def refresh_capacity(self) -> None:
        self._durable.refresh_capacity()

    def scan_batches(self) -> Iterator[ScanBatch]:
        for batch in self._durable.scan_batches():
            words = batch.layout_ids.view("<u8").ravel()
            keep = np.ones(len(words), dtype=bool)
            payload = batch.payload_bytes.copy()
            for layout_id, plan in list(self._plans.items()):  # registrations and retirements change it
                rows = words == int.from_bytes(layout_id, "little")
                payload[rows & (payload == plan.stored_bytes)] = plan.payload_bytes
                # Written in another mode (or unquantized): not readable as this mode's bytes.
                keep &= ~(rows & (batch.payload_bytes != plan.stored_bytes))
            # Their namespace is kept: a config in their mode serves them again, so their record stays.
            other = [ScannedChunk(bytes(batch.keys[i]), bytes(batch.namespaces[i]), bytes(batch.layout_ids[i]), 0,
                                  int(batch.stored_bytes[i]), "format-version")
                     for i in np.flatnonzero(~keep).tolist()]
            yield replace(batch, payload_bytes=payload).select(keep, other)

    def scan(self) -> Iterator[ScannedChunk]:
        for batch in self.scan_batches():
            yield from batch.chunks()

    def put_namespace(self, digest: bytes, record: bytes) -> None:
        self._durable.put_namespace(digest, record)

    def keep_unserved(self, nbytes: int) -> None:
        self._durable.keep_unserved(nbytes)

    def namespaces(self) -> dict[bytes, bytes]:
        return self._durable.namespaces()

    def delete_namespaces(self, digests: Iterable[bytes]) -> None:
        self._durable.delete_namespaces(digests)

    def put_model(self, name: bytes, record: bytes) -> None:
        self._durable.put_model(name, record)

    def delete_models(self, names: Iterable[bytes]) -> None:
        self._durable.delete_models(names)

    def models(self) -> dict[bytes, bytes]:
        return self._durable.models()
