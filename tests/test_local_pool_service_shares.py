"""The service's embedded pool splits its budget by the configured `share_weight`s: through the
public path (two authenticated tenants storing and loading local snapshots)."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES
from tests.fixtures.service import CHUNK, TOY, Service, make_config, tokens

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"


def test_a_service_splits_its_embedded_pool_by_the_tenants_share_weights(
    make_service: Callable[..., Service],
) -> None:
    probe = make_service()
    entry = probe.snapshot_bytes(TOY) + ENTRY_OVERHEAD_BYTES
    probe.stop()
    # Room for four snapshots; alice weighs 3 and bob 1, so 3 and 1 of them (equal weights: 2 and 2).
    svc = make_service(make_config(
        tenants={"alice": {"tokens": [ALICE], "share_weight": 3}, "bob": {"tokens": [BOB], "share_weight": 1}},
        local_pool={"capacity_bytes": 4 * entry},
    ))
    alice, bob = svc.client(ALICE), svc.client(BOB)
    snap = b"L" * svc.snapshot_bytes(TOY)
    prompts = [tokens(40 + i, 2 * CHUNK) for i in range(4)]
    for p in prompts:
        assert alice.store_local(TOY, p, snap).stored
    for p in prompts:
        assert bob.store_local(TOY, p, snap).stored  # each evicts one of alice's, then his own
    held = {name: [i for i, p in enumerate(prompts) if kv.load_local(TOY, p).snapshot is not None]
            for name, kv in (("alice", alice), ("bob", bob))}
    assert held == {"alice": [1, 2, 3], "bob": [3]}
