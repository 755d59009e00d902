"""`kvstore bench abuse`: a victim tenant's Lookup latency alone and while another tenant abuses
the service, in one run, and the server's memory before and after each abuse. The victim's every
tenth call is a Stats, timed apart from its Lookups (`victim_stats_p99_ms`, during the abuse).

The service runs as `kvstore serve` in its own process, with two tenants (alice abuses, bob is
the victim). Each abuser runs in a process of its own, so that neither it nor the victim is
slowed by the other's interpreter. For each abuse, in turn:
1. the victim's Lookups alone (the baseline next to this abuse);
2. the abuse starts and holds: idle Store streams, unread Load streams, maximal staging, a
   runner flood with bogus results, Stores larger than the tiers, Lookups of 900K-token prompts
   from two threads, HTTP/2 rapid reset, a PING flood, 300 calls without credentials that never
   send their request (Lookups, health checks, reflection streams; a staging abuser is measured
   once it has sent what it will, holding it); and, as controls, the same large Stores and huge
   Lookups sent to a second service on the machine (`_elsewhere`);
3. the victim's Lookups again, while the abuse holds;
4. the abuse stops; once the service has no call in flight, the server's RSS is read again, and
   the victim runs alone once more (the baseline is the mean of the passes before and after).

RSS here is RssAnon (the heap, the arenas): LMDB's file pages are page cache, mapped.

Targets: no victim errors; victim p99 at most 3x its baseline; RSS back within 64 MiB of where it
was before each abuse.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.abusers import Abuser, BodyLessCalls, IdleStoreStreams, RunnerFlood, UnreadLoadStreams, Victim
from kvstore.bench.flags import count, seconds
from kvstore.bench.serve_proc import start_serve
from kvstore.local_pool.redis_process import die_with

MiB = 1 << 20
ALICE = "bench-alice-token"
BOB = "bench-bob-token-1"
TOY = "reference-toy-8"
V41 = "deepseek-v4.1-flash"
V41_VOCAB = 129_280
RSS_SLACK_BYTES = 64 * MiB  # the target: back within this of the RSS before the abuse
ABUSES = ("idle_store_streams", "unread_load_streams", "maximal_staging", "runner_flood",
          "store_larger_than_tiers", "store_larger_than_tiers_elsewhere", "huge_lookups", "huge_lookups_elsewhere",
          "unpacked_lookups",
          "rapid_reset", "ping_flood", "body_less_calls")
HUGE_LOOKUP_TOKENS = 900_000  # 3.6 MB of token ids: within max_message_bytes (4 MiB) below
# The control: the same Stores sent to a second service on the same machine. What the victim
# loses then is the machine's CPU, which no admission inside the service can give back.
ELSEWHERE = "_elsewhere"


def add_abuse_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=count(1, 100_000), default=400, help="victim Lookups per measurement")
    p.add_argument("--only", choices=ABUSES, action="append", help="run only this abuse (repeatable)")
    p.add_argument("--settle-seconds", type=seconds(0.0, 3600.0), default=20.0,
                   help="longest wait for the service to drop an ended abuse's calls")
    # The service's LMDB write path under the Stores: write-through commits write LMDB outside the
    # store's lock; write-back writes it as chunks are demoted out of DRAM.
    p.add_argument("--write-policy", choices=("write-through", "write-back"), default="write-through",
                   help="the services' store.write_policy")
    p.add_argument("--lmdb-durability", choices=("sync", "nometasync", "async"), default="async",
                   help="the services' store.lmdb_durability (async: no fsync, the default here)")
    # `kvstore serve` opens its admin port by default; then the observers explain every miss.
    p.add_argument("--admin", action="store_true",
                   help="the services' admin port on (its explainer examines every Lookup's misses)")


def _config(tmp: Path, write_policy: str, lmdb_durability: str) -> Path:
    cfg = tmp / "abuse.toml"
    cfg.write_text(
        "[store]\ndevice = \"cpu\"\ndevice_capacity_bytes = 1048576\ndram_capacity_bytes = 16777216\n"
        f"lmdb_capacity_bytes = 67108864\nlmdb_durability = \"{lmdb_durability}\"\ncompression = \"none\"\n"
        f"write_policy = \"{write_policy}\"\n"
        "[service]\nmax_concurrent_calls = 64\nstream_idle_seconds = 5\nmax_staged_bytes = 536870912\n"
        f"max_message_bytes = 4194304\nmodels = [\"{TOY}\", \"{V41}\"]\n"
        "[replay]\nrunner = \"none\"\n[local_pool]\ncapacity_bytes = 16777216\n"
        f"[tenants.alice]\ntokens = [\"{ALICE}\"]\n[tenants.bob]\ntokens = [\"{BOB}\"]\n")
    return cfg


def _start_service(tmp: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    return start_serve(_config(tmp, args.write_policy, args.lmdb_durability), tmp / "data", admin=args.admin)


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _rss(pid: int) -> int:
    """Anonymous resident memory: the heap and the arenas, not LMDB's file pages (those are the
    page cache, mapped)."""
    return _status(pid, "RssAnon") * 1024


def _threads(pid: int) -> int:
    return _status(pid, "Threads")


def _tokens(seed: int, n: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype("<u4")


# --- the abusers, each in its own process -----------------------------------------------------------

class _StoresLargerThanTiers(Abuser):
    """Stores of 700 DeepSeek-V4.1 chunks (80 MB) into tiers of 64 MiB, one after another."""

    def __init__(self, address: str) -> None:
        from kvstore.client import KvstoreClient

        self._client = KvstoreClient(address, token=ALICE, timeout_seconds=120)
        self._stop = threading.Event()
        self._seed = 100
        self.stores = 0

    def start(self) -> None:
        def loop() -> None:
            cb = self._client.lookup(V41, _tokens(0, 128, V41_VOCAB)).chunk_bytes
            payload = bytes(cb)
            while not self._stop.is_set():
                self._seed += 1
                self._client.store(V41, _tokens(self._seed, 700 * 128, V41_VOCAB), [payload] * 700)
                self.stores += 1

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self._client.close()

    def outcome(self) -> dict[str, object]:
        return {"stores": self.stores}


class _HugeLookups(Abuser):
    """Lookups of 900K-token prompts never stored, from two threads: what admission by call slots
    lets one tenant send (two of its calls), each a few MB to parse, hash and search."""

    THREADS = 2

    def __init__(self, address: str) -> None:
        from kvstore.client import KvstoreClient

        self._client = KvstoreClient(address, token=ALICE, timeout_seconds=60)
        self._stop = threading.Event()
        self.lookups = 0

    def _lookup(self, prompt: np.ndarray) -> None:
        self._client.lookup(V41, prompt)

    def start(self) -> None:
        def loop(seed: int) -> None:
            prompt = _tokens(seed, HUGE_LOOKUP_TOKENS, V41_VOCAB)
            while not self._stop.is_set():
                self._lookup(prompt)
                self.lookups += 1

        self._threads = [threading.Thread(target=loop, args=(200 + i,), daemon=True) for i in range(self.THREADS)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        self._client.close()

    def outcome(self) -> dict[str, object]:
        return {"lookups": self.lookups}


class _UnpackedLookups(_HugeLookups):
    """The same Lookups with their ids as unpacked varints (`Tokens.ids`, a field each: legal
    protobuf, which no kvstore client sends): ~900K fields a request, too many to walk in Python,
    so the service hands such a request to the library's parser."""

    def __init__(self, address: str) -> None:
        import grpc

        super().__init__(address)
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
        self._call = self._channel.unary_unary("/kvstore.v1.KVCache/Lookup")
        self._requests: dict[int, bytes] = {}

    def _lookup(self, prompt: np.ndarray) -> None:
        from kvstore.v1 import kvstore_pb2 as pb
        from kvstore.wire.wire_format import LEN, VARINT, encode_varint

        request = self._requests.get(id(prompt))
        if request is None:  # built once per thread's prompt
            ids_tag = encode_varint(pb.Tokens.IDS_FIELD_NUMBER << 3 | VARINT)
            ids = b"".join(ids_tag + encode_varint(int(t)) for t in prompt)
            tokens_tag = encode_varint(pb.LookupRequest.TOKENS_FIELD_NUMBER << 3 | LEN)
            request = self._requests[id(prompt)] = (pb.LookupRequest(model=V41).SerializeToString()
                                                    + tokens_tag + encode_varint(len(ids)) + ids)
        self._call(request, metadata=(("authorization", f"Bearer {ALICE}"),), timeout=60)

    def stop(self) -> None:
        super().stop()
        self._channel.close()


def _make_abuser(name: str, address: str, layout_id: bytes) -> Abuser:
    from kvstore.bench import h2_abusers as h2
    from kvstore.v1 import kvstore_pb2 as pb

    if name == "idle_store_streams":
        return IdleStoreStreams(address, ALICE, TOY, _tokens(1, 64 * 128, 512), streams=64)
    if name == "unread_load_streams":
        return UnreadLoadStreams(address, ALICE, V41, _tokens(7, 256 * 128, V41_VOCAB), streams=16)
    if name == "maximal_staging":
        # 16 streams of 32 MiB each: twice alice's 256 MiB share of staging.
        return IdleStoreStreams(address, ALICE, V41, _tokens(3, 400 * 128, V41_VOCAB), streams=16,
                                chunk_bytes=113_920, pieces=32, piece_bytes=1 * MiB)
    if name == "runner_flood":
        return RunnerFlood(address, ALICE, TOY, layout_id, runners=32, bogus_results=0)
    if name.startswith("store_larger_than_tiers"):
        return _StoresLargerThanTiers(address)
    if name.startswith("huge_lookups"):
        return _HugeLookups(address)
    if name == "unpacked_lookups":
        return _UnpackedLookups(address)
    if name == "body_less_calls":
        return BodyLessCalls(address)
    request = pb.LookupRequest(model=TOY, tokens=pb.Tokens(u32le=_tokens(2, 4 * 128, 512).tobytes()))
    if name == "rapid_reset":
        return h2.RapidReset(address, ALICE, request.SerializeToString(), streams=50_000)
    if name == "ping_flood":
        return h2.PingFlood(address, frames=100_000, read=False)
    raise ValueError(name)


def _abuse_process(name: str, address: str, layout_id: bytes, ready: Any, stop: Any, out: Any) -> None:
    die_with(os.getppid())  # a bench killed with SIGKILL takes its abusers along
    abuser = _make_abuser(name, address, layout_id)
    if isinstance(abuser, RunnerFlood):
        abuser.start(with_bogus=False)
        # Then one runner that lies about its results: detached before anything is allocated.
        liar = RunnerFlood(address, ALICE, TOY, layout_id, runners=1, bogus_results=4)
        liar.start(with_bogus=True)
    else:
        abuser.start()
    if isinstance(abuser, IdleStoreStreams):
        abuser.wait_sent(timeout_seconds=120)  # measured once the bytes are held, not while they flow
    ready.set()
    stop.wait()
    result = abuser.outcome()
    abuser.stop()
    out.put(result)


# --- the run ----------------------------------------------------------------------------------------

def _victim_pass(victim: Victim, calls: int) -> tuple[float, float, int, list[str]]:
    """The p99 of the victim's Lookups, that of its Stats calls (every tenth), its errors."""
    victim.reset()
    r = victim.run_for(calls)
    return r.p99_ms(), r.stats_p99_ms(), r.errors, r.error_codes[:3]


def _settle(address: str, settle_seconds: float) -> bool:
    """Wait until the abuser (alice) has no call in flight but the one asking: a tenant's Stats
    counts only its own calls."""
    from kvstore.client import KvstoreClient

    end = time.monotonic() + settle_seconds
    with KvstoreClient(address, token=ALICE) as c:
        while time.monotonic() < end:
            if c.stats().calls_in_flight <= 1:
                return True
            time.sleep(0.2)
    return False


def run_abuse_bench(args: argparse.Namespace) -> dict[str, Any]:
    from kvstore.client import KvstoreClient
    from kvstore.layout import get_model

    names = args.only or list(ABUSES)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-abuse-") as d:
        proc, address = _start_service(Path(d), args)
        other: tuple[subprocess.Popen[str], str] | None = None
        if any(n.endswith(ELSEWHERE) for n in names):
            (Path(d) / "other").mkdir()
            other = _start_service(Path(d) / "other", args)
        try:
            with KvstoreClient(address, token=ALICE, timeout_seconds=60) as alice:
                cb = alice.lookup(V41, _tokens(0, 128, V41_VOCAB)).chunk_bytes
                alice.store(V41, _tokens(7, 256 * 128, V41_VOCAB), [bytes(cb)] * 256)  # what Loads read
            with KvstoreClient(address, token=BOB) as bob:
                bob_prompt = _tokens(11, 32 * 128, 512)
                ccb = bob.lookup(TOY, bob_prompt).chunk_bytes
                bob.store(TOY, bob_prompt, [bytes(ccb)] * 32)
            victim = Victim(address, BOB, TOY, bob_prompt, timeout_seconds=10.0, pause_seconds=0.002)
            _victim_pass(victim, 100)  # warm
            layout_id = get_model(TOY).layout.layout_id
            results: dict[str, dict[str, Any]] = {}
            alone_all: list[float] = []
            for name in names:
                before, _, alone_errors, _ = _victim_pass(victim, args.calls)
                rss0, threads0 = _rss(proc.pid), _threads(proc.pid)
                ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
                at = other[1] if other is not None and name.endswith(ELSEWHERE) else address
                p = ctx.Process(target=_abuse_process, args=(name, at, layout_id, ready, stop, out), daemon=True)
                p.start()
                ready.wait(120)
                time.sleep(0.5)  # the abuse takes hold
                p99, stats_p99, errors, codes = _victim_pass(victim, args.calls)
                rss_during, threads_during = _rss(proc.pid), _threads(proc.pid)
                stop.set()
                outcome = out.get(timeout=180)
                p.join(timeout=60)
                settled = _settle(address, args.settle_seconds)
                after, _, after_errors, _ = _victim_pass(victim, args.calls)
                # Freed memory goes back to the OS over a few seconds (the allocator and gRPC's
                # core release it lazily): wait for it, up to the settle time, and say how long.
                t_end = time.monotonic()
                deadline = t_end + args.settle_seconds
                while _rss(proc.pid) - rss0 > RSS_SLACK_BYTES and time.monotonic() < deadline:
                    time.sleep(0.25)
                rss_settle = time.monotonic() - t_end
                rss_after = _rss(proc.pid)
                alone = (before + after) / 2  # alone just before and just after: the machine drifts
                alone_all.append(alone)
                alone_errors += after_errors
                results[name] = {
                    "victim_p99_ms_alone": alone, "victim_p99_ms": p99, "victim_errors": errors + alone_errors,
                    "victim_error_codes": codes, "p99_ratio": p99 / alone if alone else float("inf"),
                    "victim_stats_p99_ms": stats_p99,
                    "rss_before_bytes": rss0, "rss_during_bytes": rss_during,
                    "rss_growth_bytes": rss_after - rss0, "rss_settle_seconds": rss_settle,
                    "threads_before": threads0,
                    "threads_during": threads_during, "settled": settled, "abuser": outcome,
                }
                print(f"  {name}: victim p99 {p99:.2f} ms ({p99 / alone:.2f}x of {alone:.2f} alone), "
                      f"errors {errors}, RSS {results[name]['rss_growth_bytes'] / MiB:+.0f} MiB", file=sys.stderr)
            victim.close()
        finally:
            for pr in (proc, *(() if other is None else (other[0],))):
                pr.terminate()
                pr.wait(timeout=60)
    return _summary(results, alone_all)


def _summary(results: dict[str, dict[str, Any]], alone_all: list[float]) -> dict[str, Any]:
    targets: list[dict[str, Any]] = []

    def target(name: str, value: float, goal: str, ok: Callable[[float], bool]) -> None:
        targets.append({"name": name, "value": value, "target": goal, "ok": bool(ok(value))})

    for name, r in results.items():
        if name.endswith(ELSEWHERE):
            continue  # a control, not a target: the machine's share of the victim's delay
        target(f"{name}: victim errors", r["victim_errors"], "= 0", lambda v: v == 0)
        if math.isfinite(r["p99_ratio"]):  # else a pass had no call that succeeded: the errors miss
            target(f"{name}: victim p99 / alone", r["p99_ratio"], "<= 3", lambda v: v <= 3)
        target(f"{name}: RSS growth MiB", r["rss_growth_bytes"] / MiB, "<= 64",
               lambda v: v <= RSS_SLACK_BYTES / MiB)
    return {"victim_p99_ms_alone": _finite_or_none(statistics.median(alone_all) if alone_all else math.nan),
            "abuses": _finite_or_none(results), "targets": targets}


def _finite_or_none(v: Any) -> Any:
    """`v` with each NaN or infinite float (the p99 of a pass in which every victim call failed,
    and what is computed from it) as None: JSON has neither, and `--json` writes null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite_or_none(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite_or_none(x) for x in v]
    return v
