"""Payload codecs for the LMDB tier: none, zstd over the whole payload, and zstd over split streams.

FP4 payloads compress poorly as raw bytes: a block-scaled gaussian fills the 16 FP4 codes almost
evenly (~3.8 bits of entropy per 4-bit code), while the scale bytes (E4M3 and UE8M0, one per 16 or
32 values) vary slowly and compress well. `zstd-split` therefore gathers the value bytes and the
scale bytes of a layout's segments into two streams and compresses each one only if it pays.
Measured (zstd level 3, stored/raw bytes) on V4.1 chunks quantized from gaussians through the
real codecs, with iid channels (kvstore.workload.payloads) and with log-normal per-channel scales:

    mode                 iid channels   scaled channels
    zstd (whole)         0.983          0.957
    zstd-split           0.947          0.919
      values stream      1.000          0.959
      scales stream      0.473          0.567
    auto                 1.000 (none)   1.000 (none)

Compressing costs ~150-500 us per 114 KB chunk and decompressing ~85-100 us, against ~4 us
for a raw copy out of the map, so savings of 2-8% do not pay on FP4 layouts (and the raw value
already fits 896 B/token of LMDB pages). bf16 rows (dense GQA) do pay: whole-payload zstd stores
gaussian bf16 at 0.78. `auto` measures the first few payloads of each layout and keeps a codec
only if it saves at least AUTO_MIN_SAVING;
every value records its own codec, so decisions can change between processes without harm.

The codec ids are part of the value format (value_format.py). This module knows layouts (for
the segment split) and zstd; it knows nothing about LMDB, keys or checksums.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import zstandard as zstd

from kvstore.layout import SCALE_KINDS, CacheLayout
from kvstore.tiers.value_format import ValueProblem

Mode = Literal["none", "zstd", "zstd-split", "auto"]
CODEC_NONE = 0
CODEC_ZSTD = 1
CODEC_SPLIT = 2

AUTO_MIN_SAVING = 0.10  # auto keeps a codec (or a split stream compressed) only if it saves >= 10%
AUTO_SAMPLES = 4  # payloads per layout measured before auto settles on a codec
SPLIT_MIN_SAVING = 0.01  # explicit zstd-split: a stream stays compressed if it saves >= 1%

# Split stored payload: stream flags (bit 0 values compressed, bit 1 scales compressed), then the
# stored length of the values stream; the scales stream is the rest.
_SPLIT_HEAD = struct.Struct("<BxxxI")


@dataclass(frozen=True)
class _Run:
    src_offset: int  # of the group inside the payload
    records: int
    record_bytes: int
    seg_offset: int  # inside one record
    seg_bytes: int
    dst_offset: int  # inside its stream


class SplitPlan:
    """Where each segment of a layout's chunk goes in the value and scale streams.

    Records of one group are contiguous, so each (group, segment) pair is one strided 2-D copy:
    16 numpy copies for a V4.1 chunk instead of 1,280 slice copies or a fancy-index gather.
    """

    def __init__(self, layout: CacheLayout) -> None:
        values: list[_Run] = []
        scales: list[_Run] = []
        offset = 0
        sizes = [0, 0]
        for g in layout.groups:
            records = layout.chunk_tokens // g.ratio
            seg_off = 0
            for s in g.segments:
                is_scale = s.kind in SCALE_KINDS
                run = _Run(offset, records, g.record_bytes, seg_off, s.nbytes, sizes[is_scale])
                (scales if is_scale else values).append(run)
                sizes[is_scale] += records * s.nbytes
                seg_off += s.nbytes
            offset += records * g.record_bytes
        assert offset == layout.chunk_bytes
        self.chunk_bytes = layout.chunk_bytes
        self.value_bytes, self.scale_bytes = sizes
        self._values = tuple(values)
        self._scales = tuple(scales)

    @staticmethod
    def _strided(arr: np.ndarray, r: _Run) -> np.ndarray:
        # (records, record_bytes) view of the group, narrowed to the segment's columns
        grp = arr[r.src_offset : r.src_offset + r.records * r.record_bytes].reshape(r.records, r.record_bytes)
        return grp[:, r.seg_offset : r.seg_offset + r.seg_bytes]

    def gather(self, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values = np.empty(self.value_bytes, dtype=np.uint8)
        scales = np.empty(self.scale_bytes, dtype=np.uint8)
        for runs, stream in ((self._values, values), (self._scales, scales)):
            for r in runs:
                dst = stream[r.dst_offset : r.dst_offset + r.records * r.seg_bytes]
                dst.reshape(r.records, r.seg_bytes)[...] = self._strided(payload, r)
        return values, scales

    def scatter(self, values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        for runs, stream in ((self._values, values), (self._scales, scales)):
            for r in runs:
                src = stream[r.dst_offset : r.dst_offset + r.records * r.seg_bytes]
                self._strided(out, r)[...] = src.reshape(r.records, r.seg_bytes)


@dataclass
class _AutoSamples:
    raw: int = 0
    stored: dict[int, int] = field(default_factory=lambda: {CODEC_ZSTD: 0, CODEC_SPLIT: 0})
    count: int = 0


class Codec:
    """Encodes payloads for storage and decodes them into caller buffers. Encoding reuses one
    zstd context and is called under the LMDB tier's write lock; decoding runs on every thread
    that reads (reads take no lock), each with a zstd context of its own: one context decoding on
    two threads at once corrupts its state."""

    def __init__(self, mode: Mode, level: int, layouts: dict[bytes, CacheLayout]) -> None:
        self.mode = mode
        self._cctx = zstd.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        self._local = threading.local()  # .dctx: this thread's decompressor
        self._layouts = layouts
        self._plans: dict[bytes, SplitPlan] = {}
        self._auto: dict[bytes, _AutoSamples] = {}
        self.decisions: dict[bytes, int] = {}  # layout id -> codec auto settled on

    def forget(self, layout_id: bytes) -> None:
        """Drop what was learnt for a layout no longer served (its split plan, `auto`'s samples and
        decision); under the LMDB tier's write lock, as encoding is."""
        self._plans.pop(layout_id, None)
        self._auto.pop(layout_id, None)
        self.decisions.pop(layout_id, None)

    # --- encoding ----------------------------------------------------------------------------
    def encode(self, payload: memoryview, layout_id: bytes) -> tuple[int, memoryview | bytes]:
        """(codec id, stored bytes). The stored form is never larger than the payload."""
        if self.mode == "none":
            return CODEC_NONE, payload
        if self.mode == "zstd":
            return self._zstd(payload)
        if self.mode == "zstd-split":
            return self._split(payload, layout_id, SPLIT_MIN_SAVING)
        return self._encode_auto(payload, layout_id)

    def _zstd(self, payload: memoryview, min_saving: float = 0.0) -> tuple[int, memoryview | bytes]:
        z = self._cctx.compress(payload)
        if len(z) < len(payload) * (1 - min_saving):
            return CODEC_ZSTD, z
        return CODEC_NONE, payload

    def _plan(self, layout_id: bytes, nbytes: int) -> SplitPlan | None:
        plan = self._plans.get(layout_id)
        if plan is None:
            layout = self._layouts.get(layout_id)
            if layout is None:
                return None
            plan = self._plans[layout_id] = SplitPlan(layout)
        return plan if plan.chunk_bytes == nbytes else None

    def _split(
        self, payload: memoryview, layout_id: bytes, min_saving: float
    ) -> tuple[int, memoryview | bytes]:
        plan = self._plan(layout_id, len(payload))
        if plan is None:  # a payload that is not one chunk of a known layout: whole-payload zstd
            return self._zstd(payload, min_saving)
        streams = plan.gather(np.frombuffer(payload, dtype=np.uint8))
        parts: list[bytes | memoryview] = []
        flags = 0
        for bit, s in enumerate(streams):
            raw = s.data
            z = self._cctx.compress(raw) if len(raw) else b""
            keep = len(raw) > 0 and len(z) <= len(raw) * (1 - min_saving)
            flags |= keep << bit
            parts.append(z if keep else raw)
        if not flags:
            return CODEC_NONE, payload
        stored = _SPLIT_HEAD.pack(flags, len(parts[0])) + b"".join(parts)
        if len(stored) >= len(payload):
            return CODEC_NONE, payload
        return CODEC_SPLIT, stored

    def _encode_auto(self, payload: memoryview, layout_id: bytes) -> tuple[int, memoryview | bytes]:
        decided = self.decisions.get(layout_id)
        if decided is not None:
            if decided == CODEC_NONE:
                return CODEC_NONE, payload
            if decided == CODEC_ZSTD:
                return self._zstd(payload, AUTO_MIN_SAVING)
            return self._split(payload, layout_id, AUTO_MIN_SAVING)
        # Sampling: try both, keep the better one for this payload if it pays, and remember sizes.
        samples = self._auto.setdefault(layout_id, _AutoSamples())
        tries = [self._zstd(payload), self._split(payload, layout_id, AUTO_MIN_SAVING)]
        samples.raw += len(payload)
        samples.count += 1
        for codec_id, (got, stored) in zip((CODEC_ZSTD, CODEC_SPLIT), tries, strict=True):
            samples.stored[codec_id] += len(stored) if got != CODEC_NONE else len(payload)
        if samples.count >= AUTO_SAMPLES:
            best = min(samples.stored, key=lambda c: samples.stored[c])
            pays = samples.stored[best] <= samples.raw * (1 - AUTO_MIN_SAVING)
            self.decisions[layout_id] = best if pays else CODEC_NONE
            del self._auto[layout_id]
        codec, stored = min(tries, key=lambda t: len(t[1]))
        if codec != CODEC_NONE and len(stored) <= len(payload) * (1 - AUTO_MIN_SAVING):
            return codec, stored
        return CODEC_NONE, payload

    # --- decoding ----------------------------------------------------------------------------
    def decode_into(self, codec: int, stored: memoryview, out: memoryview, layout_id: bytes) -> None:
        """Decode stored into out (exactly len(out) bytes); ValueProblem if that is impossible."""
        try:
            if codec == CODEC_NONE:
                if len(stored) != len(out):
                    raise ValueProblem("corrupt", "stored size differs from raw size")
                out[:] = stored
            elif codec == CODEC_ZSTD:
                self._unzstd_into(stored, out)
            elif codec == CODEC_SPLIT:
                self._unsplit_into(stored, out, layout_id)
            else:
                raise ValueProblem("format-version", f"unknown codec {codec}")
        except zstd.ZstdError as e:
            raise ValueProblem("corrupt", f"zstd: {e}") from None

    def _unzstd_into(self, stored: memoryview, out: memoryview) -> None:
        if zstd.frame_content_size(stored) != len(out):
            raise ValueProblem("corrupt", "zstd frame size differs from raw size")
        # Decompress straight into the caller's buffer: no intermediate bytes object.
        n = 0
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstd.ZstdDecompressor()
        with dctx.stream_reader(stored) as reader:
            while n < len(out):
                got = reader.readinto(out[n:])
                if not got:
                    break
                n += got
        if n != len(out):
            raise ValueProblem("corrupt", "zstd frame ended early")

    def _unsplit_into(self, stored: memoryview, out: memoryview, layout_id: bytes) -> None:
        plan = self._plan(layout_id, len(out))
        if plan is None:
            raise ValueProblem("layout", "split payload of a layout this tier does not know")
        if len(stored) < _SPLIT_HEAD.size:
            raise ValueProblem("corrupt", "split payload shorter than its header")
        flags, vlen = _SPLIT_HEAD.unpack_from(stored, 0)
        body = stored[_SPLIT_HEAD.size :]
        if vlen > len(body):
            raise ValueProblem("corrupt", "split stream lengths exceed the payload")
        streams: list[np.ndarray] = []
        parts = ((body[:vlen], plan.value_bytes), (body[vlen:], plan.scale_bytes))
        for bit, (part, size) in enumerate(parts):
            if flags >> bit & 1:
                buf = np.empty(size, dtype=np.uint8)
                self._unzstd_into(part, buf.data)
                streams.append(buf)
            elif len(part) != size:
                raise ValueProblem("corrupt", "raw split stream has the wrong size")
            else:
                streams.append(np.frombuffer(part, dtype=np.uint8))
        plan.scatter(streams[0], streams[1], np.frombuffer(out, dtype=np.uint8))
