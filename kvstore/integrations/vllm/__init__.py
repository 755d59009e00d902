"""kvstore as vLLM's KV connector: `KvstoreConnector` (see connector.py for how to load it).

`config.py` reads the connector's settings, `identity.py` fingerprints the weights,
`cache_layout.py` turns vLLM's cache into a kvstore layout and its blocks into canonical chunks,
`link.py` holds the client and counts failures, `scheduler.py` and `worker.py` are the two
sides of the connector, `metadata.py` what passes between them. `KvstoreConnector` needs vLLM
and imports it when first named (vLLM loads it by name from this package); the copies between
vLLM's blocks and kvstore's chunks in `cache_layout.py` need only torch, and are tested without
an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.integrations.vllm.connector import KvstoreConnector

__all__ = ["KvstoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvstoreConnector":
        from kvstore.integrations.vllm.connector import KvstoreConnector

        return KvstoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
