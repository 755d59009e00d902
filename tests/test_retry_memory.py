"""The retry memory is kept per tenant: one tenant's traffic never makes another's retry count (and
bill) as a new request, and the memory stays bounded in total."""

from __future__ import annotations

import numpy as np

from kvstore.config import KvstoreConfig
from kvstore.observe.records import FACTS_OVERHEAD_BYTES, CallRecord, PromptKey
from kvstore.observe.retries import RETRY_MEMORY, RecentRequests
from kvstore.service.admin_server import build_observability
from tests.test_admin_workload import FakeClock
from tests.test_ledger import bills


def test_a_busy_tenant_does_not_push_another_tenants_requests_out_of_the_retry_memory() -> None:
    # One memory for all tenants: alice's 16,800 lookups in 12 s pushed bob's request out, and bob's
    # retry 12 s later was counted as his third request (and its prompt billed again).
    clock = FakeClock()
    obs = build_observability(KvstoreConfig(), clock=clock, wall_clock=clock.wall)
    b = bills(["dram"], prompt=256)

    def call(tenant: str, rid: str) -> CallRecord:
        clock.advance(0.0007)
        return CallRecord(method="Lookup", tenant=tenant, code="OK", seconds=0.001, model="deepseek-v4.1-flash",
                          case="", local_state="absent", bills=b, request_id=rid, at=clock())

    obs(call("bob", "bob-retry-A"))
    obs(call("bob", "bob-retry-A"))  # a retry at once: counted once
    obs(call("bob", "bob-retry-B"))
    for i in range(RETRY_MEMORY + 500):
        obs(call("alice", f"a-{i}"))
    obs(call("bob", "bob-retry-B"))  # bob retries B ~12 s later, well within the window
    bob = obs.ledger.tenants()["bob"]
    assert (bob["requests"], bob["retries"], bob["prompt_tokens"]) == (2, 2, 2 * 256)
    assert obs.ledger.tenants()["alice"]["requests"] == RETRY_MEMORY + 500


def test_the_retry_memory_is_bounded_in_total_and_split_by_share_weight() -> None:
    seen = RecentRequests(max_entries=100, share_weights={"alice": 3.0, "bob": 1.0})
    for i in range(1000):
        assert not seen.repeated(("alice", f"a-{i}", "Lookup"), float(i))
        assert not seen.repeated(("bob", f"b-{i}", "Lookup"), float(i))
    assert len(seen._at) == 100 and seen._at.cap("alice") == 75 and seen._at.cap("bob") == 25
    assert seen.repeated(("alice", "a-999", "Lookup"), 1000.0)  # the latest are remembered
    assert seen.repeated(("bob", "b-999", "Lookup"), 1000.0)
    assert not seen.repeated(("bob", "b-0", "Lookup"), 1000.0)  # the oldest forgotten first


def test_the_prompt_is_hashed_once_by_the_observers_and_its_tokens_let_go() -> None:
    # The servicers hashed each prompt before answering (~3 ms for 1M tokens). Now the record
    # references the call's tokens, the first observer to ask hashes them, and the others reuse it.
    tokens = np.arange(1000, dtype="<u4")
    key = PromptKey(b"ns", tokens)
    rec = CallRecord(method="Lookup", tenant="acme", code="OK", seconds=0.001, request_id="r1", at=1.0, prompt=key)
    assert rec.retained_bytes == FACTS_OVERHEAD_BYTES + tokens.nbytes
    first, second = RecentRequests(), RecentRequests()
    assert not first.retry(rec) and key.retained_bytes == 0  # hashed: the tokens are let go
    assert not second.retry(rec) and first.retry(rec)
    other = PromptKey(b"ns", tokens[::-1].copy())
    assert not first.retry(CallRecord(method="Lookup", tenant="acme", code="OK", seconds=0.001,
                                      request_id="r1", at=2.0, prompt=other))  # same id, new prompt
    assert other.digest != key.digest and len(key.digest) == 16
    assert PromptKey(b"other-ns", tokens).digest != key.digest


def test_a_lightened_record_hashes_its_prompt_and_drops_the_tokens() -> None:
    tokens = np.arange(4096, dtype="<u4")
    rec = CallRecord(method="Load", tenant="acme", code="OK", seconds=0.001, request_id="r1",
                     prompt=PromptKey(b"ns", tokens))
    light = rec.lightened()
    assert light is not rec and light.retained_bytes == FACTS_OVERHEAD_BYTES
    assert light.prompt is not None and light.prompt.digest == PromptKey(b"ns", tokens).digest
    assert light.lightened() is light
    bare = CallRecord(method="Lookup", tenant="acme", code="OK", seconds=0.001, request_id="r2")
    assert bare.lightened() is bare and bare.retained_bytes == FACTS_OVERHEAD_BYTES
    seen = RecentRequests()
    assert not seen.retry(bare) and seen.retry(bare)  # without a prompt: by the id alone
