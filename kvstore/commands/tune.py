"""`kvstore tune ttl`: evaluate local-state TTLs offline against a recorded (or synthetic) trace.

Prints, per candidate TTL and semantics (fixed, sliding): the local hit rate, replay tokens spent,
byte-seconds held in the pool and the total cost; then the least-cost TTL of each semantics (each
found by its own search, said to be an estimate where that search was one), which of the two to set
and by how much it is the cheaper (`--json`: `recommended`, its `kind` and `ttl_seconds`), and what
the adaptive policy would do. Costs and clamps come from `[local_pool.ttl]` of `--config` (or the defaults),
overridden by flags. Progress (each phase as it starts) goes to stderr so `--json` output stays clean,
and nowhere where stderr is closed. A trace file is read as a stream into numpy columns, never held
as records: the peak is ~250 B a request (the columns and the evaluation's arrays over them). Per-tenant TTL overrides
in the config are not applied (every tenant is priced at each row's TTL); the report says so. A trace
that cannot see its returns (few requests with a global hit follow a write or request of their
session) gets a warning, on stderr and in the report, and its recommendation is not called exact.

Each TTL's peak and mean bytes held are printed too. Where the pool's capacity is known (the config's
`local_pool.capacity_bytes` where `--config` names an embedded pool, or `--pool-capacity-bytes`), a
TTL whose peak exceeds it is marked (the pool would evict: its hits are an upper bound) and the
recommendation is the least-cost TTL found that fits; where none fits, a warning names the peak the
pool would need. Else the report says the capacity was not checked.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

from kvstore.commands.checks import check_not_empty
from kvstore.commands.json_out import dump_json
from kvstore.config import load_config
from kvstore.config.fields import MAX_CAPACITY_BYTES
from kvstore.config.local_pool import ENTRY_OVERHEAD_BYTES, MAX_COST, MAX_TTL_SECONDS, LocalPoolConfig
from kvstore.config.store import MAX_CHUNK_TOKENS
from kvstore.errors import InvalidInput
from kvstore.layout import MAX_ENGINE_SNAPSHOT_BYTES, get_model
from kvstore.observe.trace_file import TraceRecord, read_trace, save_trace, synthetic_trace
from kvstore.observe.ttl_tuning import (
    DEFAULT_TTLS_SECONDS,
    MAX_EXACT_RUN_REQUESTS,
    TtlCostModel,
    TtlEvaluation,
    TuneReport,
    columns_from_records,
    tune_ttl,
)

# A trace file this long reports its progress to stderr every this many requests read.
PROGRESS_EVERY_REQUESTS = 1_000_000
# A synthetic trace is held in memory whole: 5M requests take ~1.7 GB (a larger N ran out of memory).
MAX_SYNTHETIC_REQUESTS = 5_000_000
# One replay's tokens: an exact replay is L(W-1)+1 (kvstore.layout.exact_replay_tokens), a few
# thousand for the models here; this leaves room for any registered model's.
MAX_REPLAY_TOKENS = 1 << 24


def _ttl_list(text: str) -> tuple[float, ...]:
    try:
        ttls = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated seconds, e.g. 30,60,300; got {text!r}"
        ) from None
    # float() takes "inf" and "nan": neither is a TTL, and --json cannot print them. Past the
    # config's bound a TTL is none the service takes, and its byte-seconds can overflow.
    if not ttls or any(not (0 < t <= MAX_TTL_SECONDS) for t in ttls):
        raise argparse.ArgumentTypeError(
            f"TTLs must be finite numbers of seconds > 0 and <= {MAX_TTL_SECONDS:.0f}, got {text!r}"
        )
    return ttls


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tune_what", metavar="WHAT")
    p = sub.add_parser(
        "ttl", help="replay a trace under candidate local-state TTLs",
        description="Replay a request trace under candidate local-state TTLs (fixed and sliding) and "
                    "print hit rate, replay tokens, byte-seconds held and cost for each.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="a JSON-lines trace recorded by the service")
    src.add_argument("--synthetic", metavar="N", type=int,
                     help=f"generate an N-request synthetic trace instead (at most {MAX_SYNTHETIC_REQUESTS:,})")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace, >= 0 (default 0)")
    p.add_argument("--save-trace", metavar="FILE", help="with --synthetic: also write the trace to FILE")
    p.add_argument("--ttl", type=_ttl_list, default=DEFAULT_TTLS_SECONDS, metavar="S,S,...",
                   help="candidate TTLs in seconds (default "
                        + ",".join(f"{t:g}" for t in DEFAULT_TTLS_SECONDS) + ")")
    p.add_argument("--model", default="deepseek-v4.1-flash",
                   help="model whose snapshot size and replay window are the defaults (default %(default)s)")
    p.add_argument("--snapshot-bytes", type=int, metavar="N",
                   help="bytes per local snapshot, for every request "
                        "(default: the trace's, else the model's)")
    p.add_argument("--replay-tokens", type=int, metavar="N",
                   help="tokens one replay runs, for every request "
                        "(default: the trace's, else the model's window)")
    p.add_argument("--chunk-tokens", type=int, default=128, metavar="N",
                   help="chunk size: prefixes are cut to chunk boundaries (default %(default)s)")
    p.add_argument("--config", metavar="FILE",
                   help="take costs and clamps from this config's [local_pool.ttl]")
    p.add_argument("--replay-cost-per-token", type=float, metavar="X",
                   help="cost of one replayed token (default: the config's)")
    p.add_argument("--hold-cost-per-byte-second", type=float, metavar="X",
                   help="cost of holding one byte for one second (default: the config's)")
    p.add_argument("--pool-capacity-bytes", type=int, metavar="N",
                   help="the local pool's room: TTLs whose peak held exceeds it are marked and not recommended "
                        "(default: the config's local_pool.capacity_bytes where --config names an embedded pool, "
                        "else not checked)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "tune_what", None) != "ttl":
        _say("kvstore tune: say what to tune: `kvstore tune ttl --trace FILE`")
        return 2
    # '' was read as the current directory, or (--save-trace) as the flag left out: exit 0, no file.
    for flag, path in (("--trace", args.trace), ("--config", args.config), ("--save-trace", args.save_trace)):
        check_not_empty(path, flag, "file")
    cfg = load_config(args.config)
    ttl_cfg = cfg.local_pool.ttl
    # The service gives these tenants their own TTL; the evaluation prices every tenant alike.
    overridden = set(ttl_cfg.tenant_ttl_seconds) | {n for n, t in cfg.tenants.items() if t.local_ttl_seconds > 0}
    if args.replay_cost_per_token is not None:
        ttl_cfg = replace(ttl_cfg, replay_cost_per_token=args.replay_cost_per_token)
    if args.hold_cost_per_byte_second is not None:
        ttl_cfg = replace(ttl_cfg, hold_cost_per_byte_second=args.hold_cost_per_byte_second)
    for key in ("replay_cost_per_token", "hold_cost_per_byte_second"):  # a flag named as such
        v = getattr(args, key)
        if v is not None and v > MAX_COST:
            raise InvalidInput(f"--{key.replace('_', '-')} must be at most {MAX_COST:g} (larger costs overflow "
                               f"the totals), got {v:g}")
    ttl_cfg.validate("local_pool.ttl")
    # Upper bounds too: numpy's int64 columns overflow on a larger chunk size (an OverflowError), and
    # a snapshot or replay past what any model registers gives costs of no meaning.
    for flag, most in (("snapshot_bytes", MAX_ENGINE_SNAPSHOT_BYTES), ("replay_tokens", MAX_REPLAY_TOKENS),
                       ("synthetic", None)):
        v = getattr(args, flag)
        if v is not None and v < 0:
            raise InvalidInput(f"--{flag.replace('_', '-')} must be >= 0, got {v}")
        if v is not None and most is not None and v > most:
            raise InvalidInput(f"--{flag.replace('_', '-')} must be at most {most:,}, got {v:,}")
    if not 0 < args.chunk_tokens <= MAX_CHUNK_TOKENS:
        raise InvalidInput(f"--chunk-tokens must be 1 to {MAX_CHUNK_TOKENS:,} (store.chunk_tokens' bound), "
                           f"got {args.chunk_tokens:,}")
    if args.synthetic == 0:  # else "synthetic trace (seed 0) holds no requests", naming no flag
        raise InvalidInput("--synthetic must be at least 1 (requests to generate), got 0")
    if args.synthetic is not None and args.synthetic > MAX_SYNTHETIC_REQUESTS:
        raise InvalidInput(f"--synthetic must be at most {MAX_SYNTHETIC_REQUESTS:,} (it is held in memory whole, "
                           f"~350 bytes a request), got {args.synthetic:,}")
    if args.synthetic is not None and args.seed < 0:  # numpy takes no negative seed
        raise InvalidInput(f"--seed must be >= 0, got {args.seed}")
    if args.save_trace is not None and args.synthetic is None:
        raise InvalidInput("--save-trace needs --synthetic")
    capacity, pool_from = _pool_capacity(args.pool_capacity_bytes, args.config, cfg.local_pool)
    layout = get_model(args.model).layout

    started = time.perf_counter()
    records: Iterable[TraceRecord]
    on_progress: Callable[[int], None] | None = None
    if args.synthetic is not None:
        _say(f"kvstore tune: generating a synthetic trace of {args.synthetic:,} requests")
        records = synthetic_trace(args.synthetic, seed=args.seed)
        source = f"synthetic trace (seed {args.seed})"
        if args.save_trace is not None:
            _say(f"kvstore tune: saving it to {args.save_trace} ({time.perf_counter() - started:.0f} s)")
            save_trace(args.save_trace, records)
    else:
        records = read_trace(args.trace)
        source = args.trace
        on_progress = _progress(source, started)
    # A client's pre-check Lookup or a probe is a call, not a request: evaluating it would count a
    # return that never happened (kvstore/wire/purposes.py).
    side = [0]
    force = args.snapshot_bytes is not None or args.replay_tokens is not None
    cols = columns_from_records(
        _requests_only(records, side), args.chunk_tokens,
        layout.local_snapshot_bytes if args.snapshot_bytes is None else args.snapshot_bytes,
        layout.local.window_tokens if args.replay_tokens is None else args.replay_tokens,
        force_sizes=force, on_progress=on_progress,
    )
    del records
    side_calls = side[0]
    left_out = f" ({side_calls:,} pre-check or probe lookups left out: not requests)" if side_calls else ""
    reads, unmatched = cols.read_time.shape[0] + cols.reads_idle, cols.reads_unmatched
    read_lines = f", {reads:,} LoadLocal reads" if reads or unmatched else ""
    if unmatched:
        read_lines += f" ({unmatched:,} more left out: no request of their session at or before them)"
    writes = int((~cols.is_request).sum())
    write_lines = f", {writes:,} StoreLocal writes" if writes else ""
    if cols.writes_unlinked:
        write_lines += f" ({cols.writes_unlinked:,} StoreLocal writes left out: in other sessions than the requests)"
    _say(f"kvstore tune: {cols.requests} requests{read_lines}{write_lines} from {source}{left_out} in "
         f"{time.perf_counter() - started:.2f} s")
    if cols.requests == 0:
        raise InvalidInput(f"{source} holds no requests")
    cost = TtlCostModel(ttl_cfg.replay_cost_per_token, ttl_cfg.hold_cost_per_byte_second,
                        ttl_cfg.min_ttl_seconds, ttl_cfg.max_ttl_seconds, pool_capacity_bytes=capacity,
                        pool_entry_overhead_bytes=ENTRY_OVERHEAD_BYTES if cfg.local_pool.url == "embedded" else 0)
    report = tune_ttl(cols, args.ttl, cost, ttl_cfg,
                      on_phase=lambda what: _say(f"kvstore tune: {what} ({time.perf_counter() - started:.0f} s)"))
    not_applied = sorted(overridden & set(report.tenants))
    if report.returns_unseen:
        _say(f"kvstore tune: warning: the trace cannot see returns: {report.returns_unseen}; its recommendation "
             "cannot be trusted (the least-cost TTL of a trace without returns is the shortest)")
    if report.capacity_warning:
        _say(f"kvstore tune: warning: {report.capacity_warning}")
    if args.json:
        doc = report.as_dict()
        doc["side_calls_left_out"] = side_calls
        doc["tenant_ttl_overrides_not_applied"] = not_applied
        pool = doc["pool"]
        assert isinstance(pool, dict)
        pool["from"] = pool_from
        dump_json(doc, sys.stdout)
    else:
        print(format_report(report, side_calls, not_applied, pool_from))
    return 0


def _pool_capacity(flag: int | None, config: str | None, pool: LocalPoolConfig) -> tuple[int | None, str]:
    """The pool's capacity to check TTLs against (None: not known), and where it came from or why
    it is not known."""
    if flag is not None:
        if not 1 <= flag <= MAX_CAPACITY_BYTES:
            raise InvalidInput(f"--pool-capacity-bytes must be 1 to {MAX_CAPACITY_BYTES:,} (the pool's room in "
                               f"bytes; local_pool.capacity_bytes' bound), got {flag:,}")
        return flag, "--pool-capacity-bytes"
    if config is None:
        return None, "not checked: no --config or --pool-capacity-bytes"
    if pool.url != "embedded":  # Redis's room is its server's maxmemory, which no config here names
        return None, ("not checked: the config's pool is Redis (its room is the server's maxmemory): "
                      "pass --pool-capacity-bytes")
    return pool.capacity_bytes, f"{config}'s local_pool.capacity_bytes"


def _requests_only(records: Iterable[TraceRecord], side: list[int]) -> Iterator[TraceRecord]:
    """The records that are requests, streamed; counts the others into `side[0]`."""
    for r in records:
        if r.purpose:
            side[0] += 1
        else:
            yield r


def _progress(source: str, started: float) -> Callable[[int], None]:
    """A line on stderr each time another `PROGRESS_EVERY_REQUESTS` requests have been read."""
    shown = [0]

    def report(n: int) -> None:
        if n // PROGRESS_EVERY_REQUESTS > shown[0]:
            shown[0] = n // PROGRESS_EVERY_REQUESTS
            _say(f"kvstore tune: {n:,} requests read from {source} ({time.perf_counter() - started:.0f} s)")

    return report


def _say(line: str) -> None:
    """A progress or status line on stderr; none where stderr is closed (print() would then write
    it to stdout, into the report or its JSON)."""
    if sys.stderr is not None:
        print(line, file=sys.stderr, flush=True)


def _seconds(x: float) -> str:
    """A TTL as set in a config: to the millisecond (the least-cost one sits just past a gap)."""
    return f"{x:.3f}".rstrip("0").rstrip(".")


def _size(n: float) -> str:
    """Bytes as a person reads them: 1,023 B, 33.0 KiB, 922.4 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _row(r: TtlEvaluation, c: TtlCostModel) -> str:
    ttl = "adaptive" if r.ttl_seconds is None else _seconds(r.ttl_seconds)
    fits = {None: "-", True: "fits", False: "OVER"}[c.fits(r)]
    rate = f"{r.local_hit_rate:.1%}" if r.eligible else "-"  # no request could hit (e.g. no local state)
    return (f"{ttl:>9} {r.semantics:<9} {rate:>8} {r.replays:>9,} {r.replay_tokens:>14,} "
            f"{r.byte_seconds:>14.4g} {_size(r.peak_bytes):>11} {_size(r.mean_bytes):>11} {fits:>4} "
            f"{r.replay_cost:>12.4g} {r.hold_cost:>12.4g} {r.total_cost:>12.4g}")


# What each search's "estimate" means, where it was one.
_ESTIMATED = {
    "fixed": f"same-boundary runs of more than {MAX_EXACT_RUN_REQUESTS:,} requests, or past the search's budget, "
             "were priced at a sample of TTLs",
    "sliding": "retries rewrote snapshots of other sizes than their boundary's write, priced at that write's size, "
               "or some hits were Lookups' (which restart no TTL) or LoadLocals read after requests that could hit, "
               "priced as if every hit restarted one",
}


def _labelled(rep: TuneReport) -> list[str]:
    """The recommendations, each with what it is and why it is listed, cheapest first, then which
    one to set and by how much it is the cheaper; an estimate said to be one."""
    items = [
        ("sliding", "the TTL that minimises total cost under sliding semantics (a write, or a read that takes "
         "the snapshot, restarts it): kind = \"sliding\"", rep.best_sliding),
        ("fixed", "the TTL that minimises total cost when a snapshot lives it from its write only (a read does "
         "not keep it longer), found by its own search: kind = \"fixed\"", rep.best_fixed),
    ]
    items.sort(key=lambda x: x[2] is not rep.recommended)
    out = []
    for kind, why, r in items:
        how = rep.search(r)
        gone = rep.excluded(r)
        if how == "capacity" and gone is not None and gone.ttl_seconds is not None:
            out += [f"  {kind} at the least-cost TTL found that fits the pool ({_seconds(gone.ttl_seconds)} s, its "
                    f"search's least-cost{'' if rep.exact(r) else ' estimate'}, would hold a peak of "
                    f"{_size(gone.peak_bytes)}: over; the longest TTL that fits was sought by bisection on the "
                    "peak, taken to grow with the TTL, and the search's cheapest at or below it evaluated, so a "
                    f"cheaper {kind} TTL that fits may exist): {why}", _row(r, rep.cost)]
        elif how == "none_fits":
            found = "its least-cost TTL" if rep.exact(r) else (
                f"the least-cost TTL its search found (an estimate: {_ESTIMATED[kind]})")
            out += [f"  {kind} at {found}, though the pool is too small for it (and for every {kind} TTL "
                    f"evaluated): {why}", _row(r, rep.cost)]
        elif how == "exact":
            out += [f"  {kind} at its least-cost TTL: {why}", _row(r, rep.cost)]
        else:
            out += [f"  {kind} at the least-cost TTL its search found (an estimate: {_ESTIMATED[kind]}; a cheaper "
                    f"{kind} TTL may exist): {why}", _row(r, rep.cost)]
    best, other = rep.recommended, rep.runner_up
    assert best.ttl_seconds is not None and other.ttl_seconds is not None
    saves = other.total_cost - best.total_cost
    share = f" ({saves / other.total_cost:.1%})" if other.total_cost > 0 else ""
    estimate = "" if rep.fixed_exact and rep.sliding_exact else " (an estimate: see above)"
    if rep.fixed_excluded is not None or rep.sliding_excluded is not None:
        estimate = " (the least-cost found that fits the pool: see above)"
    if rep.capacity_warning:
        estimate = " (the pool is too small for it: see above)"
    if rep.returns_unseen:
        estimate = " (not to be trusted: the trace cannot see returns, see above)"
    than = f"{saves:.6g} less{share} than {other.semantics} at its best ({_seconds(other.ttl_seconds)} s)"
    if saves < 0:  # the other costs less, but only the recommended one fits the pool
        than = (f"{-saves:.6g} more than {other.semantics} at its best ({_seconds(other.ttl_seconds)} s), which does "
                "not fit the pool")
    out.append(f"recommended: kind = \"{best.semantics}\", ttl_seconds = {_seconds(best.ttl_seconds)}: total cost "
               f"{best.total_cost:.6g}, {than}{estimate}")
    return out


def _break_even(seconds: float) -> str:
    if math.isfinite(seconds):
        return f"break-even hold {seconds:,.0f} s (holding one snapshot that long costs one replay)"
    return "no break-even hold: holding a snapshot costs nothing (zero-byte snapshots)"


def _pool_line(rep: TuneReport, pool_from: str) -> str:
    """What the rows' peaks were checked against, or that they were not."""
    c = rep.cost
    counted = (f", each snapshot counted with the pool's {c.pool_entry_overhead_bytes:,} B per entry"
               if c.pool_entry_overhead_bytes else "")
    if c.pool_capacity_bytes is None:
        return (f"pool: capacity {pool_from or 'not checked'}; peak_held and mean_held are the bytes the pool "
                f"would hold at most and on average{counted}, were it never full")
    source = pool_from or "the caller"
    return (f"pool: capacity {_size(c.pool_capacity_bytes)} ({c.pool_capacity_bytes:,} B, from {source}){counted}; "
            "a row marked OVER holds more at its peak: the pool would evict, so its hits are an upper bound, and it "
            "is not recommended")


def format_report(
    rep: TuneReport, side_calls: int = 0, overrides_not_applied: Sequence[str] = (), pool_from: str = "",
) -> str:
    """The report as text; `side_calls`: pre-check and probe lookups left out of the trace;
    `overrides_not_applied`: tenants of the trace that the config gives their own TTL; `pool_from`:
    where the pool's capacity came from, or why it was not checked."""
    c = rep.cost
    left_out = f" ({side_calls:,} pre-check/probe lookups left out)" if side_calls else ""
    linked = "write" if rep.store_local_writes else "request"
    lines = [
        f"trace: {rep.requests:,} requests{left_out}, {rep.sessions:,} sessions, {len(rep.tenants)} tenant(s); "
        f"{rep.linked_returns:,} of {rep.global_hits:,} with a global hit were returns that could hit locally "
        f"(after an earlier {linked} of their session); "
        f"{rep.same_boundary_requests:,} at an unchanged boundary"
        + (f"; {rep.load_local_reads:,} LoadLocal reads (no requests: under sliding semantics each that follows a "
           "hit restarts the TTL of the snapshot that hit found, if still alive; a Lookup's hit itself restarts none)"
           if rep.load_local_reads else "")
        + (f"; {rep.store_local_writes:,} StoreLocal writes (no requests: each snapshot's TTL runs from its write, "
           "and a request writes only where it replays)" if rep.store_local_writes else ""),
        f"cost: {c.replay_cost_per_token:g} per replayed token, "
        f"{c.hold_cost_per_byte_second:g} per byte-second held; " + _break_even(rep.break_even_seconds),
        _pool_line(rep, pool_from),
    ]
    if rep.store_local_writes_unlinked:
        lines.append(f"note: {rep.store_local_writes_unlinked:,} StoreLocal writes left out: they name other sessions "
                     "than the requests (send the same x-session-id on both), so each request is taken to write at its "
                     "own time, as in a trace without them")
    if rep.returns_unseen:
        lines.append(f"warning: the trace cannot see returns: {rep.returns_unseen}; the recommendation below cannot "
                     "be trusted (the least-cost TTL of a trace without returns is the shortest)")
    if rep.capacity_warning:
        lines.append(f"warning: {rep.capacity_warning}")
    if rep.load_local_reads_unmatched:
        # Most often an engine that names its session on Lookup but not on LoadLocal: the read's session
        # is then derived from its prompt and matches none of the requests.
        lines.append(f"note: {rep.load_local_reads_unmatched:,} LoadLocal reads left out: no request of their "
                     "(tenant, model, session) at or before them; pass the Lookup's session to LoadLocal "
                     "(`x-session-id`, the client's `load_local(session=)`)")
    if overrides_not_applied:
        lines.append("note: the config's per-tenant TTLs (tenant_ttl_seconds, [tenants.X] local_ttl_seconds) are not "
                     f"applied here: {', '.join(overrides_not_applied)} priced at each row's TTL like every tenant")
    lines += [
        "",
        f"{'ttl_s':>9} {'semantics':<9} {'hit_rate':>8} {'replays':>9} {'replay_tokens':>14} "
        f"{'byte_seconds':>14} {'peak_held':>11} {'mean_held':>11} {'pool':>4} {'replay_cost':>12} "
        f"{'hold_cost':>12} {'total_cost':>12}",
    ]
    lines += [_row(r, c) for r in rep.rows]
    lines += [
        "",
        f"recommended TTLs (within [{_seconds(c.min_ttl_seconds)}, {_seconds(c.max_ttl_seconds)}] s), cheapest first:",
        *_labelled(rep),
        "adaptive policy over this trace (sliding, TTL learned per tenant):",
        _row(rep.adaptive, c),
        "  final TTL per tenant: "
        + ", ".join(f"{t} {v:,.0f} s" for t, v in sorted(rep.adaptive_final_ttl_seconds.items())),
    ]
    return "\n".join(lines)
