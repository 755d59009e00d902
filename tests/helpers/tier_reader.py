"""Child process: open an LMDB environment, hold a read transaction, say so, and wait to be killed.

Usage: python -m tests.helpers.tier_reader DIR  (leaves a stale reader slot behind when killed)
"""

from __future__ import annotations

import sys
import time

import lmdb


def main() -> None:
    env = lmdb.open(sys.argv[1], max_dbs=4)
    with env.begin():  # the slot a reader killed in the middle of a get would leave behind
        print("reading", flush=True)
        time.sleep(60)


if __name__ == "__main__":
    main()
