"""[local_pool] validation: every *_seconds key is a finite number in a sane range, and every
Redis URL the config accepts is one the transports can parse (a cluster's nodes may omit the port).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvstore.config import parse_config
from kvstore.config.fields import MAX_LOCAL_TTL_SECONDS
from kvstore.config.local_pool import MAX_CALL_SECONDS, MAX_TTL_SECONDS, LocalPoolConfig, redis_url_problem
from kvstore.errors import ConfigError
from kvstore.local_pool.redis_transport import parse_cluster_url

_TIMEOUT_KEYS = ("socket_timeout_seconds", "connect_timeout_seconds", "breaker_reset_seconds", "call_budget_seconds")
_TTL_KEYS = ("ttl.ttl_seconds", "ttl.max_ttl_seconds", "ttl.tenant_ttl_seconds.acme")


def _table(key: str, value: float) -> dict[str, Any]:
    """[local_pool] with `key` (dotted below the section) set to `value`."""
    table: dict[str, Any] = {"url": "redis://127.0.0.1:6379"}
    *parents, leaf = key.split(".")
    at = table
    for name in parents:
        at = at.setdefault(name, {})
    at[leaf] = value
    return {"local_pool": table}


# inf and 1e10 once passed: every pool call then failed with OverflowError (a socket timeout or
# a lock wait past what the OS takes), or every write with Redis refusing the PX.
@pytest.mark.parametrize("value", [math.inf, math.nan, 1e10, -1.0, 0.0])
@pytest.mark.parametrize("key", _TIMEOUT_KEYS + _TTL_KEYS)
def test_every_seconds_key_must_be_finite_and_in_range(key: str, value: float) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(_table(key, value))
    assert e.value.key == f"local_pool.{key}" and "finite number of seconds > 0 and <=" in e.value.problem


@pytest.mark.parametrize("key", _TIMEOUT_KEYS + _TTL_KEYS)
def test_the_upper_bound_itself_is_accepted(key: str) -> None:
    most = MAX_CALL_SECONDS if key in _TIMEOUT_KEYS else MAX_TTL_SECONDS
    table = _table(key, most)
    if key == "ttl.ttl_seconds":
        table["local_pool"]["ttl"]["max_ttl_seconds"] = most
    parse_config(table)


def test_a_tenant_ttl_has_one_bound_whichever_key_sets_it() -> None:
    # The pool's per-tenant TTL once took up to a year where [tenants.NAME] took 30 days.
    just_over = MAX_LOCAL_TTL_SECONDS + 1
    with pytest.raises(ConfigError) as e:
        parse_config(_table("ttl.tenant_ttl_seconds.acme", just_over))
    assert e.value.key == "local_pool.ttl.tenant_ttl_seconds.acme"
    with pytest.raises(ConfigError) as e:
        parse_config({"tenants": {"acme": {"tokens": ["acme-token-1"], "local_ttl_seconds": just_over}}})
    assert e.value.key == "tenants.acme.local_ttl_seconds"
    parse_config(_table("ttl.tenant_ttl_seconds.acme", MAX_LOCAL_TTL_SECONDS))


def test_cluster_nodes_without_a_port_are_on_6379() -> None:
    # rpartition(":") once read "redis-a" as a port: check-config passed, serve crashed.
    nodes, kwargs = parse_cluster_url("redis+cluster://u:pw@a,b:7000,[::1]?client_name=kvs")
    assert [(n.host, n.port) for n in nodes] == [("a", 6379), ("b", 7000), ("::1", 6379)]
    assert kwargs["username"] == "u" and kwargs["password"] == "pw" and kwargs["client_name"] == "kvs"
    LocalPoolConfig(url="redis+cluster://redis-a,redis-b").validate("local_pool")  # no ConfigError


@pytest.mark.parametrize(("url", "says"), [
    ("redis+cluster://a:7000,,b:7001", "needs a host"),  # once silently 127.0.0.1:6379
    ("redis+cluster://a:7000,", "needs a host"),
    ("redis+cluster://:7000", "needs a host"),
    ("redis+cluster://a,b:x", "host 'b:x'"),
    ("redis+cluster://[::1,b", "not a valid URL"),
    ("redis+cluster://a:70000", "host 'a:70000'"),
    ("redis://a:6379,b:6379", "redis+cluster://"),  # several hosts, but not a cluster's URL
])
def test_a_bad_cluster_url_is_one_clear_config_error(url: str, says: str) -> None:
    problem = redis_url_problem(url)
    assert problem is not None and says in problem
    with pytest.raises(ConfigError) as e:
        LocalPoolConfig(url=url).validate("local_pool")
    assert e.value.key == "local_pool.url" and says in str(e.value)
    if "+cluster" in url:  # the transport's parser says the same, never a bare ValueError
        with pytest.raises(ConfigError, match=r"local_pool\.url"):
            parse_cluster_url(url)
