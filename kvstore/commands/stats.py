"""`kvstore stats`: ask a running service for its statistics and print a readable summary.

Two tokens, one for each half, each from its flag or, better (it stays out of `ps`), its variable:
a tenant's (`--token`, `KVSTORE_TOKEN`) for the gRPC statistics, which are always a tenant's own,
and the admin token (`--admin-token`, `KVSTORE_ADMIN_TOKEN`, as `kvstore explain` reads it) for the
admin port (`--admin`), which gRPC refuses. `--recent N` lists the service's N most recent requests
(ids for `kvstore explain ID`, case and the three bills) from the admin port: every tenant's with
the admin token, else the tenant's own with its token. Given the admin token and no tenant's, where
the service has tenants, the gRPC half is skipped with one line on stderr and the admin port's view
of every tenant is printed instead (exit 0): what that token can see, rather than a refusal.
`--json` prints the same figures as JSON. A service that is not running is a one-line error.
"""

from __future__ import annotations

import argparse
import http.client
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.commands.admin_client import NotAnAdminPort, admin_get, has_fields, kvstore_error
from kvstore.commands.checks import (
    check_admin_url,
    check_target,
    check_timeout,
    check_token,
)
from kvstore.commands.json_out import dump_json
from kvstore.errors import InvalidInput
from kvstore.wire.tls_files import check_tls_ca, check_tls_client, check_tls_server_name

if TYPE_CHECKING:  # kvstore.client imports grpc: only `run` needs it, not the parser `kvstore --help` builds
    from kvstore.client.types import ServiceStats

TOKEN_ENV = "KVSTORE_TOKEN"
ADMIN_TOKEN_ENV = "KVSTORE_ADMIN_TOKEN"  # `kvstore explain`'s too


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the service")
    p.add_argument("--token", default=None,
                   help=f"a tenant's bearer token, for the gRPC statistics (default: ${TOKEN_ENV})")
    p.add_argument("--admin-token", default=None,
                   help=f"the admin token, for the admin port: --recent lists every tenant's requests, and "
                        f"without a tenant's token the admin port's view is shown (default: ${ADMIN_TOKEN_ENV})")
    p.add_argument("--tls-ca", metavar="FILE", help="CA certificate: use TLS")
    p.add_argument("--tls-cert", metavar="FILE", help="client certificate (mTLS)")
    p.add_argument("--tls-key", metavar="FILE", help="client key (mTLS)")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="the name the service's certificate carries, checked instead of the target's host")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--recent", type=int, default=0, metavar="N",
                   help="also list the N most recent requests: ids, case and bills (from the admin port)")
    p.add_argument("--admin", default="http://127.0.0.1:9400", metavar="URL",
                   help="the service's admin HTTP address, for --recent and --admin-token (default %(default)s)")


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
    return _recent_rows(admin_stats(admin_url, token, timeout), admin_url, token, limit)


def admin_stats(admin_url: str, token: str | None, timeout: float) -> dict[str, Any]:
    """The admin port's `/api/stats` document, as `token` may see it."""
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
        hint = (f" (the admin token: --admin-token or {ADMIN_TOKEN_ENV}; a tenant's: --token or {TOKEN_ENV})"
                if status == 401 else "")
        raise InvalidInput(f"--admin {admin_url}: HTTP {status}: {why}{hint}")
    if not has_fields(doc, _STATS):
        raise InvalidInput(f"--admin {admin_url}: not a kvstore admin port: its /api/stats answer is not kvstore's")
    return dict(doc)


def _no_admin(doc: dict[str, Any], token: str | None) -> str:
    """Why the admin port took this caller for no admin, said from its answer. A port with an admin
    token answers 401 to every token but that and tenants', so a 200 to anyone else means it has
    none: then only a loopback bind asked by a loopback name makes its callers the admin."""
    tenant = doc["viewer"].get("tenant")
    if isinstance(tenant, str):
        return f"the token sent is a tenant's ('{tenant}'), not the admin token"
    why = ("it has no admin token (admin.admin_token) and is bound beyond loopback (or was asked by a name "
           "that is not a loopback address), so no caller is its admin: set admin.admin_token and pass it "
           f"(--admin-token or {ADMIN_TOKEN_ENV})")
    if "withheld" in doc:  # an anonymous caller is withheld the sums only where the service has tenants
        why += ("; the token sent is no tenant's either" if token else
                f"; a tenant's token (--token or {TOKEN_ENV}) sees that tenant's")
    return why


def _recent_rows(doc: dict[str, Any], admin_url: str, token: str | None, limit: int) -> list[dict[str, Any]]:
    rows = doc.get("recent_requests")
    if rows is None:
        who = "the admin and to tenants (each its own)" if "withheld" in doc else "its admin only"
        raise InvalidInput(f"--admin {admin_url}: recent requests are shown to {who}: " + _no_admin(doc, token))
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


# What `render_admin` reads of an admin's `/api/stats`, by type.
_SUMS = {"requests": int, "cases": dict, "prompt_tokens": int, "hit_tokens": dict}
_CASES = {"cold": int, "warm": int, "expired": int}
_STORE = {"tiers": dict, "lookups": int, "lookup_hit_tokens": int, "lookup_miss_tokens": int, "token_mismatches": int,
          "corrupt_reads": int, "pins_active": int, "pins_expired": int, "evictions_by_reason": dict}
_STORE_TIER = {"backend": str, "used_bytes": int, "capacity_bytes": int, "entries": int, "evictions": int,
               "corrupt_total": int}


def _is_sums(d: Any) -> bool:
    return (has_fields(d, _SUMS) and has_fields(d["cases"], _CASES)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in d["hit_tokens"].values()))


def _is_store(d: Any) -> bool:
    return has_fields(d, _STORE) and all(has_fields(t, _STORE_TIER) for t in d["tiers"].values())


def _part(doc: dict[str, Any], name: str, ok: Callable[[Any], bool], admin_url: str) -> dict[str, Any] | str:
    """One part of an admin's `/api/stats`, or why it is missing: kvstore's answers null for a part
    the service does not have and {"error": ...} for one it could not read, and the rest is shown."""
    part: Any = doc.get(name)
    if ok(part):
        return dict(part)
    if part is None:
        return "none"
    if isinstance(part, dict) and list(part) == ["error"] and isinstance(part["error"], str):
        return f"could not be read: {part['error']}"
    raise InvalidInput(f"--admin {admin_url}: not a kvstore admin port: its /api/stats {name} is not kvstore's")


def _hits(hit: int, of: int) -> str:
    return f"{hit} of {of} tokens hit ({100 * hit / of if of else 0.0:.1f}%)"


def render_admin(doc: dict[str, Any], admin_url: str) -> str:
    """The admin port's view of every tenant (an admin's `/api/stats`), laid out as `render` lays out
    a tenant's gRPC statistics. Raises InvalidInput where the answer is not kvstore's."""
    totals = _part(doc, "totals", lambda d: _is_sums(d) and has_fields(d, {"uptime_seconds": (int, float)}),
                   admin_url)
    store = _part(doc, "store", _is_store, admin_url)
    pool = _part(doc, "pool", lambda d: has_fields(d, {"backend": str}), admin_url)
    health = _part(doc, "pool_health", lambda d: has_fields(d, {"status": str, "reason": str}), admin_url)
    replay = _part(doc, "replay", lambda d: has_fields(d, {"runners_attached": int})
                   and isinstance(d.get("coordinator"), bool), admin_url)
    tenants = _part(doc, "tenants", lambda d: isinstance(d, dict) and all(_is_sums(v) for v in d.values()), admin_url)
    if isinstance(totals, str):  # the ledger's, always there: not kvstore's when missing
        raise InvalidInput(f"--admin {admin_url}: not a kvstore admin port: its /api/stats totals is not kvstore's")
    lines = [f"kvstore {doc['version']} — up {totals['uptime_seconds']:.0f} s — the admin port's view, "
             f"every tenant ({admin_url})"]
    if isinstance(store, str):
        lines.append(f"store: {store}")
    else:
        lines.append(f"{'tier':8s} {'backend':8s} {'used':>11s} {'capacity':>11s} {'use':>5s} {'chunks':>8s} "
                     f"{'evicted':>8s} {'corrupt':>7s}")
        for name, t in store["tiers"].items():
            pct = 100 * t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
            lines.append(f"{name:8s} {t['backend'] or '-':8s} {_size(t['used_bytes']):>11s} "
                         f"{_size(t['capacity_bytes']):>11s} {pct:4.0f}% {t['entries']:8d} {t['evictions']:8d} "
                         f"{t['corrupt_total']:7d}")
        lines.append(f"lookups {store['lookups']}: "
                     f"{_hits(store['lookup_hit_tokens'], store['lookup_hit_tokens'] + store['lookup_miss_tokens'])}, "
                     f"{store['token_mismatches']} token mismatches, {store['corrupt_reads']} corrupt reads; "
                     f"pins {store['pins_active']} active, {store['pins_expired']} expired")
    c = totals["cases"]
    lines.append(f"requests {totals['requests']}: {c['cold']} cold, {c['warm']} warm, {c['expired']} expired; "
                 f"prompt {_hits(sum(totals['hit_tokens'].values()), totals['prompt_tokens'])}")
    if isinstance(pool, str):
        lines.append(f"local pool: {pool}")
    elif isinstance(health, str):
        lines.append(f"local pool: {pool['backend']} (health {health})")
    else:
        lines.append(f"local pool: {pool['backend']} ({'healthy' if health['status'] == 'ok' else 'DEGRADED'}"
                     + (f": {health['reason']}" if health["reason"] else "") + ")")
    lines.append(f"replay: {replay}" if isinstance(replay, str) else
                 f"replay: coordinator {'on' if replay['coordinator'] else 'off'}, "
                 f"{replay['runners_attached']} runner(s) attached")
    if not isinstance(store, str) and store["evictions_by_reason"]:
        lines.append("evictions by reason: "
                     + ", ".join(f"{k} {v}" for k, v in sorted(store["evictions_by_reason"].items())))
    if isinstance(tenants, str) or not tenants:
        lines.append(f"tenants: {tenants if isinstance(tenants, str) else 'no requests yet'}")
    else:
        lines.append("tenants:")
        for name, t in sorted(tenants.items()):
            c = t["cases"]
            lines.append(f"  {name:10s} {t['requests']:6d} requests: {c['cold']} cold, {c['warm']} warm, "
                         f"{c['expired']} expired; prompt {_hits(sum(t['hit_tokens'].values()), t['prompt_tokens'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvstore.client.sync_client import KvstoreClient, RpcFailure, UnauthenticatedError

    if args.recent < 0:
        raise InvalidInput(f"--recent must be >= 0, got {args.recent}")
    # gRPC would take a past (or overflowed) deadline and fail the call with DEADLINE_EXCEEDED,
    # blaming the service.
    check_timeout(args.timeout, "--timeout")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    check_token(token, "--token" if args.token is not None else TOKEN_ENV)
    admin_flag = "--admin-token" if args.admin_token is not None else ADMIN_TOKEN_ENV
    admin_token = args.admin_token if args.admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV) or None
    check_token(admin_token, admin_flag)
    if token is not None and token == admin_token:
        # A config refuses an admin token that is also a tenant's, so this one is no tenant's and gRPC
        # would refuse it: given as both, it goes to the admin port only.
        token = None
    if args.recent or admin_token is not None:  # before the service is asked: its answer would be thrown away
        check_admin_url(args.admin, "--admin")
    check_target(args.target, "--target")
    check_tls_ca(args.tls_ca, "--tls-ca")
    check_tls_client(args.tls_cert, args.tls_key, "--tls-cert", "--tls-key")
    check_tls_server_name(args.tls_server_name, "--tls-server-name", bool(args.tls_ca or args.tls_cert))
    s: ServiceStats | None = None
    with KvstoreClient(args.target, token=token, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                       tls_key=args.tls_key, tls_server_name=args.tls_server_name,
                       timeout_seconds=args.timeout) as client:
        try:
            s = client.stats()
        except RpcFailure as e:
            # Only the admin token given: where the service has tenants, gRPC has nothing for it.
            if not (isinstance(e, UnauthenticatedError) and token is None and admin_token is not None):
                hint = (f" (a tenant's token: --token or {TOKEN_ENV}; the admin token, which gRPC refuses, for the "
                        f"admin port's view of every tenant: --admin-token or {ADMIN_TOKEN_ENV})"
                        if isinstance(e, UnauthenticatedError) else "")
                print(f"kvstore stats: {args.target}: {e.code.name}: {e.details}{hint}", file=sys.stderr)
                return 2
    if s is None:
        assert admin_token is not None
        return _admin_view(args, admin_token, admin_flag)
    # The admin token sees every tenant's recent requests; a tenant's, that tenant's own.
    recent = recent_requests(args.admin, admin_token or token, args.recent, args.timeout) if args.recent else None
    if args.json:
        dump_json({**s.as_dict(), **({"recent_requests": recent} if recent is not None else {})}, sys.stdout)
    else:
        print(render(s))
        if recent is not None:
            print(render_recent(recent))
    return 0


def _admin_view(args: argparse.Namespace, admin_token: str, admin_flag: str) -> int:
    """`kvstore stats` with the admin token alone, at a service with tenants: the admin port's view of
    every tenant, and one line on stderr for the gRPC half skipped (a refusal would show nothing
    the token can see)."""
    doc = admin_stats(args.admin, admin_token, args.timeout)
    if doc["viewer"].get("admin") is not True:
        raise InvalidInput(f"{args.target}: the gRPC statistics need a tenant's token (--token or {TOKEN_ENV}), "
                           f"and the admin port ({args.admin}) did not take {admin_flag} for the admin's: "
                           + _no_admin(doc, admin_token))
    text = render_admin(doc, args.admin)  # checked whole before anything is printed
    recent = _recent_rows(doc, args.admin, admin_token, args.recent) if args.recent else None
    print(f"kvstore stats: {args.target}: the gRPC statistics are a tenant's own and refuse the admin token: "
          f"skipped (pass a tenant's token, --token or {TOKEN_ENV}, for them); below, the admin port's view",
          file=sys.stderr)
    if args.json:
        view = {k: v for k, v in doc.items() if k != "recent_requests"}
        dump_json({"admin_stats": view, **({"recent_requests": recent} if recent is not None else {})}, sys.stdout)
    else:
        print(text)
        if recent is not None:
            print(render_recent(recent))
    return 0
