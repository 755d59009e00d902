"""The LMDB map grown under an address-space limit (RLIMIT_AS): LMDB unmaps its map before it
maps the larger one, so a refused mapping left the environment closed and every later call failed
until a restart ("Attempt to operate on closed/deleted/dropped object"). The growth is refused
first, and the tier keeps serving what it holds. In a child process: the limit is its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from kvstore.errors import StorageError
    from kvstore.tiers.lmdb_tier import LmdbTier
    from tests.helpers.tier_data import LAYOUT, key_of, meta_of, payload_of

    def item(i):
        key = key_of(9, i)
        return key, memoryview(payload_of(key)), meta_of(key)

    tier = LmdbTier(Path(sys.argv[1]) / "lmdb", 1 << 30, [LAYOUT])
    first = item(0)
    tier.put_many([first])
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))
    refused = ""
    try:
        for i in range(1, 20000):  # past the map's first size: it must grow, and may not
            tier.put_many([item(i)])
    except (StorageError, MemoryError) as e:
        refused = f"{type(e).__name__}: {e}"
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    print("refused:", refused, flush=True)
    out = memoryview(bytearray(LAYOUT.chunk_bytes))
    assert tier.get_into(first[0], out) is not None and bytes(out) == bytes(first[1]), "the first chunk is gone"
    tier.put_many([item(30000)])  # and it takes writes again
    tier.close()
    print("ok", flush=True)
""")


def test_a_map_growth_the_address_space_limit_refuses_leaves_the_tier_serving(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout.splitlines()
    assert done.returncode == 0 and out[-1:] == ["ok"], (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    refused = next(line for line in out if line.startswith("refused:"))
    assert "cannot grow the LMDB map" in refused and "address space" in refused, refused
