"""`kvstore bench store`: tiers, LMDB and lookup against raw baselines, in one run.

Baselines measured here, beside the figures they judge:
- memcpy: numpy copy of one chunk into a preallocated buffer (the DRAM tier's ceiling);
- raw LMDB: the tier's work in plain py-lmdb calls, on the same disk: a put reads the old value,
  builds the value and writes it and its index record in one transaction, in the durability mode
  kvstore ships (sync); a get reads a Load's message of chunks in one read transaction
  (`buffers=True`), checks each header and copy-sums the payload into the message's slots.
Targets (issue #2): DRAM get >= 0.5 x memcpy; LMDB tier put >= 0.7 x raw put and get >= 0.7 x
raw get; lookup of a 1,000,000-token prompt <= 25 ms (the median of 7, `lookup_1m_tokens_median_ms`;
`lookup_1m_tokens_ms` is the best); on disk <= 917 B/token. `--sections` picks
parts; the device section (store_device.py) runs where CUDA is present. Beside the lookup:
`lookup_1m_first_sight_ms`, a 1M-token prompt seen for the first time of which only the first
8,192 tokens are held (the walk hashes about as many keys as it hits), and `lookup_1m_miss_ms`.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch

from kvstore.bench.flags import count, writable_dir
from kvstore.bench.names import names_note
from kvstore.bench.sections import pick_sections
from kvstore.bench.store_device import device_figures
from kvstore.bench.timing import interleaved_best_rates
from kvstore.config.service import ServiceConfig
from kvstore.config.store import GiB, MiB, StoreConfig
from kvstore.errors import InvalidInput
from kvstore.layout import get_model
from kvstore.store import GlobalStore
from kvstore.tiers import value_format as vf
from kvstore.tiers.base import ChunkMeta
from kvstore.tiers.checksum import copy_words_sum64
from kvstore.tiers.compression import CODEC_NONE
from kvstore.tiers.factory import LMDB_SUBDIR, build_tiers
from kvstore.workload.payloads import realistic_chunk

SECTIONS = ("memory", "lmdb", "lookup", "device")
FIRST_SIGHT_HELD_TOKENS = 8192  # the first-sight prompt's held head
NAMED_SIZES = {"lookup_tokens": ("1m", 1_000_000)}  # the size the lookup figures' names carry
MAX_LOOKUP_TOKENS = ServiceConfig().max_lookup_tokens


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=count(1, 100_000), default=400, help="chunks per put/get pass (default 400)")
    p.add_argument("--lmdb-puts", type=count(1, 100_000), default=150,
                   help="synced LMDB puts per pass (default 150)")
    # At most what one Lookup may carry (service.max_lookup_tokens' default): its chunks are held in
    # DRAM, ~0.9 GB a million tokens, and 1e8 tokens asked for an 89 GB arena late, naming no flag.
    p.add_argument("--lookup-tokens", type=count(1, MAX_LOOKUP_TOKENS), default=NAMED_SIZES["lookup_tokens"][1],
                   help=f"prompt length for the lookup, {FIRST_SIGHT_HELD_TOKENS:,} to {MAX_LOOKUP_TOKENS:,}")
    p.add_argument("--dir", type=writable_dir, default=None,
                   help="an existing directory to hold the LMDB files (default: the system's temp dir)")
    p.add_argument("--sections", default=None, metavar="S,S",
                   help=f"parts to run, of {','.join(SECTIONS)} (default: all; device only where CUDA is present)")


def _log(msg: str) -> None:
    print(f"bench store: {msg}", file=sys.stderr, flush=True)


def run_store_bench(args: argparse.Namespace) -> dict[str, Any]:
    sections = pick_sections("store", args.sections, SECTIONS,
                             [s for s in SECTIONS if s != "device" or torch.cuda.is_available()])
    if "lookup" in sections and args.lookup_tokens < FIRST_SIGHT_HELD_TOKENS:
        raise InvalidInput(f"store: --lookup-tokens must be at least {FIRST_SIGHT_HELD_TOKENS} (the first-sight "
                           f"lookup holds that many tokens of its prompt), not {args.lookup_tokens}")
    spec = get_model("deepseek-v4.1-flash")
    layout = spec.layout
    payload = realistic_chunk(layout, seed=1)
    nbytes = len(payload)
    targets: list[dict[str, Any]] = []
    out: dict[str, Any] = {"chunk_bytes": nbytes, "sections": sections}
    try:  # --dir was an existing writable directory when parsed; one that still refuses is said so
        tmpdir = tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=args.dir)
    except OSError as e:
        raise InvalidInput(f"store: --dir {args.dir}: cannot make a directory there ({e.strerror or e})") from None
    with tmpdir as tmp:
        root = Path(tmp)
        if "memory" in sections:
            out.update(_memory_figures(root, layout, payload, args.chunks))
            ratio = out["dram_get_gbps"] / out["memcpy_gbps"]
            targets.append(_target("dram_get >= 0.5 x memcpy", ratio, ">= 0.5", 0.5))
        if "lmdb" in sections:
            out.update(_lmdb_figures(root, layout, payload, args.lmdb_puts))
            targets += [
                _target("lmdb put >= 0.7 x raw put", out["lmdb_put_gbps"] / out["raw_lmdb_put_gbps"], ">= 0.7", 0.7),
                _target("lmdb get >= 0.7 x raw get", out["lmdb_get_gbps"] / out["raw_lmdb_get_gbps"], ">= 0.7", 0.7),
                {"name": "on disk <= 917 B/token", "value": out["lmdb_bytes_per_token"], "target": "<= 917",
                 "ok": out["lmdb_bytes_per_token"] <= 917.0},
            ]
        if "lookup" in sections:
            out.update(_lookup_figure(root, spec, payload, args.lookup_tokens))
            out.update(names_note(args, NAMED_SIZES))
            # Judged on the median of the samples: the best one is the figure a shared machine
            # disturbs least, but a target is what a Lookup usually takes.
            median = out["lookup_1m_tokens_median_ms"]
            targets.append({"name": "lookup 1M tokens (median) <= 25 ms", "value": median, "target": "<= 25",
                            "ok": median <= 25.0})
    if "device" in sections:
        device = device_figures(layout, payload, args.chunks, large=(get_model("dense-gqa-32l").layout, 64))
        targets += device.pop("device_targets")
        out.update(device)
    out["targets"] = targets
    return out


def _target(name: str, ratio: float, text: str, floor: float) -> dict[str, Any]:
    return {"name": name, "value": ratio, "target": text, "ok": ratio >= floor}


def _keys(n: int, salt: bytes) -> list[bytes]:
    return [hashlib.sha256(salt + i.to_bytes(8, "little")).digest() for i in range(n)]


def _message_batches(keys: list[bytes], slots: list[memoryview]) -> list[tuple[list[bytes], list[memoryview]]]:
    """`keys` in stream messages of `len(slots)` chunks, each with the slots its chunks go to."""
    step = len(slots)
    return [(keys[i : i + step], slots[: len(keys[i : i + step])]) for i in range(0, len(keys), step)]


def _memory_figures(root: Path, layout: Any, payload: bytes, n: int) -> dict[str, float]:
    _log(f"memcpy and DRAM tier, {n} chunks of {len(payload):,} B")
    # The baseline copies n *distinct* chunks, the working set the tier reads: copying one
    # cache-resident chunk over and over would measure the CPU cache, not memory.
    src = np.tile(np.frombuffer(payload, dtype=np.uint8), (n, 1))  # [n, chunk_bytes]
    dst = np.empty(len(payload), dtype=np.uint8)

    def memcpy() -> int:
        for i in range(n):
            np.copyto(dst, src[i])
        return n * len(payload)

    cfg = StoreConfig(device="cpu", device_capacity_bytes=0, dram_capacity_bytes=(n + 8) * 128 * 1024,
                      lmdb_capacity_bytes=64 * MiB)
    _device, dram, lmdb_tier = build_tiers(cfg, root / "mem", [layout])
    keys = _keys(n, b"dram")
    meta = ChunkMeta(b"\x00" * 32, layout.layout_id, b"\x00" * (layout.chunk_tokens * 4))
    view = memoryview(payload)
    out_buf = memoryview(bytearray(len(payload)))

    def dram_clear() -> None:  # untimed before each put pass: the figure is of puts, not deletes
        for k in keys:
            dram.delete(k)

    def dram_put() -> int:
        for k in keys:
            dram.put(k, view, meta)
        return n * len(payload)

    def dram_get() -> int:
        for k in keys:
            dram.get_into(k, out_buf)
        return n * len(payload)

    # Taking turns, as every pair compared here: the machine is shared and drifts.
    figures = interleaved_best_rates({"memcpy_gbps": memcpy, "dram_put_gbps": dram_put, "dram_get_gbps": dram_get},
                                     rotate=True, prepare={"dram_put_gbps": dram_clear})
    assert bytes(out_buf) == payload
    dram.close()
    lmdb_tier.close()
    return figures


def _lmdb_figures(root: Path, layout: Any, payload: bytes, n: int) -> dict[str, Any]:
    _log(f"raw LMDB and the LMDB tier, {n} synced puts of {len(payload):,} B")
    raw_env = lmdb.open(str(root / "raw"), map_size=4 * GiB, sync=True, metasync=True, writemap=False,
                        max_dbs=2)
    raw_index = raw_env.open_db(b"index")
    keys = _keys(n, b"raw")
    raw_metas = [ChunkMeta(b"\x00" * 32, layout.layout_id, i.to_bytes(4, "little") * layout.chunk_tokens)
                 for i in range(n)]
    scratch = memoryview(bytearray(vf.value_bytes(len(raw_metas[0].tokens), len(payload))))

    # The raw baselines do the tier's work in plain LMDB calls, so that the ratios measure what the
    # tier adds: a put reads the old value, builds the value (header, tokens, the payload copied and
    # summed) and writes it and its index record in one synced transaction; a get checks the
    # header and copies the payload out, summing it, and compares the sums.
    def raw_put() -> int:
        for k, m in zip(keys, raw_metas, strict=True):
            with raw_env.begin(write=True, buffers=True) as txn:
                txn.get(k)
                value = vf.build_value_into(scratch, m, CODEC_NONE, len(payload), payload)
                txn.put(k, value)
                txn.put(k, vf.index_record_of(value), db=raw_index)
        return n * len(payload)

    # Both gets read as a Load does (kvstore/service/servicer.py, `_stream_whole`): a stream
    # message's chunks (9 V4.1 chunks in 1 MiB) in one read transaction, into the slots of one
    # message buffer reused for the whole stream. Raw and tier read into the very same slots:
    # with a buffer per chunk (17 MB at n=150, out of cache) the raw side wrote more memory.
    per_message = max(1, ServiceConfig().stream_message_bytes // len(payload))
    message = memoryview(bytearray(per_message * len(payload)))
    slots = [message[i * len(payload) : (i + 1) * len(payload)] for i in range(per_message)]
    raw_batches = _message_batches(keys, slots)

    def raw_get() -> int:
        for ks, outs in raw_batches:
            with raw_env.begin(buffers=True) as txn:
                for k, out in zip(ks, outs, strict=True):
                    value = txn.get(k)
                    assert value is not None
                    _codec, _n, _layout, _ns, raw_size, _stored, psum, po = vf.check_header(value)
                    assert copy_words_sum64(value, po, raw_size >> 3, out) == psum
        return n * len(payload)

    cfg = StoreConfig(device="cpu", device_capacity_bytes=0, dram_capacity_bytes=0,
                      lmdb_capacity_bytes=4 * GiB, lmdb_durability="sync")
    _device, _dram, tier = build_tiers(cfg, root / "tier", [layout])
    tkeys = _keys(n, b"tier")
    metas = [ChunkMeta(b"\x00" * 32, layout.layout_id, i.to_bytes(4, "little") * layout.chunk_tokens)
             for i in range(n)]
    view = memoryview(payload)
    out_buf = memoryview(bytearray(len(payload)))

    def tier_put() -> int:
        for k, m in zip(tkeys, metas, strict=True):
            tier.put(k, view, m)
        return n * len(payload)

    # A message's chunks through the call a Load makes for those only LMDB holds (`get_many_into`:
    # one read transaction), into the slots the raw get fills. `get_into` (a transaction per
    # chunk) is reported beside it, timed in turns of its own: in the message gets' turns it read the
    # tier's values a second time each turn, leaving them in cache for the tier's get (a ratio of
    # 1.24 to the raw get, against 0.87 without it).
    tier_batches = _message_batches(tkeys, slots)

    def tier_get() -> int:
        for ks, outs in tier_batches:
            assert None not in tier.get_many_into(ks, outs)
        return n * len(payload)

    def tier_get_single() -> int:
        for k in tkeys:
            assert tier.get_into(k, out_buf) is not None
        return n * len(payload)

    figures: dict[str, Any] = {
        **interleaved_best_rates({"raw_lmdb_put_gbps": raw_put, "lmdb_put_gbps": tier_put}, repeats=2, rotate=True),
        **interleaved_best_rates({"raw_lmdb_get_gbps": raw_get, "lmdb_get_gbps": tier_get}, rotate=True),
        **interleaved_best_rates({"lmdb_get_single_gbps": tier_get_single}),
        "checksum_kernel": tier.checksum_kernel,
    }
    assert bytes(out_buf) == payload and all(bytes(b) == payload for b in slots)
    tier.close()
    raw_env.close()
    figures["lmdb_bytes_per_token"] = _on_disk_bytes_per_token(root / "ondisk", layout, payload, n, metas)
    return figures


def _on_disk_bytes_per_token(path: Path, layout: Any, payload: bytes, n: int, metas: list[ChunkMeta]) -> float:
    """Fill a fresh tier once (no overwrites, whose freed pages would count) and measure it."""
    cfg = StoreConfig(device="cpu", device_capacity_bytes=0, dram_capacity_bytes=0,
                      lmdb_capacity_bytes=4 * GiB, lmdb_durability="async")
    _device, _dram, tier = build_tiers(cfg, path, [layout])
    for k, m in zip(_keys(n, b"disk"), metas, strict=True):
        tier.put(k, memoryview(payload), m)
    tier.close()
    return _on_disk_bytes(path / LMDB_SUBDIR) / (n * layout.chunk_tokens)


def _on_disk_bytes(path: Path) -> int:
    """Pages LMDB has handed out (the file's used part), not its preallocated map size."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8)
    try:
        info, psize = env.info(), env.stat()["psize"]
        return int((info["last_pgno"] + 1) * psize)
    finally:
        env.close()


def _lookup_figure(root: Path, spec: Any, payload: bytes, n_tokens: int) -> dict[str, float]:
    layout = spec.layout
    n_chunks = n_tokens // layout.chunk_tokens
    _log(f"storing {n_chunks:,} chunks ({n_chunks * len(payload) / 1e9:.2f} GB) in DRAM for the lookup")
    # key_memo_bytes=0: every lookup hashes all its keys, as a prompt's first lookup does (the
    # memo would answer this loop's repeats from memory; see kvstore/keys/memo.py).
    cfg = StoreConfig(device="cpu", device_capacity_bytes=0,
                      dram_capacity_bytes=(n_chunks + 16) * 114_688, lmdb_capacity_bytes=64 * MiB,
                      write_policy="write-back", key_memo_bytes=0)
    store = GlobalStore(cfg, root / "lookup", [spec])
    ns = store.namespace("bench", spec.name, "bounded")
    tokens = np.random.default_rng(7).integers(0, spec.vocab_size, n_chunks * layout.chunk_tokens)
    tokens = tokens.astype("<u4")
    view = memoryview(payload)
    with store.begin_store(ns, tokens) as txn:
        for i in txn.chunks_needed:
            txn.write(i, view)
        res = txn.commit()
    assert res.stored_chunks == n_chunks, res
    samples = []
    for _ in range(7):
        t0 = time.perf_counter()
        look = store.lookup(ns, tokens)
        samples.append((time.perf_counter() - t0) * 1e3)
        assert look.hit_chunks == n_chunks
    store.close()
    return {"lookup_1m_tokens_ms": min(samples), "lookup_1m_tokens_median_ms": statistics.median(samples),
            **_first_sight_figures(root, spec, payload, n_tokens)}


def _first_sight_figures(root: Path, spec: Any, payload: bytes, n_tokens: int) -> dict[str, float]:
    """A prompt of `n_tokens` seen for the first time (the key memo on, as served) of which only the
    first 8,192 tokens are held, each sample a new tail; and one that misses from its first chunk."""
    layout = spec.layout
    head = FIRST_SIGHT_HELD_TOKENS // layout.chunk_tokens
    cfg = StoreConfig(device="cpu", device_capacity_bytes=0, dram_capacity_bytes=(head + 16) * 114_688,
                      lmdb_capacity_bytes=64 * MiB, write_policy="write-back")
    store = GlobalStore(cfg, root / "first-sight", [spec])
    ns = store.namespace("bench", spec.name, "bounded")
    rng = np.random.default_rng(8)
    n = n_tokens // layout.chunk_tokens * layout.chunk_tokens
    prompt = rng.integers(0, spec.vocab_size, n).astype("<u4")
    with store.begin_store(ns, prompt[: head * layout.chunk_tokens]) as txn:
        for i in txn.chunks_needed:
            txn.write(i, memoryview(payload))
        txn.commit()
    first, miss = [], []
    for _ in range(7):
        prompt[head * layout.chunk_tokens :] = rng.integers(0, spec.vocab_size, n - head * layout.chunk_tokens)
        t0 = time.perf_counter()
        look = store.lookup(ns, prompt)
        first.append((time.perf_counter() - t0) * 1e3)
        assert look.hit_chunks == head, look
        fresh = rng.integers(0, spec.vocab_size, n).astype("<u4")
        t0 = time.perf_counter()
        store.lookup(ns, fresh)
        miss.append((time.perf_counter() - t0) * 1e3)
    store.close()
    return {"lookup_1m_first_sight_ms": min(first), "lookup_1m_miss_ms": min(miss)}
