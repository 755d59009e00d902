"""`kvstore bench NAME [--json]`: run one benchmark and print its figures and targets.

Each benchmark module in `kvstore/bench/` exposes `add_<name>_arguments(parser)` and
`run_<name>_bench(args) -> dict`. A result may carry a `targets` list of
{"name", "value", "target", "ok"} entries, which are printed as a checklist.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

BENCHES = {
    "store": "tiers, LMDB and longest-prefix lookup against memcpy and raw LMDB",
    "service": "Load and Lookup over loopback gRPC against a plain gRPC server",
    "pool": "local-state pool (Redis, embedded) against raw redis-py and memcpy",
    "replay": "time to first token for cold, warm and expired requests",
    "workload": "agentic workload: the three bills, the 1/8 claim and the concurrency cliff",
    "abuse": "a victim tenant's latency alone and while another tenant abuses the service",
    "engine": "vLLM (CPU) time to first token: cold, kvstore (DRAM, LMDB), ExampleConnector, prefix cache",
    "restart": "reopening a store: cold and warm seconds, bytes read and index memory, toy and V4.1",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, help_text in BENCHES.items():
        mod = importlib.import_module(f"kvstore.bench.{name}")
        bp = sub.add_parser(name, help=help_text, description=help_text)
        bp.add_argument("--json", action="store_true", help="print the figures as JSON")
        getattr(mod, f"add_{name}_arguments")(bp)
        bp.set_defaults(_bench=getattr(mod, f"run_{name}_bench"))


def _print_human(result: dict[str, Any]) -> None:
    for k, v in result.items():
        if k == "targets":
            continue
        if isinstance(v, float):
            print(f"  {k:32s} {v:,.4g}")
        elif isinstance(v, dict | list):
            print(f"  {k:32s} {json.dumps(v)}")
        else:
            print(f"  {k:32s} {v}")
    targets = result.get("targets", [])
    if targets:
        print("targets:")
        for t in targets:
            mark = "ok  " if t["ok"] else "MISS"
            print(f"  [{mark}] {t['name']}: {t['value']:.4g} (target {t['target']})")


def run(args: argparse.Namespace) -> int:
    result = args._bench(args)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(f"kvstore bench {args.bench}")
        _print_human(result)
    return 0
