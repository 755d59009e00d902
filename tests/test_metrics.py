"""The metrics recorder and its scrape-time collector: each case moves the counters it should,
label cardinality stays bounded whatever tenants and sessions do, and the exposition is valid
(checked by `promtool check metrics` when it is installed, and always by prometheus-client's
parser plus naming checks of our own)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.observe.metrics import Metrics, PolicyInfo, Sources
from kvstore.observe.records import ReplaySummary, RequestRecord
from kvstore.wire.bills import price
from tests.test_admin_workload import CHUNK, Rig, workload

# --- exposition checks, shared with test_deploy and test_metrics_service ------------------------------

_SNAKE = re.compile(r"^[a-z_][a-z0-9_]*$")
_UNITS = ("seconds", "bytes")
_BAD_UNITS = re.compile(r"_(milliseconds|microseconds|ms|us|kb|mb|gb|kib|mib|gib|sec|secs|minutes|hours)(_|$)")


def exposition_problems(text: str) -> list[str]:
    """What is wrong with an exposition, by prometheus-client's parser and our naming rules."""
    problems: list[str] = []
    families = list(text_string_to_metric_families(text))
    if not families:
        return ["no metric families"]
    seen: set[str] = set()
    for fam in families:
        name = fam.name
        if name in seen:
            problems.append(f"{name}: family repeated")
        seen.add(name)
        if not name.startswith("kvstore_"):
            problems.append(f"{name}: not in the kvstore_ namespace")
        if not _SNAKE.match(name):
            problems.append(f"{name}: not snake_case")
        if not fam.documentation:
            problems.append(f"{name}: no HELP text")
        if _BAD_UNITS.search(name):
            problems.append(f"{name}: use base units (seconds, bytes)")
        if fam.type == "counter" and name.endswith("_total"):
            problems.append(f"{name}: the parser saw a counter family named *_total")
        if fam.type in ("gauge", "untyped") and name.endswith("_total"):
            problems.append(f"{name}: a gauge must not end in _total")
        if fam.type not in ("histogram", "summary") and re.search(r"_(bucket|count|sum)$", name):
            problems.append(f"{name}: reserved suffix on a {fam.type}")
        for unit in _UNITS:
            if unit in name.split("_")[:-1] and fam.type != "counter" and not name.endswith(unit):
                problems.append(f"{name}: the unit '{unit}' belongs at the end of the name")
        for s in fam.samples:
            if fam.type == "counter" and not (s.name.endswith("_total") or s.name.endswith("_created")):
                problems.append(f"{s.name}: a counter sample must end in _total")
            for label in s.labels:
                if not _SNAKE.match(label):
                    problems.append(f"{s.name}: label {label} is not snake_case")
    return problems


def promtool_problems(text: str) -> list[str] | None:
    """`promtool check metrics` on the exposition; None when promtool is not installed."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    out = (r.stdout + r.stderr).decode().strip()
    return [] if r.returncode == 0 and not out else [out or f"promtool exited {r.returncode}"]


def assert_valid_exposition(text: str) -> None:
    assert exposition_problems(text) == []
    problems = promtool_problems(text)
    if problems is not None:  # without promtool the checks above still ran: never a skip
        assert problems == []


def series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {(s.name, tuple(sorted(s.labels.items())))
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# --- helpers --------------------------------------------------------------------------------------------


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


def record(method: str, case: str, local: str, hit_tiers: Iterable[str], prompt: int = 100, *,
           tenant: str = "default", replay: ReplaySummary | None = None, miss: str = "",
           local_reason: str = "", rid: str = "r") -> RequestRecord:
    tiers = list(hit_tiers)
    bills = price(prompt_tokens=prompt, chunk_tokens=CHUNK, chunk_bytes=1000, chunk_tiers=tiers,
                  flops_per_token=2e9, replay_tokens=replay.tokens if replay else 0,
                  local_bytes=500 if local in ("hit", "replayed") else 0)
    return RequestRecord(rid, method, tenant, "m", case, local, bills, replay, miss, local_reason)  # type: ignore[arg-type]


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


# --- each case moves what it should -------------------------------------------------------------------


def test_cold_lookup(reg: CollectorRegistry) -> None:
    m = Metrics(reg)
    m.request(record("lookup", "cold", "absent", [], prompt=100, miss="never_stored"))
    assert value(reg, "kvstore_requests_total", method="lookup", case="cold") == 1
    assert value(reg, "kvstore_lookups_total", method="lookup", result="miss") == 1
    assert value(reg, "kvstore_lookup_tokens_total", tier="none", result="miss") == 100
    assert value(reg, "kvstore_local_state_total", outcome="absent") == 1
    assert value(reg, "kvstore_lookup_misses_total", reason="never_stored") == 1
    assert value(reg, "kvstore_prefill_tokens_total") == 100
    assert value(reg, "kvstore_prefill_tokens_avoided_total") == 0
    # A Lookup moves nothing: its tier bytes are what a Load would move.
    assert sum(value(reg, "kvstore_bytes_moved_total", tier=t) for t in ("device", "dram", "lmdb")) == 0


def test_warm_resume(reg: CollectorRegistry) -> None:
    m = Metrics(reg)
    m.request(record("resume", "warm", "hit", ["device", "device", "dram", "lmdb"], prompt=70))
    assert value(reg, "kvstore_requests_total", method="resume", case="warm") == 1
    assert value(reg, "kvstore_lookups_total", method="resume", result="hit") == 1
    assert value(reg, "kvstore_lookup_tokens_total", tier="device", result="hit") == 2 * CHUNK
    assert value(reg, "kvstore_lookup_tokens_total", tier="dram", result="hit") == CHUNK
    assert value(reg, "kvstore_lookup_tokens_total", tier="lmdb", result="hit") == CHUNK
    assert value(reg, "kvstore_lookup_tokens_total", tier="none", result="miss") == 70 - 4 * CHUNK
    assert value(reg, "kvstore_bytes_moved_total", tier="device") == 2000
    assert value(reg, "kvstore_local_bytes_moved_total") == 500
    assert value(reg, "kvstore_local_state_total", outcome="hit") == 1
    assert value(reg, "kvstore_prefill_tokens_avoided_total") == 4 * CHUNK
    assert value(reg, "kvstore_prefill_flops_avoided_total") == 4 * CHUNK * 2e9
    assert value(reg, "kvstore_replays_total", result="ok") == 0


def test_expired_resume_with_a_replay_and_one_that_fails(reg: CollectorRegistry) -> None:
    m = Metrics(reg)
    m.request(record("resume", "expired", "replayed", ["lmdb"] * 3, replay=ReplaySummary(0.04, 48),
                     local_reason="ttl_expired"))
    m.request(record("resume", "expired", "expired", ["lmdb"] * 3, replay=ReplaySummary(2.0, 0, "timeout"),
                     local_reason="breaker-open"))
    assert value(reg, "kvstore_requests_total", method="resume", case="expired") == 2
    assert value(reg, "kvstore_replays_total", result="ok") == 1
    assert value(reg, "kvstore_replays_total", result="failed") == 1
    assert value(reg, "kvstore_replay_failures_total", reason="timeout") == 1
    assert value(reg, "kvstore_replay_tokens_total") == 48
    assert value(reg, "kvstore_replay_seconds_count") == 2
    assert value(reg, "kvstore_replay_seconds_bucket", le="0.05") == 1
    assert value(reg, "kvstore_local_state_total", outcome="replayed") == 1
    assert value(reg, "kvstore_local_state_total", outcome="expired") == 1
    assert value(reg, "kvstore_local_misses_total", reason="ttl_expired") == 1
    assert value(reg, "kvstore_local_misses_total", reason="breaker_open") == 1


def test_every_label_value_is_snake_case_and_reasons_do_not_overlap(reg: CollectorRegistry) -> None:
    """One spelling for every label value, whatever the producing part calls it ("breaker-open"),
    and one local-miss reason per cause: the pool's coarse "expired" / "absent" are refined into
    ttl_expired / evicted / never_stored, never counted beside them."""
    import re

    from kvstore.local_pool.base import PoolStats
    from kvstore.observe.metrics import LOCAL_MISS_REASONS, Sources

    stats = PoolStats(backend="redis", hits=1, misses={"breaker-open": 2, "expired": 1}, writes=1,
                      skipped_writes={"no-room": 1, "breaker-open": 1}, errors=0, refreshes=0, deletes=0,
                      bytes_written=1, bytes_read=1, evictions=0, expirations=0, entries=1, used_bytes=1,
                      capacity_bytes=2, breaker_state="half-open", breaker_opens=1, peeks=5)
    Metrics(reg, sources=Sources(pool=lambda: stats))
    values = {v for fam in reg.collect() for smp in fam.samples for k, v in smp.labels.items()
              if k not in ("version", "le", "tenant")}
    bad = {v for v in values if not re.fullmatch(r"[a-z0-9_]+|[A-Z_]+|[A-Za-z]+", v)}
    assert not bad, bad
    assert {"breaker_open", "no_room", "half_open", "no_runner", "prefix_gone"} <= values
    assert value(reg, "kvstore_pool_misses_total", reason="breaker_open") == 2
    assert value(reg, "kvstore_pool_peeks_total") == 5  # a Lookup's presence check: no hit, no miss
    assert value(reg, "kvstore_pool_breaker_state", state="half_open") == 1
    assert not {"expired", "absent"} & set(LOCAL_MISS_REASONS)


def test_every_pool_miss_reason_has_its_own_label() -> None:
    # A reason the pool counts but the metrics do not name is counted as "other": a full Redis
    # refusing reads (oom) read as an unknown failure.
    from kvstore.local_pool.base import MISS_REASONS
    from kvstore.observe.metrics import LOCAL_MISS_REASONS, POOL_MISS_REASONS

    for reason in MISS_REASONS:
        assert reason.replace("-", "_") in POOL_MISS_REASONS, reason
    assert "oom" in LOCAL_MISS_REASONS


def test_replay_failure_reasons_come_from_a_fixed_set() -> None:
    from kvstore.observe.metrics import replay_failure

    assert replay_failure("timeout") == "timeout" and replay_failure("no-runner") == "no_runner"
    assert replay_failure("runners-busy") == "runners_busy"
    assert replay_failure("resource_exhausted: 4 replays in flight for tenant acme") == "overload"
    assert replay_failure("prefix no longer cached") == replay_failure("prefix shrank while loading") == "prefix_lost"
    assert replay_failure("wrong snapshot size") == "other"


def test_a_prefix_gone_under_the_replay_has_its_own_label(reg: CollectorRegistry) -> None:
    from kvstore.observe.metrics import replay_failure
    from replay.coordinator import PREFIX_GONE

    assert replay_failure(PREFIX_GONE) == "prefix_gone"
    m = Metrics(reg)
    m.replay(0.01, PREFIX_GONE)
    assert value(reg, "kvstore_replay_failures_total", reason="prefix_gone") == 1
    assert value(reg, "kvstore_replay_failures_total", reason="other") == 0


def test_an_untimed_replay_counts_without_a_latency_sample(reg: CollectorRegistry) -> None:
    m = Metrics(reg)
    m.request(record("resume", "expired", "replayed", ["dram"], replay=ReplaySummary(None, 16)))
    assert value(reg, "kvstore_replays_total", result="ok") == 1
    assert value(reg, "kvstore_replay_seconds_count") == 0


def test_rpc_latency_by_method_and_code(reg: CollectorRegistry) -> None:
    m = Metrics(reg)
    m.rpc("Lookup", "OK", 0.002)
    m.rpc("Resume", "RESOURCE_EXHAUSTED", 0.0001)
    m.rpc("SomethingNew", "WEIRD", 1.0)  # never a new label value
    assert value(reg, "kvstore_rpc_seconds_count", method="Lookup", code="OK") == 1
    assert value(reg, "kvstore_rpc_seconds_count", method="Resume", code="RESOURCE_EXHAUSTED") == 1
    assert value(reg, "kvstore_rpc_seconds_count", method="other", code="other") == 1


def test_load_counts_bytes_moved(reg: CollectorRegistry) -> None:
    m = Metrics(reg)
    m.load({"dram": 4096, "lmdb": 0, "nonsense": 7})
    assert value(reg, "kvstore_bytes_moved_total", tier="dram") == 4096
    assert value(reg, "kvstore_bytes_moved_total", tier="other") == 7


# --- scrape-time sources ----------------------------------------------------------------------------


def test_store_gauges_and_evictions_come_from_the_real_store(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    rig = Rig(tmp_path, registry=reg)
    try:
        workload(rig, minutes=6, sessions=6)
        st = rig.store.stats()
        text = generate_latest(reg).decode()
        for tier in ("device", "dram", "lmdb"):
            assert value(reg, "kvstore_tier_bytes", tier=tier) == st.tiers[tier].used_bytes
            assert value(reg, "kvstore_tier_capacity_bytes", tier=tier) == st.tiers[tier].capacity_bytes
        evicted = sum(value(reg, "kvstore_evictions_total", tier=t, reason="capacity") for t in ("device", "dram"))
        assert evicted == sum(st.evictions_by_reason.values()) > 0
        assert value(reg, "kvstore_lmdb_map_size_bytes") > 0
        assert value(reg, "kvstore_pool_up") == 1
        assert value(reg, "kvstore_pool_breaker_state", state="closed") == 1
        assert value(reg, "kvstore_pool_hits_total") > 0
        assert value(reg, "kvstore_tier_byte_seconds_total", tier="device") > 0
        assert value(reg, "kvstore_policy_info", ttl_kind="fixed", eviction_policy="s3fifo",
                     replay_mode="bounded") == 1
        # The workload's sessions come back with their prompts: their keys come from the memo.
        assert value(reg, "kvstore_key_memo_prompts") == st.key_memo_prompts > 0
        assert value(reg, "kvstore_key_memo_bytes") == st.key_memo_bytes > 0
        assert value(reg, "kvstore_key_memo_hits_total") == st.key_memo_hits > 0
        assert value(reg, "kvstore_key_memo_reused_keys_total") == st.key_memo_reused_keys >= st.key_memo_hits
        assert_valid_exposition(text)
    finally:
        rig.close()


def test_a_failing_source_costs_its_own_families_not_the_scrape(reg: CollectorRegistry) -> None:
    def broken() -> Any:
        raise RuntimeError("the store is on fire")

    m = Metrics(reg, sources=Sources(store=broken, policy=lambda: PolicyInfo("fixed", 300, "lru", "bounded")))
    m.rpc("Lookup", "OK", 0.001)
    text = generate_latest(reg).decode()
    assert "kvstore_rpc_seconds_count" in text and "kvstore_tier_bytes" not in text
    assert value(reg, "kvstore_scrape_errors_total", source="store") >= 1
    assert value(reg, "kvstore_local_ttl_seconds") == 300
    assert_valid_exposition(text)


# --- cardinality ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_tenant", [False, True])
def test_label_cardinality_is_bounded_under_random_tenants_and_sessions(per_tenant: bool) -> None:
    reg = CollectorRegistry()
    m = Metrics(reg, per_tenant_labels=per_tenant, tenants=("acme", "globex"))
    rng = np.random.default_rng(7)

    def burst(n: int) -> None:
        for i in range(n):
            tenant = rng.choice(["acme", "globex", f"t{rng.integers(1 << 30):x}"])
            session = f"{rng.integers(1 << 62):016x}"  # the kind of value that must never be a label
            hit = ["device", "dram", "lmdb"][: int(rng.integers(0, 4))]
            case = "cold" if not hit else str(rng.choice(["warm", "expired"]))
            failure = [None, "timeout", f"x{session}"][int(rng.integers(0, 3))]
            replay = ReplaySummary(float(rng.random()), 16, failure)
            m.request(record(str(rng.choice(["lookup", "resume"])), case, "hit" if case == "warm" else "expired",
                             hit, tenant=tenant, replay=replay if case == "expired" else None,
                             miss=str(rng.choice(["never_stored", "evicted", f"m{session}"])),
                             local_reason=str(rng.choice(["ttl_expired", session])), rid=session))
            m.rpc(str(rng.choice(["Lookup", f"M{i}"])), str(rng.choice(["OK", f"C{i}"])), 0.01)

    burst(200)
    first = series(generate_latest(reg).decode())
    burst(2000)
    text = generate_latest(reg).decode()
    after = series(text)
    assert after == first  # every combination existed from the start; nothing new appeared
    values = {v for _, labels in after for _, v in labels}
    assert not any(re.fullmatch(r"[tmx]?[0-9a-f]{6,}", v) for v in values), "a hash or id became a label"
    tenants = {v for _, labels in after for k, v in labels if k == "tenant"}
    assert tenants == ({"acme", "globex", "default", "other"} if per_tenant else set())
    assert len(after) < 1200
    assert_valid_exposition(text)


def test_the_exposition_of_a_fresh_registry_is_valid(reg: CollectorRegistry) -> None:
    Metrics(reg, per_tenant_labels=True, tenants=("acme",))
    assert_valid_exposition(generate_latest(reg).decode())


def test_the_checks_catch_bad_names() -> None:
    bad = ("# HELP kvstore_latency_ms x\n# TYPE kvstore_latency_ms gauge\nkvstore_latency_ms 1\n"
           "# HELP kvstore_things_total x\n# TYPE kvstore_things_total gauge\nkvstore_things_total 1\n"
           "# HELP other_metric x\n# TYPE other_metric gauge\nother_metric 1\n")
    problems = exposition_problems(bad)
    assert any("base units" in p for p in problems)
    assert any("must not end in _total" in p for p in problems)
    assert any("namespace" in p for p in problems)


def test_data_path_calls_are_counted_by_method_and_path(reg: CollectorRegistry) -> None:
    m = Metrics(reg)
    assert value(reg, "kvstore_data_path_calls_total", method="Load", path="shm") == 0  # there from the start
    m.data_path("Load", "shm")
    m.data_path("Load", "shm")
    m.data_path("Store", "stream")
    m.data_path("Nonsense", "teleport")
    assert value(reg, "kvstore_data_path_calls_total", method="Load", path="shm") == 2
    assert value(reg, "kvstore_data_path_calls_total", method="Store", path="stream") == 1
    assert value(reg, "kvstore_data_path_calls_total", method="other", path="other") == 1


def test_local_snapshot_calls_are_counted_under_their_own_method(reg: CollectorRegistry) -> None:
    # StoreLocal and LoadLocal set a data path too: they were all counted as method="other".
    m = Metrics(reg)
    assert reg.get_sample_value("kvstore_data_path_calls_total", {"method": "LoadLocal", "path": "shm"}) == 0
    m.data_path("StoreLocal", "shm")
    m.data_path("LoadLocal", "stream")
    m.data_path("LoadLocal", "stream")
    assert value(reg, "kvstore_data_path_calls_total", method="StoreLocal", path="shm") == 1
    assert value(reg, "kvstore_data_path_calls_total", method="LoadLocal", path="stream") == 2
    assert value(reg, "kvstore_data_path_calls_total", method="other", path="stream") == 0


def test_a_tenant_name_with_a_hyphen_keeps_its_own_label() -> None:
    # Tenant names were snake-cased before being matched: "team-a" was counted as "other", or, with
    # "team_a" configured too, as team_a (another tenant's series).
    from kvstore.store.types import StoreStats

    reg = CollectorRegistry()
    held = {"team-a": {"dram": 10}, "team_a": {"dram": 20}, "team-b": {"dram": 40}}
    stats = StoreStats(chunks=0, tiers={}, tenant_bytes=held, lookups=0, lookup_hit_tokens=0,
                       lookup_miss_tokens=0, token_mismatches=0, corrupt_reads=0, pins_active=0, pins_expired=0,
                       admissions_refused=0)
    m = Metrics(reg, per_tenant_labels=True, tenants=("team-a", "team_a"), sources=Sources(store=lambda: stats))
    m.load({"dram": 100}, tenant="team-a")
    m.request(record("resume", "cold", "absent", [], tenant="team-a"))
    assert value(reg, "kvstore_bytes_moved_total", tier="dram", tenant="team-a") == 100
    assert value(reg, "kvstore_bytes_moved_total", tier="dram", tenant="team_a") == 0
    assert value(reg, "kvstore_requests_total", method="resume", case="cold", tenant="team-a") == 1
    assert value(reg, "kvstore_requests_total", method="resume", case="cold", tenant="other") == 0
    assert value(reg, "kvstore_tenant_bytes", tenant="team-a", tier="dram") == 10
    assert value(reg, "kvstore_tenant_bytes", tenant="team_a", tier="dram") == 20
    assert value(reg, "kvstore_tenant_bytes", tenant="other", tier="dram") == 40  # not configured
    assert_valid_exposition(generate_latest(reg).decode())


def test_the_prefill_avoided_help_says_what_it_counts(reg: CollectorRegistry) -> None:
    # Where the local state expired unrebuilt the engine prefills the hit too, and the counter
    # still counts it: its HELP must not say the engine did not prefill those tokens.
    Metrics(reg)
    text = generate_latest(reg).decode()
    help_line = next(line for line in text.splitlines()
                     if line.startswith("# HELP kvstore_prefill_tokens_avoided_total "))
    assert "global KV was served from the cache" in help_line
    assert "did not prefill" not in help_line
    assert "expired and was not rebuilt" in help_line
