"""`kvstore demo [--json] [--target ADDR]`: play one agent session through the service and show
what the cold, warm and expired requests cost (see `kvstore/workload/demo.py` for what happens).

Human output: what the three cases mean, progress, a table per case as it finishes, and a side
by side summary. `--json`: the report as JSON on stdout, progress on stderr.

Exit status: 0 when every case happened as it should; 1 when one did not (a cold request that
found the prompt cached, a warm one without its local snapshot, an expired one the service did not
replay: a failed service, a pool down, no runner) or the sessions of a case disagreed: the failed
case's table, then one line on stderr saying which case, in which session, why, and how the
service's pool and replay looked; 2 for a flag or config that cannot work (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.commands.checks import check_not_empty, check_target, check_token
from kvstore.errors import InvalidInput, KvstoreError
from kvstore.layout import TIER_NAMES

if TYPE_CHECKING:  # the demo module loads grpc; `kvstore --help` should not
    from kvstore.workload.demo import CaseReport, DemoOptions, DemoReport

INTRO = """\
kvstore demo: one agent session, three requests, through the real gRPC service and client.
  cold     the first request: nothing is cached, so the engine prefills every token, then stores
           the global KV chunks and the local sliding-window snapshot.
  warm     the next turn, within the local TTL: the global chunks and the local snapshot come back,
           and only the new tokens are prefilled. Same result as prefilling everything.
  expired  a turn after the local TTL: the global chunks still hit but the local snapshot is gone,
           so the service replays the last W cached tokens to rebuild it (a bounded replay),
           instead of the engine prefilling the whole prefix again.
Each resumed request is checked against a cold run of the same tokens (greedy next tokens).
The session is played a few times (--repeats); each case is shown from its median session."""

EXIT_CASE_FAILED = 1  # a case did not happen as it should (see the module's docstring)
# Upper bounds of the counts: the model runs a whole prompt at once (replay-quality's bounds: 32,768
# tokens and 4,096 more took ~0.9 GB), and a larger one ran out of memory with a traceback, or
# decoded and repeated for days.
MOST = {"prompt_tokens": 32_768, "turn_tokens": 4_096, "reply_tokens": 4_096, "repeats": 1_000}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("exit status: 0 when every case happened as it should; 1 when a case did not (the service "
                "failed, or already held the prompt) or the sessions disagreed; 2 for a bad flag or config")
    p.add_argument("--json", action="store_true", help="print the report as JSON (progress goes to stderr)")
    p.add_argument("--target", metavar="ADDR", help="use a running service at host:port instead of starting one")
    p.add_argument("--token", metavar="TOKEN", help="bearer token for --target")
    p.add_argument("--data-dir", metavar="DIR", help="embedded service: keep LMDB here (default: a temp dir)")
    p.add_argument("--prompt-tokens", type=int, default=6000, metavar="N",
                   help="first prompt length (6000; at least one chunk, 128 tokens; at most 32,768)")
    p.add_argument("--turn-tokens", type=int, default=368, metavar="N",
                   help="tokens each later turn adds besides the reply (368; at most 4,096)")
    p.add_argument("--reply-tokens", type=int, default=16, metavar="N",
                   help="tokens decoded after each request and compared with a cold run (16; at most 4,096)")
    p.add_argument("--replay-mode", default="bounded", choices=("bounded", "exact"))
    p.add_argument("--seed", type=int, help="token seed in [0, 2**32) (default: 0 embedded, random with --target; "
                   "salted when --data-dir holds an earlier run's data)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="CPU threads for the model, 0 to 256 (0: 1 per 4 CPUs, 1 to 4; more mostly waits on a "
                        "small model)")
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="sessions to play, at most 1,000; each case is shown from its median session (3)")


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _loaded(c: CaseReport) -> str:
    b = c.bytes_loaded
    return " · ".join(f"{t} {_bytes(b.get(t, 0))}" for t in ("device", "dram", "lmdb", "local"))


def _agreement(c: CaseReport) -> str:
    if c.compared_tokens == 0:
        return "(this is the cold run)" if c.case == "cold" else "(not compared)"
    hits = round(c.top1_agreement * c.compared_tokens)
    text = (f"top-1 {hits}/{c.compared_tokens} ({c.top1_agreement:.0%}), "
            f"max |Δlogit| {c.max_abs_logit_delta:.3g}")
    n = len(c.top1_agreement_runs)
    return text + (f"  (lowest top-1, largest |Δlogit| of {n} sessions)" if n > 1 else "")


def case_table(c: CaseReport) -> str:
    n = len(c.ttft_ms_runs)
    rows = [
        ("time to first token",
         f"{c.ttft_ms:,.1f} ms  (resume {c.resume_ms:,.1f} ms + prefill {c.prefill_ms:,.1f} ms"
         + (f"; session {c.median_session}, the median)" if n > 1 else ")")),
        *([("  median of", " / ".join(f"{t:,.1f}" for t in c.ttft_ms_runs) + " ms")] if n > 1 else []),
        ("tokens hit in cache", f"{c.hit_tokens:,}"),
        ("tokens prefilled", f"{c.prefill_tokens:,}"),
        ("tokens replayed", f"{c.replay_tokens:,}" + (f"  ({c.replay_status})" if c.replay_status else "")),
        ("bytes loaded", _loaded(c)),
        ("local state", c.label),
        ("vs. a cold run", _agreement(c)),
        ("stored afterwards", f"{c.store_ms:,.1f} ms (not in the TTFT)"),
        ("request id" + ("s" if len(c.request_ids) > 1 else ""), ", ".join(c.request_ids)),
    ]
    head = f"── {c.case}: {c.prompt_tokens:,}-token prompt " + "─" * max(0, 40 - len(c.case))
    return "\n".join([head] + [f"  {k:<21} {v}" for k, v in rows])


def summary_table(r: DemoReport) -> str:
    cases = [r.cases[k] for k in ("cold", "warm", "expired") if k in r.cases]
    rows: list[tuple[str, Callable[[CaseReport], str]]] = [
        ("time to first token", lambda c: f"{c.ttft_ms:,.1f} ms"),
        ("tokens prefilled", lambda c: f"{c.prefill_tokens:,}"),
        ("tokens replayed", lambda c: f"{c.replay_tokens:,}"),
        ("loaded from tiers", lambda c: _bytes(sum(c.bytes_loaded.get(t, 0) for t in TIER_NAMES))),
        ("local snapshot", lambda c: _bytes(c.bytes_loaded.get("local", 0))),
        ("local state", lambda c: c.label),
        ("lowest top-1 vs cold", lambda c: "—" if c.compared_tokens == 0 else f"{c.top1_agreement:.0%}"),
        ("max |Δlogit|", lambda c: "—" if c.compared_tokens == 0 else f"{c.max_abs_logit_delta:.3g}"),
    ]
    # Wide enough that the widest cell ("expired→recomputed") keeps two spaces before it.
    width = max([18] + [len(fmt(c)) + 2 for _, fmt in rows for c in cases])
    lines = [f"  {'':<21}" + "".join(f"{c.case:>{width}}" for c in cases)]
    for name, fmt in rows:
        lines.append(f"  {name:<21}" + "".join(f"{fmt(c):>{width}}" for c in cases))
    cold, expired = r.cases.get("cold"), r.cases.get("expired")
    if cold and expired and cold.ttft_ms > 0:
        # The two prompts differ in length (the expired one is later in the session): say both, so the
        # ratio is not read as one of the same prompt, cold and expired.
        e = expired
        lines.append(f"\n  expired vs cold: {e.ttft_ms:,.1f} ms to the first token of the {e.prompt_tokens:,}-token "
                     f"prompt, {e.ttft_ms / cold.ttft_ms:.2f}x the {cold.ttft_ms:,.1f} ms of the cold "
                     f"{cold.prompt_tokens:,}-token one;\n  the expired request computed "
                     f"{e.prefill_tokens + e.replay_tokens:,} of its {e.prompt_tokens:,} tokens "
                     f"({e.prefill_tokens:,} prefilled + {e.replay_tokens:,} replayed)")
    return "\n".join(lines)


def _options(args: argparse.Namespace) -> DemoOptions:
    from kvstore.workload.demo import DemoOptions

    return DemoOptions(
        target=args.target, token=args.token, data_dir=args.data_dir, prompt_tokens=args.prompt_tokens,
        turn_tokens=args.turn_tokens, reply_tokens=args.reply_tokens, replay_mode=args.replay_mode,
        seed=args.seed, device=args.device, threads=args.threads, repeats=args.repeats,
    )


def check_flags(args: argparse.Namespace) -> None:
    """Refuse what cannot work, naming the flag: bad counts, seeds and thread counts, a first prompt
    shorter than a chunk (the embedded service's; a running service's is checked once it says
    it), a CUDA device that is not there, a target that does not answer (within 2 s, not a silent
    wait)."""
    from kvstore.config.store import StoreConfig
    from kvstore.workload.demo import check_options, check_prompt

    opts = _options(args)
    check_options(opts)
    for key, most in MOST.items():
        if getattr(args, key) > most:
            raise InvalidInput(f"--{key.replace('_', '-')} must be at most {most:,}, got {getattr(args, key):,}")
    # Flags of one mode given in the other were ignored without a word.
    if args.target is not None and args.data_dir is not None:
        raise InvalidInput("--data-dir is for the embedded service: a service at --target keeps its own data")
    if args.target is None and args.token is not None:
        raise InvalidInput("--token is for --target: the embedded service needs none")
    check_not_empty(args.data_dir, "--data-dir", "directory")
    check_token(args.token, "--token")
    if args.target is not None:
        check_target(args.target, "--target")
    if not args.target:
        check_prompt(opts, StoreConfig().chunk_tokens, running_service=False)  # the embedded service's chunks
    if args.device == "cuda":
        from replay.reference.model import usable_device

        try:
            usable_device("cuda")
        except KvstoreError as e:
            raise InvalidInput(f"--device cuda: {e}") from None
    if args.target:
        from kvstore.client.sync_client import KvstoreClient

        with KvstoreClient(args.target, token=args.token) as client:
            try:
                client.wait_ready()
            except KvstoreError as e:
                raise InvalidInput(f"--target {args.target}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from kvstore.workload.demo import DemoFailed, run_demo

    out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(f"  {line}", file=out, flush=True)

    def on_case(c: CaseReport) -> None:
        print("\n" + case_table(c) + "\n", file=out, flush=True)

    check_flags(args)  # before the intro: a wrong flag is the first and only thing said
    opts = _options(args)
    print(INTRO + "\n", file=out, flush=True)
    try:
        report = run_demo(opts, say, on_case)
    except DemoFailed as e:
        if e.report is not None:
            print("\n" + case_table(e.report) + "\n", file=out, flush=True)
        out.flush()
        print(f"kvstore demo: {e}", file=sys.stderr, flush=True)
        return EXIT_CASE_FAILED
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=2, ensure_ascii=False)
        print()
        return 0
    print(f"summary ({report.model} on {report.device}, {report.replay_mode} replay, window "
          f"{report.window_tokens}, chunks of {report.chunk_tokens} tokens, local TTL "
          f"{report.local_ttl_seconds:g} s; expired case: {report.expiry})")
    print(summary_table(report))
    m = report.machine
    if m is not None:
        print(f"\n  timed on {m.cpus} CPU(s), the model on {m.threads} thread(s), median of {m.repeats} "
              f"session(s)" + (f"\n  note: {m.note}" if m.note else ""))
    print(f"\n  done in {report.wall_seconds:.1f} s")
    return 0
