"""`kvstore stats`: ask a running service for its statistics and print a readable summary.

The bearer token comes from `--token` or, better (it stays out of `ps`), `KVSTORE_TOKEN`.
`--json` prints the same figures as JSON. A service that is not running is a one-line error.
`--recent N` lists the service's N most recent requests (ids for `kvstore explain ID`, case and
the three bills), read from its admin port (`--admin`), which keeps them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from kvstore.commands.admin_client import NotAnAdminPort, admin_get, has_fields, kvstore_error
from kvstore.commands.checks import (
    check_admin_url,
    check_target,
    check_timeout,
    check_token,
)
from kvstore.errors import InvalidInput
from kvstore.wire.tls_files import check_tls_ca, check_tls_client

if TYPE_CHECKING:  # kvstore.client imports grpc: only `run` needs it, not the parser `kvstore --help` builds
    from kvstore.client.types import ServiceStats


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the service")
    p.add_argument("--token", default=None, help="bearer token (default: $KVSTORE_TOKEN)")
    p.add_argument("--tls-ca", metavar="FILE", help="CA certificate: use TLS")
    p.add_argument("--tls-cert", metavar="FILE", help="client certificate (mTLS)")
    p.add_argument("--tls-key", metavar="FILE", help="client key (mTLS)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--recent", type=int, default=0, metavar="N",
                   help="also list the N most recent requests: ids, case and bills (from the admin port)")
    p.add_argument("--admin", default="http://127.0.0.1:9400", metavar="URL",
                   help="the service's admin HTTP address, for --recent (default %(default)s)")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def render(s: ServiceStats) -> str:
    lines = [f"kvstore {s.version} — up {s.uptime_seconds:.0f} s — you are tenant '{s.tenant}'"]
    if not s.ready:
        lines.append(f"index {s.index_state}: {s.index_loaded_chunks:,} of {s.index_chunks_at_start:,} LMDB chunks "
                     "indexed (answering from those; Stores are kept in memory only until ready)")
    lines.append(f"{'tier':8s} {'backend':8s} {'used':>11s} {'capacity':>11s} {'use':>5s} {'yours':>11s} "
                 f"{'chunks':>8s} {'evicted':>8s} {'corrupt':>7s}")
    for name, t in s.tiers.items():
        pct = 100 * t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        lines.append(f"{name:8s} {t.backend or '-':8s} {_size(t.used_bytes):>11s} {_size(t.capacity_bytes):>11s} "
                     f"{pct:4.0f}% {_size(t.tenant_used_bytes):>11s} {t.entries:8d} {t.evictions:8d} "
                     f"{t.corrupt_total:7d}")
    looked = s.lookup_hit_tokens + s.lookup_miss_tokens
    rate = 100 * s.lookup_hit_tokens / looked if looked else 0.0
    lines.append(f"lookups {s.lookups}: {s.lookup_hit_tokens} of {looked} tokens hit ({rate:.1f}%), "
                 f"{s.token_mismatches} token mismatches, {s.corrupt_reads} corrupt reads")
    pool = s.local_pool
    lines.append(f"local pool: {pool['backend']} ({'healthy' if pool['healthy'] else 'DEGRADED'}"
                 + (f": {pool['detail']}" if pool["detail"] else "") + ")")
    lines.append(f"replay: coordinator {'on' if s.replay_coordinator else 'off'}, "
                 f"{s.runners_attached} runner(s) attached")
    lines.append(f"calls: {s.calls_in_flight} in flight, {s.calls_rejected} refused for overload; "
                 f"pins {s.pins_active} active, {s.pins_expired} expired")
    if s.evictions_by_reason:
        lines.append("evictions by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(s.evictions_by_reason.items())))
    lines.append(f"models: {', '.join(s.models)}")
    return "\n".join(lines)


def recent_requests(admin_url: str, token: str | None, limit: int, timeout: float) -> list[dict[str, Any]]:
    """The newest `limit` requests the admin port's `/api/stats` lists (an admin's or a tenant's
    token sees them; without one only a loopback admin port shows them)."""
    base = check_admin_url(admin_url, "--admin")
    try:  # parsing the URL: 'http://[::1' is no URL at all
        req = urllib.request.Request(base.rstrip("/") + "/api/stats",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    except ValueError as e:
        raise InvalidInput(f"--admin {admin_url!r} is not a URL: {e}") from None
    try:
        status, doc = admin_get(req, timeout)
    except NotAnAdminPort as e:
        raise InvalidInput(f"--admin {admin_url}: not a kvstore admin port: {e}") from None
    except http.client.HTTPException:  # something answered, not in HTTP/1 (a gRPC port answers HTTP/2)
        raise InvalidInput(f"--admin {admin_url}: not an HTTP admin port (is this the gRPC port?)") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InvalidInput(f"--admin {admin_url}: no admin port answered ({getattr(e, 'reason', e)})") from None
    if status != 200:
        why = kvstore_error(doc)
        if why is None:
            raise InvalidInput(f"--admin {admin_url}: not a kvstore admin port: it answered {status} without "
                               "kvstore's error body")
        raise InvalidInput(f"--admin {admin_url}: HTTP {status}: {why}")
    if not has_fields(doc, _STATS):
        raise InvalidInput(f"--admin {admin_url}: not a kvstore admin port: its /api/stats answer is not kvstore's")
    rows = doc.get("recent_requests")
    if rows is None:
        raise InvalidInput(f"--admin {admin_url}: recent requests name tenants: pass the admin token or a "
                           "tenant's (--token or KVSTORE_TOKEN)")
    if not isinstance(rows, list) or not all(_is_recent_row(r) for r in rows):
        raise InvalidInput(f"--admin {admin_url}: not a kvstore admin port: its recent requests are not kvstore's")
    return rows[:limit]


# What every kvstore `/api/stats` holds, and what `render_recent` reads of a row, by type.
_STATS = {"version": str, "viewer": dict, "totals": dict}
_ROW = {"request_id": str, "tenant": str, "method": str, "case": str, "time": (int, float), "bills": dict}
_ROW_BILLS = {"prompt_tokens": int, "prefill_tokens": int, "replay_tokens": int, "local_bytes": int, "tiers": dict}
_TIER_BILL = {"hit_tokens": int, "bytes": int}


def _is_recent_row(r: Any) -> bool:
    return (has_fields(r, _ROW) and has_fields(r["bills"], _ROW_BILLS)
            and all(has_fields(t, _TIER_BILL) for t in r["bills"]["tiers"].values())
            and all(isinstance(r.get(k), str | None) for k in ("miss_reason", "local_reason"))
            and math.isfinite(r["time"]))


def _clock(wall: float) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(wall))
    except (OverflowError, ValueError, OSError):  # a time no clock shows (year 10000 and on)
        return "?"


def render_recent(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "recent requests: none yet"
    lines = ["recent requests (newest first; `kvstore explain ID` says why one missed):",
             f"  {'time':8s} {'request id':24s} {'tenant':10s} {'call':6s} {'case':7s} {'prompt':>7s} {'hit':>7s} "
             f"{'prefill':>7s} {'replay':>6s} {'moved':>10s}  why"]
    for r in rows:
        b = r["bills"]
        hit = sum(t["hit_tokens"] for t in b["tiers"].values())
        moved = sum(t["bytes"] for t in b["tiers"].values()) + b["local_bytes"]
        why = " · ".join(x.replace("_", " ") for x in (r.get("miss_reason"), r.get("local_reason")) if x)
        lines.append(f"  {_clock(r['time']):8s} {r['request_id']:24s} "
                     f"{r['tenant']:10s} {r['method']:6s} {r['case']:7s} {b['prompt_tokens']:7d} {hit:7d} "
                     f"{b['prefill_tokens']:7d} {b['replay_tokens']:6d} {_size(moved):>10s}  {why}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvstore.client.sync_client import KvstoreClient, RpcFailure

    if args.recent < 0:
        raise InvalidInput(f"--recent must be >= 0, got {args.recent}")
    # gRPC would take a past (or overflowed) deadline and fail the call with DEADLINE_EXCEEDED,
    # blaming the service.
    check_timeout(args.timeout, "--timeout")
    if args.recent:  # before the service is asked: its answer would be thrown away
        check_admin_url(args.admin, "--admin")

    token = args.token if args.token is not None else os.environ.get("KVSTORE_TOKEN") or None
    check_token(token, "--token" if args.token is not None else "KVSTORE_TOKEN")
    check_target(args.target, "--target")
    check_tls_ca(args.tls_ca, "--tls-ca")
    check_tls_client(args.tls_cert, args.tls_key, "--tls-cert", "--tls-key")
    with KvstoreClient(args.target, token=token, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                       tls_key=args.tls_key, timeout_seconds=args.timeout) as client:
        try:
            s = client.stats()
        except RpcFailure as e:
            print(f"kvstore stats: {args.target}: {e.code.name}: {e.details}", file=sys.stderr)
            return 2
    recent = recent_requests(args.admin, token, args.recent, args.timeout) if args.recent else None
    if args.json:
        json.dump({**s.as_dict(), **({"recent_requests": recent} if recent is not None else {})}, sys.stdout,
                  indent=2)
        print()
    else:
        print(render(s))
        if recent is not None:
            print(render_recent(recent))
    return 0
