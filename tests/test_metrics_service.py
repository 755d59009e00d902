"""Metrics through the real service: a gRPC server on port 0, its admin port on port 0, the Python
client, LMDB in a temp dir, the embedded pool or a real Redis. Each case (cold, warm, expired,
eviction, a corrupt entry, the pool down) is driven through the client and read back from a live
`/metrics` scrape."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client.sync_client import KvstoreClient
from kvstore.config import KvstoreConfig, LocalPoolConfig, StoreConfig
from kvstore.keys.chunk_keys import Namespace
from kvstore.service.app import App, build_app
from kvstore.service.server import KvstoreServer
from kvstore.tiers.factory import LMDB_SUBDIR
from replay.port import ReplayOutcome, ReplayParts, ReplayTicket
from tests.test_admin_workload import FakeClock
from tests.test_metrics import assert_valid_exposition

MODEL = "reference-toy-8"
CHUNK = 16
MiB = 1 << 20


def config(**store: Any) -> KvstoreConfig:
    base: dict[str, Any] = dict(device="cpu", chunk_tokens=CHUNK, device_capacity_bytes=1 * MiB,
                                dram_capacity_bytes=2 * MiB, lmdb_capacity_bytes=16 * MiB, page_bytes=4096,
                                compression="none", lmdb_durability="async")
    base.update(store)
    return KvstoreConfig(store=StoreConfig(**base))


class StandInCoordinator:
    """Rebuilds local state instantly with a snapshot of the right size (the real coordinator is
    in `replay/`; here only how its outcome is observed matters)."""

    def __init__(self, parts: ReplayParts) -> None:
        self.parts = parts

    def admit(self, ns: Namespace, tokens: np.ndarray, hit_tokens: int,
              boundary_key: bytes | None = None, deadline_seconds: float | None = None) -> ReplayTicket:
        return ReplayTicket(ns.tenant, hit_tokens)

    def resume_local(self, ns: Namespace, tokens: np.ndarray, hit_tokens: int,
                     deadline_seconds: float, ticket: ReplayTicket) -> ReplayOutcome:
        layout = self.parts.store.layout(ns)
        n = min(layout.local.window_tokens, hit_tokens)
        return ReplayOutcome(bytes(layout.local_snapshot_bytes), n, "replayed")

    def release(self, ticket: ReplayTicket) -> None:
        pass

    def queue_depth(self) -> int:
        return 0  # it never queues


@dataclass
class Running:
    app: App
    server: KvstoreServer
    client: KvstoreClient
    clock: FakeClock

    def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        assert self.server.admin is not None
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.server.admin.port}/metrics", timeout=10).read().decode()
        self.text = text
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def metric(self, name: str, **labels: str) -> float:
        return self.scrape().get((name, frozenset(labels.items())), 0.0)

    def stop(self) -> None:
        self.client.close()
        self.server.stop(0)
        self.app.close()


def start(tmp: Path, cfg: KvstoreConfig, clock: FakeClock | None = None, replay: bool = True,
          coordinator: Callable[[ReplayParts], Any] = StandInCoordinator) -> Running:
    clock = clock or FakeClock()
    app = build_app(cfg, tmp, clock=clock, coordinator_factory=coordinator if replay else None)
    clock.before_advance = app.flush_observers
    server = KvstoreServer(app, "127.0.0.1", 0, 0).start()
    client = KvstoreClient(f"127.0.0.1:{server.port}", timeout_seconds=20)
    return Running(app, server, client, clock)


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Running]:
    r = start(tmp_path, config())
    yield r
    r.stop()


def prompt(seed: int, chunks: int, extra: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, chunks * CHUNK + extra).astype("<u4")


def store(r: Running, tokens: np.ndarray, local: bool = True, session: str | None = None) -> None:
    lay = r.app.store.layout(r.app.store.namespace("default", MODEL, "bounded"))
    full = len(tokens) // CHUNK
    r.client.store(MODEL, tokens, [bytes([i % 251]) * lay.chunk_bytes for i in range(full)])
    if local:
        res = r.client.store_local(MODEL, tokens[: full * CHUNK], bytes(lay.local_snapshot_bytes), session=session)
        assert res.stored


def test_cold_warm_and_expired_move_their_counters(svc: Running) -> None:
    toks = prompt(1, 5)
    before = svc.scrape()
    assert svc.client.resume(MODEL, toks).case == "cold"
    assert svc.metric("kvstore_requests_total", method="resume", case="cold") == 1
    assert svc.metric("kvstore_lookup_tokens_total", tier="none", result="miss") >= len(toks)
    assert svc.metric("kvstore_local_state_total", outcome="absent") >= 1

    store(svc, toks)
    warm = svc.client.resume(MODEL, toks)
    assert warm.case == "warm" and warm.local_state == "hit"
    hit = sum(svc.metric("kvstore_lookup_tokens_total", tier=t, result="hit") for t in ("device", "dram", "lmdb"))
    assert hit == 5 * CHUNK
    assert svc.metric("kvstore_requests_total", method="resume", case="warm") == 1
    assert svc.metric("kvstore_local_state_total", outcome="hit") == 1
    assert svc.metric("kvstore_prefill_tokens_avoided_total") == 5 * CHUNK
    moved = sum(svc.metric("kvstore_bytes_moved_total", tier=t) for t in ("device", "dram", "lmdb"))
    assert moved == 5 * warm.chunk_bytes
    assert svc.metric("kvstore_local_bytes_moved_total") == len(warm.snapshot or b"")

    # The local snapshot outlives its TTL (the pool's clock is the app's): expired, and replayed.
    svc.clock.advance(svc.app.config.local_pool.ttl.ttl_seconds + 1)
    exp = svc.client.resume(MODEL, toks)
    assert exp.case == "expired" and exp.local_state == "replayed"
    assert svc.metric("kvstore_requests_total", method="resume", case="expired") == 1
    assert svc.metric("kvstore_local_state_total", outcome="replayed") == 1
    assert svc.metric("kvstore_replays_total", result="ok") == 1
    assert svc.metric("kvstore_replay_tokens_total") == exp.replay_tokens == 5 * CHUNK
    assert svc.metric("kvstore_rpc_seconds_count", method="Resume", code="OK") == 3
    assert svc.metric("kvstore_rpc_seconds_count", method="Store", code="OK") == 1
    assert before[("kvstore_requests_total", frozenset({("method", "resume"), ("case", "cold")}))] == 0
    assert_valid_exposition(svc.text)


def test_the_clients_bills_price_a_replay_as_the_services_ledger_does(svc: Running) -> None:
    # The client's bills read replay_flops 0.0 for a replayed Resume; the service's had them.
    toks = prompt(7, 4)
    store(svc, toks)
    svc.clock.advance(svc.app.config.local_pool.ttl.ttl_seconds + 1)
    exp = svc.client.resume(MODEL, toks)
    assert exp.local_state == "replayed" and exp.bills.replay_tokens > 0
    per_token = svc.app.store.model(MODEL).prefill_flops_per_token
    assert per_token > 0
    assert exp.bills.replay_flops == pytest.approx(exp.bills.replay_tokens * per_token, rel=1e-12)
    assert exp.planned_bills.replay_flops == pytest.approx(exp.planned_bills.replay_tokens * per_token, rel=1e-12)
    assert svc.server.admin is not None
    import json

    st = json.load(urllib.request.urlopen(f"http://127.0.0.1:{svc.server.admin.port}/api/stats", timeout=10))
    assert st["totals"]["replay"]["flops"] == pytest.approx(exp.bills.replay_flops, rel=1e-12)


def test_a_lookup_counts_without_moving_bytes_and_bad_input_counts_its_code(svc: Running) -> None:
    toks = prompt(2, 3)
    store(svc, toks, local=False)
    look = svc.client.lookup(MODEL, toks)
    assert look.hit_tokens == 3 * CHUNK and look.local_state == "expired"
    assert svc.metric("kvstore_requests_total", method="lookup", case="expired") == 1
    assert sum(svc.metric("kvstore_bytes_moved_total", tier=t) for t in ("device", "dram", "lmdb")) == 0
    with pytest.raises(Exception, match="INVALID_ARGUMENT"):
        svc.client.lookup("no-such-model", toks)
    assert svc.metric("kvstore_rpc_seconds_count", method="Lookup", code="INVALID_ARGUMENT") == 1


def test_eviction_under_pressure(tmp_path: Path) -> None:
    r = start(tmp_path, config(device_capacity_bytes=64 * 1024, dram_capacity_bytes=128 * 1024))
    try:
        for seed in range(12):
            store(r, prompt(100 + seed, 6), local=False)
        dev = r.metric("kvstore_evictions_total", tier="device", reason="capacity")
        dram = r.metric("kvstore_evictions_total", tier="dram", reason="capacity")
        st = r.app.store.stats()
        assert dev > 0 and dram > 0
        assert dev + dram == sum(st.evictions_by_reason.values())
        assert r.metric("kvstore_tier_demotions_total", tier="dram") > 0
        assert r.metric("kvstore_tier_bytes", tier="device") <= 64 * 1024
        assert r.metric("kvstore_tier_capacity_bytes", tier="device") == 64 * 1024
        # The oldest prompts now come from the SSD tier, and the metrics say so.
        r.client.resume(MODEL, prompt(100, 6))
        assert r.metric("kvstore_lookup_tokens_total", tier="lmdb", result="hit") > 0
    finally:
        r.stop()


def test_a_corrupt_entry_is_counted(tmp_path: Path) -> None:
    cfg = config(device_capacity_bytes=0, dram_capacity_bytes=0, promote_on_hit=False)
    toks = prompt(3, 4)
    r = start(tmp_path, cfg)
    store(r, toks, local=False)
    r.stop()
    # Flip a payload bit in every stored chunk value while the service is down.
    env = lmdb.open(str(tmp_path / LMDB_SUBDIR), max_dbs=4, subdir=True)
    db = env.open_db(b"chunks")
    with env.begin(write=True, db=db) as txn:
        for k, v in list(txn.cursor()):
            b = bytearray(v)
            b[-100] ^= 0x10
            txn.put(k, bytes(b))
    env.close()
    r = start(tmp_path, cfg)
    try:
        assert r.client.lookup(MODEL, toks).hit_tokens == 4 * CHUNK  # restart-warm: the index is the database
        res = r.client.resume(MODEL, toks)
        assert res.hit_tokens == 0  # the first chunk failed verification: the stream ended before it
        assert r.metric("kvstore_corrupt_reads_total") >= 1
        assert r.metric("kvstore_tier_corrupt_total", tier="lmdb") >= 1
        assert r.client.lookup(MODEL, toks).hit_tokens == 0
    finally:
        r.stop()


def test_pool_down_is_a_local_miss_that_the_metrics_show(tmp_path: Path, redis_server: Any) -> None:
    cfg = config()
    cfg = replace(cfg, local_pool=LocalPoolConfig(url=redis_server.url, breaker_failures=2, breaker_reset_seconds=60,
                                                  socket_timeout_seconds=0.2, connect_timeout_seconds=0.2, retries=0))
    r = start(tmp_path, cfg)
    try:
        toks = prompt(4, 3)
        store(r, toks)
        assert r.client.resume(MODEL, toks).local_state == "hit"
        assert r.metric("kvstore_pool_up") == 1
        redis_server.kill()
        for _ in range(3):
            res = r.client.resume(MODEL, toks)
            assert res.case == "expired"  # never an error to the engine
        assert r.metric("kvstore_pool_up") == 0
        assert r.metric("kvstore_pool_errors_total") >= 2
        assert r.metric("kvstore_pool_breaker_state", state="open") == 1
        assert r.metric("kvstore_pool_misses_total", reason="breaker_open") >= 1
        assert r.metric("kvstore_requests_total", method="resume", case="expired") == 3
        assert r.metric("kvstore_rpc_seconds_count", method="Resume", code="OK") == 4
    finally:
        r.stop()


def test_admin_endpoints_of_the_real_service(svc: Running) -> None:
    toks = prompt(5, 4)
    store(svc, toks)
    svc.client.resume(MODEL, toks)
    assert svc.server.admin is not None
    base = f"http://127.0.0.1:{svc.server.admin.port}"
    import json

    st = json.load(urllib.request.urlopen(base + "/api/stats", timeout=10))
    assert st["totals"]["cases"]["warm"] == 1 and st["viewer"]["admin"] is True
    assert st["store"]["tiers"]["lmdb"]["used_bytes"] > 0 and st["pool"]["backend"] == "embedded"
    assert st["policy"]["ttl"]["kind"] == "fixed" and st["replay"]["coordinator"] is True
    ts = json.load(urllib.request.urlopen(base + "/api/timeseries?window=120", timeout=10))
    assert sum(p["requests"] for p in ts["points"]) == st["totals"]["requests"]
    health = json.load(urllib.request.urlopen(base + "/healthz", timeout=10))
    assert health["status"] == "SERVING"
    page = urllib.request.urlopen(base + "/dashboard", timeout=10).read()
    assert b"cache-hit analytics" in page


TIERS = ("device", "dram", "lmdb")


def _api_stats(r: Running) -> dict[str, Any]:
    import json

    assert r.server.admin is not None
    return dict(json.load(urllib.request.urlopen(f"http://127.0.0.1:{r.server.admin.port}/api/stats", timeout=10)))


def test_kv_moved_by_a_load_and_a_load_local_is_the_same_in_the_ledger_and_the_metrics(svc: Running) -> None:
    # The vLLM connector's pattern (Lookup, Load, LoadLocal; no Resume): the ledger counted no
    # byte of it, the metrics the Load's only (the snapshot nowhere), and both local calls were
    # labelled method="other" in kvstore_data_path_calls_total.
    toks = prompt(9, 3)
    store(svc, toks)  # a Store and a StoreLocal
    assert svc.client.lookup(MODEL, toks).hit_tokens == 3 * CHUNK  # prices a load: moves nothing
    loaded = svc.client.load(MODEL, toks)
    got = svc.client.load_local(MODEL, toks[: 3 * CHUNK])
    assert got.local_state == "hit" and got.snapshot
    svc.app.flush_observers()
    moved = {t: svc.metric("kvstore_bytes_moved_total", tier=t) for t in TIERS}
    assert sum(moved.values()) == 3 * loaded.chunk_bytes
    assert svc.metric("kvstore_local_bytes_moved_total") == len(got.snapshot)
    st = _api_stats(svc)
    assert st["totals"]["requests"] == 1  # the Lookup: a Load or a LoadLocal is not a request
    assert st["totals"]["bytes_moved"] == moved
    assert st["totals"]["local_bytes_moved"] == len(got.snapshot)
    assert st["tenants"]["default"]["bytes_moved"] == moved
    assert svc.metric("kvstore_data_path_calls_total", method="StoreLocal", path="stream") == 1
    assert svc.metric("kvstore_data_path_calls_total", method="LoadLocal", path="stream") == 1
    assert svc.metric("kvstore_data_path_calls_total", method="other", path="stream") == 0


def test_a_tenant_name_with_a_hyphen_is_its_own_label_through_the_service(tmp_path: Path) -> None:
    # "team-a" was snake-cased to "team_a", not a configured name, so its traffic went to "other".
    from kvstore.config.service import TenantConfig

    cfg = config()
    cfg = replace(cfg, tenants={"team-a": TenantConfig(tokens=("tok-team-a-0123456789abcdef",)),
                                "team_a": TenantConfig(tokens=("tok-team_a-0123456789abcdef",))},
                  admin=replace(cfg.admin, per_tenant_labels=True))
    r = start(tmp_path, cfg)
    client = KvstoreClient(f"127.0.0.1:{r.server.port}", token="tok-team-a-0123456789abcdef", timeout_seconds=20)
    try:
        toks = prompt(10, 2)
        assert client.resume(MODEL, toks).case == "cold"
        lay = r.app.store.layout(r.app.store.namespace("team-a", MODEL, "bounded"))
        client.store(MODEL, toks, [bytes([i]) * lay.chunk_bytes for i in range(2)])
        r.app.flush_observers()
        assert r.metric("kvstore_requests_total", method="resume", case="cold", tenant="team-a") == 1
        assert r.metric("kvstore_requests_total", method="resume", case="cold", tenant="team_a") == 0
        assert r.metric("kvstore_requests_total", method="resume", case="cold", tenant="other") == 0
        assert sum(r.metric("kvstore_tenant_bytes", tenant="team-a", tier=t) for t in TIERS) > 0
        assert sum(r.metric("kvstore_tenant_bytes", tenant=n, tier=t) for t in TIERS for n in ("team_a", "other")) == 0
        assert_valid_exposition(r.text)
    finally:
        client.close()
        r.stop()


def test_replay_seconds_time_the_replay_not_the_chunks_streamed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The clock ran from the replay's start until every chunk had been streamed: a slow reader
    # made an instant replay look slow (kvstore_replay_seconds, the ledger's p50/p99).
    import threading
    import time

    from kvstore.service.servicer import KVCacheServicer

    ended = threading.Event()

    class Instant(StandInCoordinator):
        def resume_local(self, ns: Namespace, tokens: np.ndarray, hit_tokens: int,
                         deadline_seconds: float, ticket: ReplayTicket) -> ReplayOutcome:
            out = super().resume_local(ns, tokens, hit_tokens, deadline_seconds, ticket)
            ended.set()
            return out

    streaming_seconds = 1.0
    real = KVCacheServicer.stream_chunks

    def slow_stream(self: KVCacheServicer, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        assert ended.wait(10)  # the replay is over before the first chunk goes out
        time.sleep(streaming_seconds)  # a slow reader, injected
        yield from real(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheServicer, "stream_chunks", slow_stream)
    r = start(tmp_path, config(), coordinator=Instant)
    try:
        toks = prompt(11, 4)
        store(r, toks)
        r.clock.advance(r.app.config.local_pool.ttl.ttl_seconds + 1)
        assert r.client.resume(MODEL, toks).local_state == "replayed"
        r.app.flush_observers()
        assert r.metric("kvstore_replay_seconds_count") == 1
        assert r.metric("kvstore_replay_seconds_sum") < streaming_seconds / 2
        assert _api_stats(r)["totals"]["replay"]["p99"] < streaming_seconds / 2
    finally:
        r.stop()
