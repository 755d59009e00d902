"""`kvstore bench pool` compares like with like: its raw redis-py SET does the pool's put's work and
no copy the pool's transport does not make. Real Redis (the harness's); the bench's timing is
replaced by counting what each operation allocates, which no other load on the machine changes."""

from __future__ import annotations

import argparse
import os
import tracemalloc
from collections.abc import Callable

import pytest

from kvstore.bench import pool as pool_bench
from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool.redis_process import RedisProcess

SNAPSHOT_BYTES = 1_351_680  # a V4.1 local snapshot: three parts of the default part size


def test_the_raw_set_allocates_what_the_pools_put_does(redis_server: RedisProcess,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The raw SET joined each part's header and payload into a new value in the timed window:
    # ~1.35 MB allocated per operation, against a few KB for the pool's put.
    peaks: dict[str, int] = {}

    def allocations(contenders: dict[str, Callable[[int], None]], nbytes: int, ops: int,
                    rounds: int) -> dict[str, float]:
        for fn in contenders.values():  # connections and first-use allocations out of the way
            fn(0)
        tracemalloc.start()
        try:
            for name, fn in contenders.items():
                for i in range(1, 4):
                    tracemalloc.reset_peak()
                    before = tracemalloc.get_traced_memory()[0]
                    fn(i)
                    peaks[name] = max(peaks.get(name, 0), tracemalloc.get_traced_memory()[1] - before)
        finally:
            tracemalloc.stop()
        return dict.fromkeys(contenders, 1.0)

    monkeypatch.setattr(pool_bench, "_median_gbps", allocations)
    args = argparse.Namespace(part_bytes=LocalPoolConfig().part_bytes, ops=4, rounds=1)
    payloads = [os.urandom(SNAPSHOT_BYTES) for _ in range(4)]
    pool_bench._bench_redis(redis_server.url, payloads, args)
    raw, pool = peaks["raw_redis_set_gbps"], peaks["redis_put_gbps"]
    assert raw < SNAPSHOT_BYTES // 8 and abs(raw - pool) < 64 * 1024, peaks


def test_the_raw_baselines_send_what_the_pool_does(redis_server: RedisProcess,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Each baseline must send Redis the same commands as the pool (a peek: each part's header and
    # length; a get: each part and part 0's PTTL; a put: the SETs in one MULTI/EXEC), else the ratio
    # compares unlike work.
    import redis

    r = redis.Redis.from_url(redis_server.url)
    sent: dict[str, dict[str, int]] = {}
    groups: list[set[str]] = []

    def commands() -> dict[str, int]:
        return {name.removeprefix("cmdstat_"): v["calls"] for name, v in r.info("commandstats").items()}

    def each_once(contenders: dict[str, Callable[[int], None]], ops: int, rounds: int) -> dict[str, float]:
        groups.append(set(contenders))
        for name, fn in contenders.items():
            fn(0)  # first use: a pool learns its part count here
            before = commands()
            fn(1)
            after = commands()
            sent[name] = {c: n - before.get(c, 0) for c, n in after.items() if n != before.get(c, 0)}
        return dict.fromkeys(contenders, 1.0)

    monkeypatch.setattr(pool_bench, "_median_seconds", each_once)
    args = argparse.Namespace(part_bytes=LocalPoolConfig().part_bytes, ops=2, rounds=1)
    pool_bench._bench_redis(redis_server.url, [os.urandom(SNAPSHOT_BYTES) for _ in range(2)], args)
    r.close()
    info = {"info": 1}  # this test's own INFO, between the two reads
    # Reads go as plain pipelines, as the pool's do since c207e37: a MULTI/EXEC around the raw ones
    # was work the pool does not do.
    assert sent["redis_peek"] == sent["raw_redis_peek"] == {"getrange": 3, "strlen": 3, **info}, sent
    assert sent["redis_get_gbps"] == sent["raw_redis_get_gbps"] == {"get": 3, "pttl": 1, **info}, sent
    assert sent["redis_put_gbps"] == sent["raw_redis_set_gbps"] == {"multi": 1, "set": 3, "exec": 1,
                                                                    **info}, sent
    # They take turns alone: a peek after a 1.35 MB get is slower whoever makes it.
    assert {"raw_redis_peek", "redis_peek"} in groups
