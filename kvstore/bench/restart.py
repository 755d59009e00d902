"""`kvstore bench restart`: what reopening a store costs, against how many bytes it holds.

For each case (the toy layout at 10K and 200K chunks, V4.1 at 10K chunks) the benchmark writes a
data directory through the store (prompts of 256 chunks, LMDB only), then reopens it twice, each
time in a fresh process (so no memory of the writer, or of the other cases, is reused):
- cold: the data file is fsynced and dropped from the page cache (`posix_fadvise DONTNEED`)
  first, then `reopen_cold_seconds` is the time to build the store, and `reopen_read_bytes`
  the `read_bytes` of `/proc/self/io` during it (bytes the process caused to be read from the
  device, page faults on the map included);
- warm: right after, with whatever the cold reopen left in the page cache;
- in the background: then reopened as `kvstore serve` does by default (`store.load_index =
  "background"`: answering at once, the index loaded on a thread), a prompt of 256 chunks never
  written looked up every millisecond while it loads and as often once it is loaded, a miss at its
  first chunk on both sides (the same work: `lookup_hit_chunks_while_loading` and
  `lookup_hit_chunks_ready` list the hit counts behind them): `background_open_seconds`
  (until the store answers, when `kvstore serve` listens; page cache warm, as for the warm
  reopen, which loads the whole index first), `lookup_p99_ms_while_loading`
  and `lookup_max_ms_while_loading` against `lookup_p99_ms_ready` (`lookup_loading_ratio`: what
  the loader costs a call), with `background_index_seconds` (null figures when the index loaded
  before the first Lookup ended; `lookup_p99_while_loading_note` says `n<100` where fewer Lookups
  came while it loaded); and once loaded, the case's first prompt, a 256-chunk hit
  (`full_hit_lookup_p99_ms_ready`, `full_hit_chunks`). Not that prompt while loading: its chunks
  are indexed in key order, about random, so its walk stopped at chunk 0-5 there.
`index_bytes_per_chunk` is the growth of the process's RssAnon over the cold reopen, per chunk;
`written_index_bytes_per_chunk` that of the (fresh) writing process while it stored them, read
once its tiers are closed: what chunks stored while the store runs cost (they are folded into the
cold arrays as they are written, store/cold.py); `written_tiers_open_bytes_per_chunk` the same
read before closing, with the write pages LMDB keeps for reuse while open (~2 MB, bounded by what
one transaction writes, not by the chunks held); `written_index_bytes_per_added_chunk` what each
toy chunk written past the small case's added (the part that grows with the chunks). All with the
key memo off (its remembered prompts are not the index), and RssAnon read after a collection and
`malloc_trim(0)`, so that memory the allocator holds free (the 114 KB values of each V4.1 commit,
once written) is not counted. The compiled kernels
(checksum, key chain) are loaded before the first reading in both: their cost does not depend on
the data.

Targets (issue #15): `reopen_read_bytes` <= 2% of `data_bytes`; the cold reopen of 10K V4.1
chunks <= 1.5 x that of 10K toy chunks (the restart does not depend on payload size; medians of
three cold reopens of each, taking turns: `cold_reopen_pair_seconds`; so `--v41-chunks` must equal
the small `--toy-chunks`, and the names, those of the default sizes, come with a `names_note` in a
run of other sizes);
`index_bytes_per_chunk` and `written_index_bytes_per_chunk` <= 200. Benchmarks print; tests never
assert on speed.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.flags import count, writable_dir
from kvstore.bench.names import names_note
from kvstore.config.policies import EVICTION_POLICIES
from kvstore.config.store import GiB, StoreConfig
from kvstore.errors import InvalidInput
from kvstore.keys.chunk_keys import Namespace
from kvstore.layout import ModelSpec, get_model
from kvstore.local_pool.redis_process import die_with
from kvstore.store import GlobalStore
from kvstore.tiers.factory import LMDB_SUBDIR
from kvstore.workload.report import SMALL_SAMPLE

CHUNKS_PER_PROMPT = 256
PAIRED_REOPENS = 3  # cold reopens of each side of the V4.1 / toy ratio, taking turns
PAYLOAD_VARIANTS = 16  # distinct payloads cycled through (compression is off: content is irrelevant)
TENANT = "bench"
REPLAY_MODE = "bounded"
LOOKUPS_READY = 200  # Lookups timed once the index is loaded (at least; as many as while it loaded)
# The sizes the case and target names carry (`toy_200k`); V4.1's is the small toy count's (checked).
NAMED_SIZES = {"toy_chunks[0]": ("10k", 10_000), "toy_chunks[1]": ("200k", 200_000)}
# Ten times the largest run written up (BENCHMARKS.md: a million toy chunks, 12.5 GB; 10M V4.1 chunks
# are 1.1 TB), checked as parsed: 1e11 chunks, unbounded, started being written.
MAX_CHUNKS = 10_000_000
MISS_SEED = 16  # the timed prompt's token ids: a prompt never written (the written ones come from seed 15)


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    chunks: int


def add_restart_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--toy-chunks", type=count(1, MAX_CHUNKS), nargs=2, default=(10_000, 200_000),
                   metavar=("SMALL", "LARGE"),
                   help="chunks of the two toy-layout cases (default 10000 200000)")
    p.add_argument("--v41-chunks", type=count(1, MAX_CHUNKS), default=10_000,
                   help="chunks of the V4.1 case: the small toy count (default 10000)")
    p.add_argument("--dir", type=writable_dir, default=None,
                   help="an existing directory to hold the data dirs (default: the system's temp dir)")
    p.add_argument("--eviction-policy", choices=EVICTION_POLICIES, default="s3fifo",
                   help="the store's eviction policy (its LMDB state is part of the index; default s3fifo)")


def _log(msg: str) -> None:
    print(f"bench restart: {msg}", file=sys.stderr, flush=True)


def _config(chunks: int, spec: ModelSpec, policy: str = "s3fifo") -> StoreConfig:
    # Room for every chunk in LMDB and none in memory: the reopen rebuilds the LMDB index only.
    capacity = max(GiB, 2 * chunks * (spec.layout.chunk_bytes + 8192))
    # key_memo_bytes=0: the memo's remembered prompts are not the index.
    return StoreConfig(device="cpu", device_capacity_bytes=0, dram_capacity_bytes=0,
                       lmdb_capacity_bytes=capacity, compression="none", lmdb_durability="nometasync",
                       eviction_policy=policy, key_memo_bytes=0)  # type: ignore[arg-type]  # one of EVICTION_POLICIES


def run_restart_bench(args: argparse.Namespace) -> dict[str, Any]:
    small, large = args.toy_chunks
    cases = [Case("toy_10k", "reference-toy-8", small), Case("toy_200k", "reference-toy-8", large),
             Case("v41_10k", "deepseek-v4.1-flash", args.v41_chunks)]
    if min(small, large, args.v41_chunks) < CHUNKS_PER_PROMPT:
        raise InvalidInput(f"restart: every case needs at least {CHUNKS_PER_PROMPT} chunks")
    if args.v41_chunks != small:  # the cold-reopen target divides one case's reopen by the other's
        raise InvalidInput(f"restart: --v41-chunks ({args.v41_chunks:,}) must equal the small --toy-chunks "
                           f"({small:,}): the V4.1 / toy reopen target compares as many chunks")
    out: dict[str, Any] = {"read_bytes_source": "/proc/self/io read_bytes", "eviction_policy": args.eviction_policy}
    ctx = multiprocessing.get_context("spawn")
    paired = ("toy_10k", "v41_10k")  # the two sides of the cold-reopen ratio
    kept: dict[str, tuple[Case, Path]] = {}
    try:  # --dir was an existing writable directory when parsed; one that still refuses is said so
        tmpdir = tempfile.TemporaryDirectory(prefix="kvstore-bench-restart-", dir=args.dir)
    except OSError as e:
        raise InvalidInput(f"restart: --dir {args.dir}: cannot make a directory there ({e.strerror or e})") from None
    with tmpdir as tmp:
        for case in cases:
            data_dir = Path(tmp) / case.name
            _log(f"{case.name}: writing {case.chunks} {case.model} chunks")
            with ctx.Pool(1, die_with, (os.getpid(),)) as pool:
                grown, grown_open = pool.apply(_fill, (str(data_dir), case, args.eviction_policy))
            figures: dict[str, Any] = {"chunks": case.chunks, "data_bytes": _data_bytes(data_dir),
                                       "written_index_bytes_per_chunk": grown / case.chunks,
                                       "written_tiers_open_bytes_per_chunk": grown_open / case.chunks}
            with ctx.Pool(1, die_with, (os.getpid(),)) as pool:
                cold = pool.apply(_reopen, (str(data_dir), case.model, case.chunks, True, args.eviction_policy))
            with ctx.Pool(1, die_with, (os.getpid(),)) as pool:
                warm = pool.apply(_reopen, (str(data_dir), case.model, case.chunks, False, args.eviction_policy))
            with ctx.Pool(1, die_with, (os.getpid(),)) as pool:
                figures.update(pool.apply(_lookups_while_loading,
                                          (str(data_dir), case.model, case.chunks, args.eviction_policy)))
            figures.update(reopen_cold_seconds=cold["seconds"], reopen_warm_seconds=warm["seconds"],
                           reopen_read_bytes=cold["read_bytes"],
                           reopen_read_fraction=cold["read_bytes"] / figures["data_bytes"],
                           index_bytes_per_chunk=cold["rss_anon_growth"] / case.chunks)
            _log(f"{case.name}: {figures}")
            out[case.name] = figures
            if case.name in paired:
                kept[case.name] = (case, data_dir)
            else:
                _remove(data_dir)
        # The ratio's two sides measured alike: cold reopens of the two cases taking turns, the
        # median of each (one reopen each, minutes apart, once read the machine's drift).
        pair: dict[str, list[float]] = {name: [] for name in paired}
        for _ in range(PAIRED_REOPENS):
            for name in paired:
                case, data_dir = kept[name]
                with ctx.Pool(1, die_with, (os.getpid(),)) as pool:
                    pair[name].append(pool.apply(_reopen, (str(data_dir), case.model, case.chunks, True,
                                                           args.eviction_policy))["seconds"])
        for _case, data_dir in kept.values():
            _remove(data_dir)
    ratio = statistics.median(pair["v41_10k"]) / statistics.median(pair["toy_10k"])
    out["cold_reopen_pair_seconds"] = pair
    out["v41_over_toy_cold_ratio"] = ratio
    # What each toy chunk written past the small case's added: the part that grows with the chunks.
    written = {c.name: out[c.name]["written_index_bytes_per_chunk"] * c.chunks for c in cases[:2]}
    out["written_index_bytes_per_added_chunk"] = (written["toy_200k"] - written["toy_10k"]) / max(large - small, 1)
    targets = [{"name": f"{c.name} reopen read <= 2% of data", "value": out[c.name]["reopen_read_fraction"],
                "target": "<= 0.02", "ok": out[c.name]["reopen_read_fraction"] <= 0.02} for c in cases]
    targets.append({"name": "cold reopen 10K V4.1 <= 1.5 x 10K toy", "value": ratio, "target": "<= 1.5",
                    "ok": ratio <= 1.5})
    targets += [{"name": f"{c.name} index <= 200 B/chunk", "value": out[c.name]["index_bytes_per_chunk"],
                 "target": "<= 200", "ok": out[c.name]["index_bytes_per_chunk"] <= 200} for c in cases]
    targets += [{"name": f"{c.name} index of chunks written while running <= 200 B/chunk",
                 "value": out[c.name]["written_index_bytes_per_chunk"], "target": "<= 200",
                 "ok": out[c.name]["written_index_bytes_per_chunk"] <= 200} for c in cases]
    out.update(names_note(args, NAMED_SIZES))
    out["targets"] = targets
    return out


def _fill(data_dir: str, case: Case, policy: str = "s3fifo") -> tuple[float, float]:
    """In a fresh process: write the case's chunks; the RssAnon the store grew by while writing them
    (what chunks stored since the start cost: folded into the cold arrays as they are written),
    read once its tiers are closed and once before. LMDB keeps the pages a write transaction
    dirtied, once freed, for the next one while it is open (up to ~2 MB here: bounded by a
    transaction's pages, not by the chunks held): the first figure is the index without them."""
    _load_kernels()
    spec = get_model(case.model)
    store = GlobalStore(_config(case.chunks, spec, policy), Path(data_dir), [spec])
    rss0 = _rss_anon()
    try:
        _write(store, spec, case.chunks)
        tiers_open = _rss_anon() - rss0
    finally:
        store.close()  # the tiers; the index (the store's arrays and policies) stays in memory
    return float(_rss_anon() - rss0), float(tiers_open)


def _write(store: GlobalStore, spec: ModelSpec, chunks: int) -> None:
    """Store `chunks` chunks in prompts of CHUNKS_PER_PROMPT (a function: nothing of the last prompt
    is left alive when the caller reads its memory)."""
    payloads, prompts = _written(spec, chunks)
    ns = store.namespace(TENANT, spec.name, REPLAY_MODE)
    written = 0
    for tokens in prompts:
        n = len(tokens) // spec.layout.chunk_tokens
        with store.begin_store(ns, store.tokens(ns, tokens)) as txn:
            for i in txn.chunks_needed:
                txn.write(i, payloads[(written + i) % PAYLOAD_VARIANTS])
            result = txn.commit()
        if result.stored_chunks != n:
            raise RuntimeError(f"the store kept {result.stored_chunks} of {n} chunks: {result}")
        written += n


def _written(spec: ModelSpec, chunks: int) -> tuple[list[memoryview], Iterator[np.ndarray]]:
    """The payloads a case cycles through and its prompts (token ids), the same on every call."""
    layout = spec.layout
    rng = np.random.default_rng(15)
    payloads = [memoryview(rng.integers(0, 256, layout.chunk_bytes, dtype=np.uint8).tobytes())
                for _ in range(PAYLOAD_VARIANTS)]

    def prompts() -> Iterator[np.ndarray]:
        for first in range(0, chunks, CHUNKS_PER_PROMPT):
            n = min(CHUNKS_PER_PROMPT, chunks - first)
            yield rng.integers(0, spec.vocab_size, n * layout.chunk_tokens, dtype=np.int64)

    return payloads, prompts()


def _data_bytes(data_dir: Path) -> int:
    return (data_dir / LMDB_SUBDIR / "data.mdb").stat().st_size


def _remove(data_dir: Path) -> None:
    for f in (data_dir / LMDB_SUBDIR).iterdir():
        f.unlink()


def _rss_anon() -> int:
    """RssAnon in bytes, after a collection and giving the allocator's free memory back."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)  # glibc's; other C libraries lack it
        if trim is not None:
            trim(0)
    return _proc_field("/proc/self/status", "RssAnon") * 1024


def _load_kernels() -> None:
    from kvstore.keys.chain import load_kernel as load_chain_kernel
    from kvstore.tiers.checksum import load_kernel as load_checksum_kernel

    load_checksum_kernel()
    load_chain_kernel()


def _proc_field(path: str, name: str) -> int:
    for line in Path(path).read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return int(value.split()[0])
    raise RuntimeError(f"{name} is not in {path}")


def _reopen(data_dir: str, model: str, chunks: int, cold: bool, policy: str = "s3fifo") -> dict[str, float]:
    """In a fresh process: time building the store over `data_dir` (after dropping its data file
    from the page cache when `cold`), with the bytes read and the anonymous memory it grew by."""
    _load_kernels()
    spec = get_model(model)
    if cold:
        fd = os.open(Path(data_dir) / LMDB_SUBDIR / "data.mdb", os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    rss0 = _rss_anon()
    read0 = _proc_field("/proc/self/io", "read_bytes")
    t0 = time.perf_counter()
    store = GlobalStore(_config(chunks, spec, policy), Path(data_dir), [spec])
    seconds = time.perf_counter() - t0
    read = _proc_field("/proc/self/io", "read_bytes") - read0
    rss = _rss_anon() - rss0
    found = store.stats().chunks
    store.close()
    if found != chunks:
        raise RuntimeError(f"the reopened store found {found} of {chunks} chunks")
    return {"seconds": seconds, "read_bytes": float(read), "rss_anon_growth": float(rss)}


def _lookups_while_loading(data_dir: str, model: str, chunks: int, policy: str = "s3fifo") -> dict[str, Any]:
    """In a fresh process, the page cache warm: reopen with the index loaded in the background
    (as `kvstore serve` does by default) and look up a prompt never written every millisecond while
    it loads, then as many times once it is loaded. What a restart costs the calls that come during
    it: the loader takes the store's lock a batch of chunks at a time, and its Python shares the
    interpreter with theirs. The timed prompt misses at its first chunk on both sides (one key
    hashed), so the two p99s time the same work: the case's first prompt did not, as its chunks are
    indexed in key order (about random), its walk stopping at chunk 0-5 while loading against a
    256-chunk hit once loaded. That prompt is timed once loaded only (`full_hit_*`), and checked."""
    _load_kernels()
    spec = get_model(model)
    t0 = time.perf_counter()
    store = GlobalStore(_config(chunks, spec, policy), Path(data_dir), [spec], load_index_in_background=True)
    open_seconds = time.perf_counter() - t0  # until it can answer: when `kvstore serve` listens
    try:
        ns = store.namespace(TENANT, spec.name, REPLAY_MODE)
        _, prompts = _written(spec, chunks)
        written = store.tokens(ns, next(prompts))
        unwritten = store.tokens(ns, np.random.default_rng(MISS_SEED).integers(
            0, spec.vocab_size, len(written), dtype=np.int64))
        loading: list[float] = []
        loading_hits: set[int] = set()
        while (state := store.index_state()) == "loading":
            t0 = time.perf_counter()
            loading_hits.add(store.lookup(ns, unwritten).hit_chunks)
            loading.append(time.perf_counter() - t0)
            time.sleep(0.001)
        if state != "ready":  # a load that failed never becomes ready: there is nothing to time
            raise RuntimeError(f"the reopened store's index did not load: {state}")
        ready, ready_hits = _timed_lookups(store, ns, unwritten, max(LOOKUPS_READY, len(loading)))
        full, full_hits = _timed_lookups(store, ns, written, LOOKUPS_READY)
        load_seconds = store.stats().index_load_seconds
    finally:
        store.close()
    if full_hits != {len(written) // spec.layout.chunk_tokens}:
        raise RuntimeError(f"the loaded index hit {sorted(full_hits)} chunks of the first prompt")
    if loading_hits and loading_hits != ready_hits:  # a ratio of unlike work is no ratio
        raise RuntimeError(f"the timed Lookups hit {sorted(loading_hits)} chunks while the index loaded, "
                           f"{sorted(ready_hits)} once loaded")
    return {"background_open_seconds": open_seconds, **_loading_figures(loading, ready, load_seconds),
            "lookup_hit_chunks_while_loading": sorted(loading_hits), "lookup_hit_chunks_ready": sorted(ready_hits),
            "full_hit_lookup_p99_ms_ready": float(np.percentile(np.array(full) * 1e3, 99)),
            "full_hit_chunks": sorted(full_hits)}


def _timed_lookups(store: GlobalStore, ns: Namespace, prompt: np.ndarray, n: int) -> tuple[list[float], set[int]]:
    """`n` Lookups of `prompt` a millisecond apart: their seconds, and the chunk counts they hit."""
    seconds: list[float] = []
    hits: set[int] = set()
    for _ in range(n):
        t0 = time.perf_counter()
        hits.add(store.lookup(ns, prompt).hit_chunks)
        seconds.append(time.perf_counter() - t0)
        time.sleep(0.001)
    return seconds, hits


def _loading_figures(loading: list[float], ready: list[float], load_seconds: float) -> dict[str, Any]:
    """The figures of Lookups timed (seconds) while the index loaded and once it was loaded. A p99
    of fewer than SMALL_SAMPLE Lookups is about their largest: it keeps its value and is marked
    `n<100`, as `bench workload` marks such a p99."""
    during = np.array(loading) * 1e3  # empty when the index loaded before the first Lookup ended
    p99_ready = float(np.percentile(np.array(ready) * 1e3, 99))
    p99_loading = float(np.percentile(during, 99)) if len(during) else None
    figures: dict[str, Any] = {
        "background_index_seconds": load_seconds, "lookups_while_loading": len(loading),
        "lookup_p99_ms_while_loading": p99_loading,
        "lookup_max_ms_while_loading": float(during.max()) if len(during) else None,
        "lookup_p99_ms_ready": p99_ready,
        "lookup_loading_ratio": p99_loading / p99_ready if p99_loading is not None else None}
    if 0 < len(loading) < SMALL_SAMPLE:
        figures["lookup_p99_while_loading_note"] = (f"n<{SMALL_SAMPLE}: {len(loading)} Lookups, so the p99 "
                                                    "and the ratio are about their largest")
    return figures
