"""`kvstore bench pool`: the local-state pool against its raw baselines, in one run.

- Redis backend put/get of V4.1 local snapshots (1,351,680 B) against raw redis-py `SET PX` /
  `GET` (and the first part's `PTTL`, as the pool's get asks) of the same bytes on the same
  server, over the same kind of connection, sent as the pool sends them: a put's SETs in one
  MULTI/EXEC, a get's GETs in one plain pipeline. The server is
  started by the benchmark (as the test harness does: loopback, free port, nothing persisted)
  unless `--redis-url` names one.
- Redis backend peek (a Lookup's presence check: each part's header and length, no payload)
  against the same GETRANGE/STRLEN pipeline in raw redis-py, checked alike, the two alone in
  their rotation; `redis_get_us`, the get's median from its own rotation, for what a Lookup no
  longer moves.
- Embedded pool get against memcpy (a numpy copy into a preallocated buffer). A hit of the
  embedded pool is a zero-copy view, so `embedded_get_gbps` times the get *plus* copying the view
  into the caller's preallocated buffer, the copy any consumer makes; the bare get is reported as
  `embedded_get_us`.

Contenders take turns operation by operation and each figure comes from the median time of one
operation: on a shared machine load from other processes then falls on every contender alike,
and the median ignores the operations it stretched. Targets: Redis backend >= 0.8 x raw for put,
get and peek; embedded get >= 0.5 x memcpy. This module knows nothing about how figures are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis

from kvstore.bench.flags import count
from kvstore.config.local_pool import LocalPoolConfig, redis_url_problem
from kvstore.errors import ConfigError, InvalidInput
from kvstore.layout import MAX_ENGINE_SNAPSHOT_BYTES
from kvstore.local_pool.embedded import EmbeddedPool
from kvstore.local_pool.factory import build_local_pool
from kvstore.local_pool.redis_process import RedisProcess
from kvstore.local_pool.snapshot_format import (
    HEADER,
    PART_HEADER,
    SnapshotHeader,
    check_parts,
    decode_parts,
    encode_parts,
)

V41_SNAPSHOT_BYTES = 1_351_680
LAYOUT = b"benchlay"
TTL_SECONDS = 300.0


class _Ttl:
    """A fixed TTL; the benchmark measures bytes, not policy."""

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        return TTL_SECONDS

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        return None

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"kind": "fixed", "ttl_seconds": TTL_SECONDS}


def _redis_url(text: str) -> str:
    """A single Redis node's URL, checked as parsed: redis-py raised a bare ValueError for a port past
    65535 once the payloads were made, and '' was taken for the flag left out (a Redis started)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave the flag out to start a Redis on loopback)")
    if not text.startswith(("redis://", "unix://")):
        raise argparse.ArgumentTypeError(f"{text}: the raw baseline needs a single node (redis:// or unix://)")
    problem = redis_url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text} {problem}")
    return text


def add_pool_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", type=_redis_url, default=None,
                   help="a running Redis (redis:// or unix://); default: start one on loopback")
    p.add_argument("--snapshot-bytes", type=count(1, MAX_ENGINE_SNAPSHOT_BYTES), default=V41_SNAPSHOT_BYTES,
                   help="bytes per snapshot (default: one DeepSeek-V4.1-Flash local snapshot)")
    p.add_argument("--part-bytes", type=int, default=LocalPoolConfig().part_bytes,
                   help="pool part size (default: the config default)")
    p.add_argument("--snapshots", type=count(1, 4096), default=16, help="distinct snapshots cycled through")
    p.add_argument("--ops", type=count(1, 1_000_000), default=16, help="operations per contender per round")
    p.add_argument("--rounds", type=count(1, 10_000), default=10, help="rounds of --ops operations per contender")


def run_pool_bench(args: argparse.Namespace) -> dict[str, Any]:
    try:  # the floor the pool's own config sets, checked before a server starts
        LocalPoolConfig(part_bytes=args.part_bytes).validate("local_pool")
    except ConfigError as e:
        raise InvalidInput(f"pool: --part-bytes {e.problem}, not {args.part_bytes}") from None
    n, k = args.snapshot_bytes, args.snapshots
    payloads = [os.urandom(n) for _ in range(k)]
    # Built before the try and started inside it: a SIGTERM while the server starts still removes
    # its directory.
    server = None if args.redis_url else RedisProcess()
    try:
        url = server.start().url if server is not None else args.redis_url
        result = _bench_redis(url, payloads, args)
    finally:
        if server is not None:
            server.close()
    result.update(_bench_embedded(payloads, args))
    result["snapshot_bytes"] = n
    result["redis_put_vs_raw"] = result["redis_put_gbps"] / result["raw_redis_set_gbps"]
    result["redis_get_vs_raw"] = result["redis_get_gbps"] / result["raw_redis_get_gbps"]
    result["embedded_get_vs_memcpy"] = result["embedded_get_gbps"] / result["memcpy_gbps"]
    result["redis_peek_vs_raw"] = result["raw_redis_peek_us"] / result["redis_peek_us"]
    result["targets"] = [
        _target("redis put / raw redis-py SET PX of the same parts", result["redis_put_vs_raw"], 0.8),
        _target("redis get / raw redis-py GET of the same parts, checked and joined", result["redis_get_vs_raw"], 0.8),
        _target("redis peek (a Lookup's) / raw redis-py GETRANGE+STRLEN of the same parts, checked",
                result["redis_peek_vs_raw"], 0.8),
        _target("embedded get / memcpy", result["embedded_get_vs_memcpy"], 0.5),
    ]
    return result


def _target(name: str, value: float, target: float) -> dict[str, Any]:
    return {"name": name, "value": value, "target": f">= {target}", "ok": value >= target}


def _median_gbps(
    contenders: dict[str, Callable[[int], None]], nbytes: int, ops: int, rounds: int,
) -> dict[str, float]:
    """GB/s of each contender from the median time of one operation; `fn(i)` moves one snapshot."""
    return {name: nbytes / t / 1e9 for name, t in _median_seconds(contenders, ops, rounds).items()}


def _median_seconds(contenders: dict[str, Callable[[int], None]], ops: int, rounds: int) -> dict[str, float]:
    """The median time of one operation of each contender. Contenders take turns op by op, so
    load from other processes falls on all of them alike, and the median ignores the ops that
    such load stretched."""
    for fn in contenders.values():  # warm-up: connections, allocator, caches
        for i in range(min(ops, 4)):
            fn(i)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(ops * rounds):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn(i)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _bench_redis(url: str, payloads: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    k, n = len(payloads), len(payloads[0])
    cfg = LocalPoolConfig(url=url, part_bytes=args.part_bytes, socket_timeout_seconds=10.0,
                          connect_timeout_seconds=10.0, call_budget_seconds=30.0, key_prefix="kvsbench")
    pool = build_local_pool(cfg, _Ttl())
    raw = redis.Redis.from_url(url, socket_timeout=10.0)
    ns = [i.to_bytes(32, "big") for i in range(k)]
    boundary = b"\x01" * 32
    ttl_ms = int(TTL_SECONDS * 1000)
    # The raw baselines do the pool's work with plain redis-py calls, so that the ratios measure
    # what the pool adds: the snapshot cut into the same checksummed parts, all SET with their TTL
    # in one MULTI/EXEC; read back in one plain pipeline with the first part's PTTL, checked and
    # joined. Reads are plain pipelines because the pool's are (c207e37): a MULTI/EXEC around them
    # is work the pool no longer does, which flattered its ratios.
    raw_parts = [encode_parts(LAYOUT, 128, p, args.part_bytes) for p in payloads]
    raw_keys = [[f"kvsbench:raw:{i}:p{j}" for j in range(len(raw_parts[i]))] for i in range(k)]
    # redis-py takes one buffer a value, where the pool's transport sends a part's header and
    # payload as two. Joining them in the timed window was a 1.35 MB copy the pool never makes:
    # each part's payload is laid out behind room for its header once, here, and a SET writes
    # only the fresh header into place.
    raw_values = [[memoryview(bytearray(b"".join(part))) for part in parts] for parts in raw_parts]

    def pool_put(i: int) -> None:
        put = pool.put(ns[i % k], boundary, "bench", LAYOUT, 128, payloads[i % k])
        assert put.written, put

    def pool_get(i: int) -> None:
        got = pool.get(ns[i % k], boundary, "bench", LAYOUT)
        assert got.payload is not None and got.payload.nbytes == n, got.miss_reason

    def raw_set(i: int) -> None:
        parts = encode_parts(LAYOUT, 128, payloads[i % k], args.part_bytes)
        pipe = raw.pipeline(transaction=True)
        for key, (head, _payload), value in zip(raw_keys[i % k], parts, raw_values[i % k], strict=True):
            value[: len(head)] = head
            pipe.set(key, value, px=ttl_ms)
        pipe.execute()

    def raw_get(i: int) -> None:
        pipe = raw.pipeline(transaction=False)
        for key in raw_keys[i % k]:
            pipe.get(key)
        pipe.pttl(raw_keys[i % k][0])  # the pool's get asks what is left of the TTL too
        *parts, pttl = pipe.execute()
        value = decode_parts(SnapshotHeader.unpack(parts[0]), parts)
        assert len(value) == n and pttl > 0

    def pool_peek(i: int) -> None:
        got = pool.peek(ns[i % k], boundary, "bench", LAYOUT)
        assert got.hit, got.miss_reason

    def raw_peek(i: int) -> None:
        # What a Lookup asks of the pool, in plain redis-py: each part's header and its length in
        # one plain pipeline, the header parsed and the parts checked against it.
        pipe = raw.pipeline(transaction=False)
        for j, key in enumerate(raw_keys[i % k]):
            pipe.getrange(key, 0, (HEADER.size if j == 0 else PART_HEADER.size) - 1)
            pipe.strlen(key)
        replies = pipe.execute()
        header = SnapshotHeader.unpack(replies[0])
        check_parts(header, replies[2::2], replies[1::2])

    try:
        puts = _median_gbps({"raw_redis_set_gbps": raw_set, "redis_put_gbps": pool_put}, n, args.ops,
                          args.rounds)
        gets = _median_gbps({"raw_redis_get_gbps": raw_get, "redis_get_gbps": pool_get}, n, args.ops,
                          args.rounds)
        # The two peeks take turns alone: a peek right after a 1.35 MB get is slower whoever makes
        # it, and in one rotation with the get only one of them would follow it.
        peeks = {f"{name}_us": t * 1e6 for name, t in _median_seconds(
            {"raw_redis_peek": raw_peek, "redis_peek": pool_peek}, args.ops, args.rounds).items()}
        peeks["redis_get_us"] = n / gets["redis_get_gbps"] / 1e3
        stats = pool.stats()
        assert stats.skipped_writes == dict.fromkeys(stats.skipped_writes, 0), stats
    finally:
        raw.delete(*[key for keys in raw_keys for key in keys])
        for key in ns:
            pool.delete(key, boundary)
        pool.close()
        raw.close()
    parts = len(encode_parts(LAYOUT, 128, payloads[0], args.part_bytes))
    return {**puts, **gets, **peeks, "redis_parts_per_snapshot": parts}


def _bench_embedded(payloads: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    k, n = len(payloads), len(payloads[0])
    pool = EmbeddedPool(2 * k * (n + 4096), _Ttl())
    ns = [i.to_bytes(32, "big") for i in range(k)]
    boundary = b"\x02" * 32
    for i in range(k):
        assert pool.put(ns[i], boundary, "bench", LAYOUT, 128, payloads[i]).written
    # memcpy gets its own copies: copying the very buffer the pool's get just read would find it
    # in cache, and each side must cycle through k buffers of its own.
    sources = [np.frombuffer(p, dtype=np.uint8).copy() for p in payloads]  # [n] each
    dst = np.empty(n, dtype=np.uint8)  # the caller's preallocated buffer

    def get_into(i: int) -> None:
        got = pool.get(ns[i % k], boundary, "bench", LAYOUT)
        assert got.payload is not None
        np.copyto(dst, np.frombuffer(got.payload, dtype=np.uint8))

    def memcpy(i: int) -> None:
        np.copyto(dst, sources[i % k])

    ops = max(args.ops, k)
    best = _median_gbps({"memcpy_gbps": memcpy, "embedded_get_gbps": get_into}, n, ops, args.rounds)
    t0 = time.perf_counter()
    for i in range(ops):
        pool.get(ns[i % k], boundary, "bench", LAYOUT)
    best["embedded_get_us"] = (time.perf_counter() - t0) / ops * 1e6  # the bare get, no copy
    pool.close()
    return best
