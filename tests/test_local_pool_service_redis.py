"""The service over a Redis pool that answers too slowly: a LoadLocal is a local miss within the
pool's call budget, never the client's deadline (real Redis behind a real TCP proxy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore.local_pool.redis_process import RedisProcess
from tests.fixtures.service import V41, Service, make_config, tokens
from tests.fixtures.tcp_proxy import TcpProxy


def test_a_snapshot_that_trickles_in_is_a_local_miss_not_the_clients_deadline(
    redis_server: RedisProcess, tcp_proxy_factory: Any, make_service: Callable[..., Service],
) -> None:
    # 64 KiB per 0.1 s, each piece within the socket timeout: the pool's get once ran 2.2 s past its
    # 0.5 s budget, so the client's 1 s deadline ended the call (DEADLINE_EXCEEDED) instead of a miss.
    proxy: TcpProxy = tcp_proxy_factory(redis_server.port)
    svc = make_service(make_config(local_pool={"url": proxy.url, "call_budget_seconds": 0.5}))
    kv = svc.client(message_bytes=64 * 1024)
    prompt = tokens(5, svc.app.layouts()[V41].chunk_tokens)
    assert kv.store_local(V41, prompt, b"s" * svc.snapshot_bytes(V41)).stored
    proxy.set_mode("delay", 0.1)
    got = kv.load_local(V41, prompt, timeout_seconds=1.0)
    assert (got.local_state, got.reason, got.snapshot) == ("expired", "timeout", None)
    proxy.set_mode("pass")
