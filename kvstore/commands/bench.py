"""`kvstore bench NAME [--json]`: run one benchmark and print its figures and targets.

Each benchmark module in `kvstore/bench/` exposes `add_<name>_arguments(parser)` and
`run_<name>_bench(args) -> dict`. A result may carry a `targets` list of
{"name", "value", "target", "ok"} entries, which are printed as a checklist, and a `tables`
string: its readable tables. Every bench prints the same way: without `--json`, readable text on
stdout (the tables, else the figures one per line with dotted names) and the checklist; progress
always on stderr; with `--json`, the figures as JSON on stdout (without `tables`), so `> file`
keeps what was asked for; a figure that is not a finite number is null there (JSON has no NaN).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from kvstore.commands.checks import check_target, check_token
from kvstore.commands.json_out import dump_json

BENCHES = {
    "store": "tiers, LMDB and longest-prefix lookup against memcpy and raw LMDB",
    "service": "Load and Lookup over loopback gRPC against a plain gRPC server",
    "pool": "local-state pool (Redis, embedded) against raw redis-py and memcpy",
    "replay": "time to first token for cold, warm and expired requests",
    "workload": "agentic workload: the three bills, the 1/8 claim and the concurrency cliff",
    "abuse": "a victim tenant's latency alone and while another tenant abuses the service",
    "engine": "vLLM (CPU) time to first token: cold, kvstore (DRAM, LMDB), ExampleConnector, prefix cache",
    "restart": "reopening a store: cold and warm seconds, bytes read and index memory, toy and V4.1",
    "dataplane": "Load and Store through same-host shared memory against gRPC streams and memcpy",
}


class _BenchParser(argparse.ArgumentParser):
    """One bench's parser, its flags added when it is first used (parsing, help, usage): a bench
    module imports what it measures (torch, grpc, LMDB), so importing them all to build the
    parser made `kvstore --help` and every other command pay for all of them."""

    bench_name: str | None = None  # set when registered; None once its flags are in

    def _add_flags(self) -> None:
        name, self.bench_name = self.bench_name, None
        if name is None:
            return
        mod = importlib.import_module(f"kvstore.bench.{name}")
        getattr(mod, f"add_{name}_arguments")(self)
        self.set_defaults(_bench=getattr(mod, f"run_{name}_bench"))

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        self._add_flags()
        return super().parse_known_args(*args, **kwargs)

    def format_usage(self) -> str:
        self._add_flags()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_flags()
        return super().format_help()


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="NAME", required=True, parser_class=_BenchParser)
    for name, help_text in BENCHES.items():
        bp = sub.add_parser(name, help=help_text, description=help_text)
        bp.add_argument("--json", action="store_true", help="print the figures as JSON")
        bp.bench_name = name


def _lines(value: Any, name: str) -> list[tuple[str, str]]:
    """(dotted name, readable value) for every scalar in a figure, nested ones included."""
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _lines(v, f"{name}.{k}" if name else str(k))]
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return [row for i, v in enumerate(value) for row in _lines(v, f"{name}[{i}]")]
    if isinstance(value, list):
        return [(name, ", ".join(_scalar(v) for v in value))]
    return [(name, _scalar(value))]


def _scalar(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)


def _print_human(result: dict[str, Any]) -> None:
    tables = result.get("tables")
    if tables:
        print(str(tables).rstrip("\n"))
    else:
        figures = {k: v for k, v in result.items() if k not in ("targets", "tables")}
        rows = _lines(figures, "")
        width = min(48, max((len(k) for k, _ in rows), default=0))
        for k, v in rows:
            print(f"  {k:{width}s} {v}")
    targets = result.get("targets", [])
    if targets:
        print("targets:")
        for t in targets:
            mark = "ok  " if t["ok"] else "MISS"
            print(f"  [{mark}] {t['name']}: {t['value']:.4g} (target {t['target']})")


def run(args: argparse.Namespace) -> int:
    # A bench that dials a running service (`bench workload --target`) gets the checks every command's
    # target and token get (kvstore.bench may not import them), before it starts: gRPC dialled a
    # target without a port on 443, and the run waited 10 s to say "no service".
    if getattr(args, "target", None) is not None:
        check_target(args.target, "--target")
    if getattr(args, "token", None) is not None:
        check_token(args.token, "--token")
    result = args._bench(args)
    if args.json:
        dump_json({k: v for k, v in result.items() if k != "tables"}, sys.stdout)
    else:
        print(f"kvstore bench {args.bench}")
        _print_human(result)
    return 0
