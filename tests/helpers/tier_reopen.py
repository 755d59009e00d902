"""Child process: reopen an LMDB tier written by another process and report what it finds.

Usage: python -m tests.helpers.tier_reopen DIR  ->  one JSON object on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers.tier_data import check_chunk, open_tier


def main() -> None:
    tier = open_tier(Path(sys.argv[1]))
    scanned = list(tier.scan(verify=True))
    report = {
        "keys": [sc.key.hex() for sc in scanned if sc.ok],
        "problems": {sc.key.hex(): sc.problem for sc in scanned if not sc.ok},
        "bad": {
            sc.key.hex(): err for sc in scanned if sc.ok and (err := check_chunk(tier, sc.key))
        },
        "namespaces": {k.hex(): v.hex() for k, v in tier.namespaces().items()},
        "used_bytes": tier.stats().used_bytes,
        "entries": tier.stats().entries,
        "stale_readers_cleared": tier.stale_readers_cleared,
    }
    tier.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
