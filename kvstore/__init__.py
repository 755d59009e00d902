"""kvstore: a tiered KV-cache persistence service with bounded replay.

The package holds the global-KV store and its tiers, the local-state pool, the gRPC service and
client, config, metrics and the CLI. It knows nothing about how a model computes its cache; that
lives in `replay/`.
"""

__version__ = "0.1.0"
