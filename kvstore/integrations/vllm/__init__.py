"""kvstore as vLLM's KV connector: `KvstoreConnector` (see connector.py for how to load it).

`config.py` reads the connector's settings, `identity.py` fingerprints the weights,
`cache_layout.py` turns vLLM's cache into a kvstore layout and its blocks into canonical chunks,
`link.py` holds the client and counts failures, `scheduler.py` and `worker.py` are the two
sides of the connector, `metadata.py` what passes between them. Importing it needs vLLM.
"""

from kvstore.integrations.vllm.connector import KvstoreConnector

__all__ = ["KvstoreConnector"]
