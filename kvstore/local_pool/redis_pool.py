"""The Redis local pool: snapshots in Redis (one node or a cluster), TTLs kept by the server.

Keys: one snapshot per (namespace digest, boundary chunk key), stored as parts

    <prefix>:{<hex of sha256(ns_digest || boundary_key)[:16]>}:v<format version>:p<i>

The braces are a Redis Cluster hash tag, so all parts of a snapshot live in one slot and one
MULTI/EXEC (or one pipeline) reaches them all. Every write is `SET key value PX ttl` for every part in one
transaction, so the value and its TTL arrive together and no key exists without a TTL through
any path (the only other commands are PEXPIRE on existing keys, GET and UNLINK, also inside the
script that removes a snapshot found bad only if no write replaced it since (with TYPE), and a
peek's GETRANGE and STRLEN). Only a write is a transaction: a noeviction Redis over its maxmemory
refuses any command queued in MULTI, a GET too, and every stored snapshot read as an `error` miss;
outside MULTI it serves reads, PEXPIRE and UNLINK (an `oom` miss is a read it refused all the same).
A read fetches the parts in one pipeline, part 0's PTTL first, and returns the snapshot only when
all are present and verify, and it is the snapshot asked for: of the layout, written
under this key (the header's key tag is the hash in the key's name), and, when the caller says
what it expects, of the layout's size and taken at the boundary asked about. Anything else is
`corrupt` and removed, as is a key of ours holding another Redis type (WRONGTYPE). A header of
the wrong size is refused before any further part is fetched on its word. A write landing between
a pipeline's GETs leaves parts of two writes, told apart by the write id every part carries (and
the sizes): `corrupt`, and not removed, since part 0 changed. A peek (a Lookup's question) reads,
in one pipeline, only each part's header and length.

Occupancy (`stats().used_bytes`, `capacity_bytes`) is the server's own, INFO memory's
`used_memory` and `maxmemory` (summed over a cluster's masters): every key on the server counts, not
only ours, and an unbounded server has no capacity (-1). `stats()` is polled (each /metrics scrape),
so it never waits on Redis: it shows the figures last asked for, and asks again, on a thread of its
own, once they are MEMORY_REFRESH_SECONDS old; a server that does not answer, or any node while its
breaker is not closed, shows -1 (unknown).

Trouble with Redis (slow, hanging, down, restarted empty, out of memory) becomes a miss or a
skipped write with a counter, never an exception. Each call has a budget: the caller's deadline,
at most `call_budget_seconds`; attempts (1 + `retries`) run only while budget is left and their
socket timeouts are cut to it. A circuit breaker stops calls to a Redis that keeps failing: one
per node on a cluster (the node that owns the snapshot's slot), so a dead master does not refuse
the keys of the live ones. Health and the breaker state are judged over the nodes that own slots
now: a node out of the map (failed over, or the "" of a cluster not reached yet) gets no calls, so
nothing would ever probe its breaker and close it. A slot on the move (MOVED, ASK) is followed by
the transport; one redirected twice is an error, but not against the node's breaker: it answered.

This module knows the key scheme and the call discipline; the byte format is in
`snapshot_format`, the wire in `redis_transport`, TTL choices in the policy.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from redis.exceptions import AskError, OutOfMemoryError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.config.local_pool import LocalPoolConfig
from kvstore.local_pool.base import (
    BytesLike,
    GetResult,
    MissReason,
    PeekResult,
    PoolCounters,
    PoolHealth,
    PoolStats,
    PutResult,
    SkipReason,
)
from kvstore.local_pool.breaker import CircuitBreaker
from kvstore.local_pool.redis_transport import (
    AnsweringTimeout,
    Command,
    RedisTransport,
    ServerMemory,
    telling_timeout,
)
from kvstore.local_pool.snapshot_format import (
    FORMAT_VERSION,
    HEADER,
    KEY_TAG_BYTES,
    PART_HEADER,
    SnapshotFormatError,
    SnapshotHeader,
    check_parts,
    decode_parts,
    encode_parts,
    part_count_for,
)
from policies.base import TtlPolicy
from policies.ttl import WriteCountingTtl

# No attempt is started with less time than this left: it could not finish, and a socket
# timeout of a few microseconds only turns a slow answer into a wasted one.
MIN_ATTEMPT_SECONDS = 0.002

# The server's memory figures are asked for at most this often (INFO memory, one round trip per
# node), and only while someone reads `stats()`.
MEMORY_REFRESH_SECONDS = 5.0
_UNKNOWN_MEMORY = ServerMemory(-1, -1)

# Why an attempt loop gave up without replies.
Failure = Literal["breaker-open", "timeout", "error", "oom"]

# UNLINK a snapshot's parts (KEYS) only if part 0 still holds what was read (ARGV[1]: its SHA-1;
# "": part 0 held another type than a string, and still does): checked and removed in one step, so
# a fresh snapshot written after the read is never deleted. All KEYS share the snapshot's hash tag:
# one slot, so it runs on a cluster too.
_UNLINK_IF_PART0 = """
local t = redis.call('TYPE', KEYS[1])['ok']
if ARGV[1] == '' then
  if t == 'string' or t == 'none' then return 0 end
elseif t ~= 'string' or redis.sha1hex(redis.call('GET', KEYS[1])) ~= ARGV[1] then
  return 0
end
return redis.call('UNLINK', unpack(KEYS))
"""


def ttl_milliseconds(ttl_seconds: float) -> int:
    """A TTL as Redis's PX: the nearest whole millisecond, at least one. Truncated, a TTL set 1 ms
    past a gap (as `kvstore tune ttl` recommends: 1.001 s is 1000.9999999999999 ms) lost that
    millisecond, and the session returning after exactly the gap missed."""
    return max(1, round(ttl_seconds * 1000))


def snapshot_key_tag(ns_digest: bytes, boundary_key: bytes) -> bytes:
    """The 16 bytes a snapshot's key is named by, also written in its header (`key_tag`): a value
    copied under another key (another tenant's, say) does not carry that key's tag."""
    return hashlib.sha256(ns_digest + boundary_key).digest()[:KEY_TAG_BYTES]


def snapshot_key_base(prefix: str, ns_digest: bytes, boundary_key: bytes) -> bytes:
    """`<prefix>:{<hash>}:v<format version>:p`; part i is this plus str(i)."""
    return _key_base(prefix, snapshot_key_tag(ns_digest, boundary_key))


def _key_base(prefix: str, key_tag: bytes) -> bytes:
    # The format version in the name: instances of two versions sharing a pool (a rolling upgrade)
    # each read only their own snapshots; under one name each took the other's for corrupt and
    # removed it.
    return f"{prefix}:{{{key_tag.hex()}}}:v{FORMAT_VERSION}:p".encode()


def _wrong_type(reply: Any) -> bool:
    """A key of ours holding a list, a hash, ...: never a value of ours, and refused by every read
    until removed."""
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


class RedisPool:
    """`LocalPool` over Redis. Thread-safe; the transport holds the connections."""

    def __init__(
        self,
        cfg: LocalPoolConfig,
        transport: RedisTransport,
        ttl_policy: TtlPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg
        self._transport = transport
        self._policy = ttl_policy
        self._clock = clock  # policy time and the breaker; socket deadlines use time.monotonic()
        # One breaker per node the transport names ("" for a single node, or a cluster not yet reached).
        self._breakers: dict[str, CircuitBreaker] = {}
        self._dropped_opens = 0  # of breakers dropped with their node: breaker_opens never goes back
        self._last_error = ""  # of the last failed call that said something about Redis
        self._counters = PoolCounters()
        self._lock = threading.Lock()
        # Learned from successful writes, and from reads only of a snapshot that passed every
        # check, its size against the caller's: a value that only verifies (anyone can compute a
        # CRC and a checksum) taught a 100-byte layout size once, and every genuine multi-part
        # snapshot of that layout, any tenant's, then read as corrupt and was removed. Part counts
        # per layout, so a read fetches all parts in its first round trip; the payload size per
        # layout (fixed: the layout id covers it), the only one a header may claim to have a read
        # fetch more parts than hinted.
        self._parts_hint: dict[bytes, int] = {}
        self._layout_bytes: dict[bytes, int] = {}
        self._max_parts = 1  # the most parts of any snapshot seen: what delete() removes
        self._max_written_parts = 1  # the most this instance wrote: what a put removes beyond its own
        self._closed = False
        self._reached = False  # Redis has answered once: until then, a failure means it was never reached
        self._memory = _UNKNOWN_MEMORY  # the server's, as last asked (under _lock)
        self._memory_asked_at = -math.inf  # time.monotonic() of the last ask started
        self._memory_asking = False

    # --- LocalPool ---------------------------------------------------------------------------
    def put(
        self, ns_digest: bytes, boundary_key: bytes, tenant: str, layout_id: bytes,
        boundary_tokens: int, payload: BytesLike, deadline_seconds: float | None = None,
    ) -> PutResult:
        if self._closed:
            return self._counters.skip("closed")
        deadline_at = self._deadline(deadline_seconds)
        if deadline_at - time.monotonic() < MIN_ATTEMPT_SECONDS:
            return self._counters.skip("timeout")  # as _run would, but before the policy counts a write
        tag = snapshot_key_tag(ns_digest, boundary_key)
        base = _key_base(self._cfg.key_prefix, tag)
        breaker = self._breaker_for(base)
        # The breaker's permission (in half-open, the one probe's) before the policy hears of a
        # write that would not be sent (a policy without the split of `WriteCountingTtl` counts
        # every write it is asked about), and before the checksum.
        if not breaker.allow():
            return self._counters.skip("breaker-open")
        # The policy in force now hears of the write, once Redis took it: one that fails (out of
        # memory, a timeout) would count as a snapshot whose session never came back.
        policy, now = self._policy, self._clock()
        counting = policy if isinstance(policy, WriteCountingTtl) else None
        try:
            nbytes = memoryview(payload).nbytes
            ttl = (counting.write_ttl(tenant, nbytes, now) if counting is not None
                   else policy.ttl_for_write(tenant, nbytes, now))
            if not (ttl > 0 and math.isfinite(ttl)):
                breaker.release()
                return self._counters.skip("policy")
            ttl_ms = ttl_milliseconds(ttl)
            parts = encode_parts(layout_id, boundary_tokens, payload, self._cfg.part_bytes, key_tag=tag)
            cmds: list[Command] = [("SET", base + b"%d" % i, part, "PX", ttl_ms) for i, part in enumerate(parts)]
            # Parts beyond this write's count, left by an earlier write of the same key with more
            # parts, would never be read again but would hold memory until their TTL. Only as many
            # as this instance ever wrote: another's (a smaller part_bytes) expire with their TTL,
            # rather than every put sending hundreds of UNLINKs once one such snapshot was read.
            cmds += [("UNLINK", base + b"%d" % i) for i in range(len(parts), self._max_written_parts)]
        except BaseException:
            # Nothing was sent: in half-open, kept, the probe's permission would refuse every
            # caller until the probe is given up, another breaker_reset_seconds.
            breaker.release()
            raise
        replies = self._attempts(cmds, deadline_at, breaker, atomic=True)  # parts and TTLs land together
        if isinstance(replies, str):
            return self._counters.skip(_skip_reason(replies))
        for r in replies:
            if isinstance(r, ResponseError):
                return self._counters.skip("oom" if isinstance(r, OutOfMemoryError) else "error")
        if counting is not None:
            counting.observe_write(tenant, nbytes, now)
        self._learn_parts(layout_id, len(parts), nbytes, written=True)
        self._counters.wrote(nbytes)
        return PutResult.ok(ttl_ms / 1000)

    def get(
        self, ns_digest: bytes, boundary_key: bytes, tenant: str, layout_id: bytes,
        deadline_seconds: float | None = None, *, payload_bytes: int | None = None,
        boundary_tokens: int | None = None,
    ) -> GetResult:
        if self._closed:
            return self._counters.miss("closed")
        deadline_at = self._deadline(deadline_seconds)
        expect = _Expected(layout_id, snapshot_key_tag(ns_digest, boundary_key), payload_bytes, boundary_tokens)
        base = _key_base(self._cfg.key_prefix, expect.key_tag)
        want = self._first_round_parts(expect)
        for _ in range(2):  # a second round only when the snapshot has more parts than hinted
            # Part 0's PTTL in the same pipeline: what is left of a TTL no read refreshes. First: its
            # small reply tells a slow link from a silent server (`AnsweringTimeout`).
            got = self._run([("PTTL", base + b"0"), *(("GET", base + b"%d" % i) for i in range(want))],
                            deadline_at, base)
            if isinstance(got, str):
                return self._counters.miss(_miss_reason(got))
            pttl, replies = got[0], got[1:]
            outcome = self._assemble(replies, expect)
            if not isinstance(outcome, int):
                break
            want = outcome  # for this read only: the header is not verified yet
        else:
            return self._counters.miss("corrupt")  # a part count that keeps changing: not ours
        if isinstance(outcome, str):
            if outcome in ("corrupt", "incomplete"):
                self._unlink_if_unchanged(base, max(want, self._max_parts), replies[0], deadline_at)
            return self._counters.miss(outcome)
        header, payload = outcome
        if payload_bytes is not None:  # its size was checked against the caller's: worth learning
            self._learn_parts(layout_id, header.part_count, header.payload_bytes, written=False)
        ttl = self._refresh(base, header.part_count, tenant, header.payload_bytes, deadline_at)
        if not ttl and isinstance(pttl, int) and pttl > 0:  # not refreshed: what was left at the read
            ttl = pttl / 1000
        self._counters.hit(header.payload_bytes)
        return GetResult.found(payload, header.boundary_tokens, ttl)

    def peek(
        self, ns_digest: bytes, boundary_key: bytes, tenant: str, layout_id: bytes,
        deadline_seconds: float | None = None, *, payload_bytes: int | None = None,
        boundary_tokens: int | None = None,
    ) -> PeekResult:
        # One pipeline of small reads: part 0's header, each later part's, every part's length.
        # No GET (a V4.1 snapshot is 1.35 MB), no PEXPIRE; nothing bad is removed either: that
        # needs part 0 itself (`_unlink_if_unchanged`), and the get that follows does it.
        self._counters.add("peeks")
        if self._closed:
            return PeekResult.missed("closed")
        deadline_at = self._deadline(deadline_seconds)
        expect = _Expected(layout_id, snapshot_key_tag(ns_digest, boundary_key), payload_bytes, boundary_tokens)
        base = _key_base(self._cfg.key_prefix, expect.key_tag)
        want = self._first_round_parts(expect)
        for _ in range(2):  # a second round only when the snapshot has more parts than hinted, as get's
            replies = self._run(_peek_commands(base, want), deadline_at, base, vouches=False)
            if isinstance(replies, str):
                return PeekResult.missed(_miss_reason(replies))
            outcome = self._judge(replies, expect)
            if not isinstance(outcome, int):
                break
            want = outcome
        else:
            return PeekResult.missed("corrupt")
        if isinstance(outcome, str):
            return PeekResult.missed(outcome)
        return PeekResult.found(outcome.boundary_tokens)

    def delete(self, ns_digest: bytes, boundary_key: bytes, deadline_seconds: float | None = None) -> bool:
        if self._closed:
            return False
        base = snapshot_key_base(self._cfg.key_prefix, ns_digest, boundary_key)
        replies = self._unlink(base, self._max_parts, self._deadline(deadline_seconds))
        found = bool(replies and isinstance(replies[0], int) and replies[0] > 0)
        if found:
            self._counters.add("deletes")
        return found

    def set_ttl_policy(self, policy: TtlPolicy) -> None:
        self._policy = policy  # stored keys keep the TTL Redis holds for them until a hit refreshes it

    def stats(self) -> PoolStats:
        plain, misses, skipped = self._counters.snapshot()
        breakers, dropped_opens = self._current_breakers()
        states = {b.state for _, b in breakers}
        # The worst node's state: "open" while any node's breaker refuses calls.
        state = next((s for s in ("open", "half-open") if s in states), "closed")
        memory = self._server_memory(ask=state == "closed")
        return PoolStats(
            backend=self._transport.kind, misses=misses, skipped_writes=skipped, entries=-1,
            used_bytes=memory.used_bytes, capacity_bytes=memory.max_bytes, breaker_state=state,
            breaker_opens=dropped_opens + sum(b.opens for _, b in breakers), **plain,
        )

    def health(self) -> PoolHealth:
        if self._closed:
            return PoolHealth("degraded", "closed")
        for node, breaker in self._current_breakers()[0]:
            state = breaker.state
            if state != "closed":
                where = f"redis node {node}" if node else "redis"
                return PoolHealth("degraded", f"{where} unreachable, breaker {state}: {breaker.last_error}")
        if not self._reached and self._last_error:
            return PoolHealth("degraded", f"redis not reached yet: {self._last_error}")
        return PoolHealth("ok")

    def probe(self, deadline_seconds: float | None = None) -> PoolHealth:
        # A keyed no-op, not PING: a cluster sends a command without a key nowhere.
        key = f"{self._cfg.key_prefix}:{{probe}}".encode()
        self._run([("EXISTS", key)], self._deadline(deadline_seconds), key)
        health = self.health()
        self._server_memory(ask=health.status == "ok")  # now: the first scrape after a start has the figures
        return health

    def close(self) -> None:
        self._closed = True
        self._transport.close()

    # --- helpers -----------------------------------------------------------------------------
    def _server_memory(self, ask: bool) -> ServerMemory:
        """The figures last asked for; asks again, off this thread, when they are old. Not while
        a node's breaker is not closed (`ask` False): a cluster's sum is not known with a master
        down, and nothing is sent to a Redis the calls themselves leave alone."""
        now = time.monotonic()
        with self._lock:
            if not ask:
                self._memory, self._memory_asked_at = _UNKNOWN_MEMORY, -math.inf  # asked as soon as it is back
                return self._memory
            memory = self._memory
            ask = (not self._closed and not self._memory_asking
                   and now - self._memory_asked_at >= MEMORY_REFRESH_SECONDS)
            if ask:
                self._memory_asking, self._memory_asked_at = True, now
        if ask:
            threading.Thread(target=self._ask_memory, name="kvstore-pool-memory", daemon=True).start()
        return memory

    def _ask_memory(self) -> None:
        # The socket timeouts bound the wait (per node on a cluster); nobody waits on this thread.
        deadline_at = time.monotonic() + self._cfg.connect_timeout_seconds + self._cfg.socket_timeout_seconds
        try:
            memory = self._transport.memory(deadline_at)
        except Exception:  # down, hung, INFO refused (an ACL): not known, rather than stale
            memory = _UNKNOWN_MEMORY
        with self._lock:
            self._memory = memory
            self._memory_asking = False

    def _deadline(self, deadline_seconds: float | None) -> float:
        budget = self._cfg.call_budget_seconds
        if deadline_seconds is not None:
            budget = min(budget, max(0.0, deadline_seconds))
        return time.monotonic() + budget

    def _breaker_for(self, key: bytes) -> CircuitBreaker:
        """The breaker of the node `key` lives on."""
        node = self._transport.node_for(key)
        breaker = self._breakers.get(node)
        if breaker is None:
            with self._lock:
                breaker = self._breakers.get(node)
                if breaker is None:
                    breaker = CircuitBreaker(self._cfg.breaker_failures, self._cfg.breaker_reset_seconds,
                                             self._clock)
                    self._breakers[node] = breaker
        return breaker

    def _current_breakers(self) -> tuple[list[tuple[str, CircuitBreaker]], int]:
        """The breakers of the nodes that own slots now, and the opens of those dropped so far.
        The others are dropped: no call reaches their node, so nothing would probe them, and an
        open one would read as an outage for good. A call still holding a dropped breaker only
        reports to it; a node that comes back gets a new one."""
        nodes = self._transport.nodes()
        with self._lock:
            for node in [n for n in self._breakers if n not in nodes]:
                self._dropped_opens += self._breakers.pop(node).opens
            return list(self._breakers.items()), self._dropped_opens

    def _run(self, cmds: Sequence[Command], deadline_at: float, key: bytes,
             vouches: bool = True, atomic: bool = False) -> list[Any] | Failure:
        """Replies of one pipeline (`atomic`: transaction) on the node of `key` (every key of
        `cmds` shares its slot), or why there are none: "breaker-open", "timeout", "error" or
        "oom". `vouches`: whether its success tells the breaker Redis is well (not a peek's: a Redis
        that answers a few header bytes in time but no snapshot would otherwise keep its breaker
        closed for good)."""
        if deadline_at - time.monotonic() < MIN_ATTEMPT_SECONDS:
            return "timeout"  # the caller is out of time; says nothing about Redis
        breaker = self._breaker_for(key)
        if not breaker.allow():
            return "breaker-open"
        return self._attempts(cmds, deadline_at, breaker, vouches, atomic)

    def _attempts(self, cmds: Sequence[Command], deadline_at: float, breaker: CircuitBreaker,
                  vouches: bool = True, atomic: bool = False) -> list[Any] | Failure:
        """`_run` once `breaker` has let the call through: retries transport failures while the
        deadline allows, and tells the breaker what they said about Redis. `atomic`: one
        MULTI/EXEC (a write), else a plain pipeline, which a Redis over maxmemory still serves."""
        send = self._transport.transaction if atomic else self._transport.pipeline
        failure: Failure = "timeout"
        error_text = ""
        judged = False  # an attempt failed in a way that says something about Redis
        for _ in range(1 + self._cfg.retries):
            started = time.monotonic()
            if deadline_at - started < MIN_ATTEMPT_SECONDS:
                break
            try:
                replies = send(cmds, deadline_at)
            except OutOfMemoryError:
                breaker.record_success()  # Redis is up; it is full
                self._reached = True
                return "oom"
            except AskError as e:  # MOVED too: redirected again after the transport followed one
                # The slot is moving between nodes that answer: nothing against the node's breaker.
                self._counters.add("errors")
                failure, error_text = "error", f"{type(e).__name__}: {e}"
                self._reached = True
                continue
            except (RedisError, RedisClusterException, OSError) as e:  # OSError covers ssl errors
                self._counters.add("errors")
                timed_out = isinstance(e, RedisTimeoutError | TimeoutError)
                failure = "timeout" if timed_out else "error"
                error_text = f"{type(e).__name__}: {e}"
                # A timeout that the caller's deadline cut short says nothing about Redis: too soon
                # to tell, or while Redis was answering (`AnsweringTimeout`). Counted against it,
                # one tenant's short deadlines opened the breaker every tenant shares.
                waited = time.monotonic() - started
                judged = judged or not timed_out or (
                    not isinstance(e, AnsweringTimeout) and telling_timeout(waited, self._cfg.socket_timeout_seconds))
                continue
            except Exception as e:  # the client library's own failure: still a miss, never the caller's error
                self._counters.add("errors")
                failure, error_text, judged = "error", f"{type(e).__name__}: {e}", True
                continue
            if vouches:
                breaker.record_success()
            else:
                breaker.release()  # in half-open, the next payload call probes
            self._reached = True
            return replies
        if judged:
            self._last_error = error_text
            breaker.record_failure(error_text)
        else:
            breaker.release()  # nothing learnt: in half-open, the next caller probes
        return failure

    def _first_round_parts(self, expect: _Expected) -> int:
        """How many parts a read asks for at once: as many as the layout's snapshots were seen to
        have, else as many as this pool would write of the size the caller expects."""
        hint = self._parts_hint.get(expect.layout_id)
        if hint is not None:
            return hint
        return 1 if expect.payload_bytes is None else part_count_for(expect.payload_bytes, self._cfg.part_bytes)

    def _assemble(
        self, replies: list[Any], expect: _Expected,
    ) -> tuple[SnapshotHeader, memoryview] | MissReason | int:
        """The verified snapshot, a miss reason, or the part count to fetch when it exceeds
        what was read."""
        problem = _reply_problem(replies[:1])
        if problem is not None:
            return problem
        if replies[0] is None:
            return "absent"
        header = self._header_of(replies[0], len(replies), expect)
        if not isinstance(header, SnapshotHeader):
            return header
        # Replies beyond the part count (an earlier write's leftovers, or not ours) are not judged.
        parts = replies[: header.part_count]
        problem = _reply_problem(parts)
        if problem is not None:
            return problem
        if any(p is None for p in parts):
            return "incomplete"  # parts evicted (volatile-ttl) or expired one by one
        try:
            return header, decode_parts(header, parts)
        except SnapshotFormatError:
            return "corrupt"

    def _header_of(self, first: Any, parts_read: int, expect: _Expected) -> SnapshotHeader | MissReason | int:
        """Part 0's header, for a get and a peek alike: the header, the miss reason, or the part
        count to ask about when it exceeds the `parts_read`."""
        try:
            header = SnapshotHeader.unpack(first)
        except SnapshotFormatError:
            return "corrupt"  # not ours, damaged, or of another format version (1: before key tags)
        if header.layout_id != expect.layout_id:
            return "corrupt"  # the namespace digest binds the layout: not a snapshot of ours
        if header.key_tag != expect.key_tag:
            return "corrupt"  # written under another key (copied, renamed): another tenant's, maybe
        if expect.boundary_tokens is not None and header.boundary_tokens != expect.boundary_tokens:
            return "corrupt"
        # Checked before any further part is fetched on the header's word: a 100-byte value was
        # served as a snapshot, and a header claiming 262,144 parts was followed key by key.
        if expect.payload_bytes is not None and header.payload_bytes != expect.payload_bytes:
            return "corrupt"
        if header.part_count > parts_read:
            # Another round trip on the word of a header not verified yet: only for a snapshot of
            # the layout's size (the format bounds its part count by its payload size), the
            # caller's or, when it says none, the one learnt.
            known = self._layout_bytes.get(expect.layout_id)
            if expect.payload_bytes is None and known is not None and header.payload_bytes != known:
                return "corrupt"
            return header.part_count
        return header

    def _judge(self, replies: list[Any], expect: _Expected) -> SnapshotHeader | MissReason | int:
        """`_assemble` for the replies of `_peek_commands`: the header of a snapshot that `get`
        would take short of its payload checksum, the miss reason it would give, or the part
        count to ask about when it exceeds what was asked."""
        problem = _reply_problem(replies[:2])
        if problem is not None:
            return problem
        heads, lengths = replies[0::2], replies[1::2]
        # GETRANGE and STRLEN read a missing key as empty: an empty value, which no writer makes,
        # reads as missing here and as corrupt to get; either way not a snapshot.
        if lengths[0] == 0:
            return "absent"
        header = self._header_of(heads[0], len(lengths), expect)
        if not isinstance(header, SnapshotHeader):
            return header
        problem = _reply_problem(replies[: 2 * header.part_count])
        if problem is not None:
            return problem
        lengths = lengths[: header.part_count]
        if any(n == 0 for n in lengths):
            return "incomplete"
        try:
            check_parts(header, heads[1: header.part_count], lengths)
        except SnapshotFormatError:
            return "corrupt"
        return header

    def _refresh(self, base: bytes, part_count: int, tenant: str, nbytes: int, deadline_at: float) -> float:
        """The TTL the snapshot's parts now have (as Redis holds it, in whole milliseconds), or 0.0:
        the policy refreshes nothing on a read, or the refresh failed (the TTL left is not known)."""
        ttl = self._policy.ttl_on_read(tenant, nbytes, self._clock())
        if ttl is None or not (ttl > 0 and math.isfinite(ttl)):
            return 0.0
        ttl_ms = ttl_milliseconds(ttl)
        # PEXPIRE only touches keys that exist and always leaves a TTL on them.
        replies = self._run([("PEXPIRE", base + b"%d" % i, ttl_ms) for i in range(part_count)], deadline_at, base)
        if isinstance(replies, str):
            return 0.0
        self._counters.add("refreshes")
        # A part gone since the read (0: no such key) leaves a snapshot the next get finds incomplete.
        return ttl_ms / 1000 if all(r == 1 for r in replies) else 0.0

    def _unlink(self, base: bytes, part_count: int, deadline_at: float) -> list[Any] | None:
        replies = self._run([("UNLINK", base + b"%d" % i) for i in range(part_count)], deadline_at, base)
        return None if isinstance(replies, str) else replies

    def _unlink_if_unchanged(self, base: bytes, part_count: int, part0: Any, deadline_at: float) -> None:
        """Remove a snapshot found corrupt or incomplete, unless a write replaced it since it was
        read: part 0 carries each write's fresh write id, so a changed part 0 is a new snapshot.
        A part 0 of another type than a string is removed while it is still of one."""
        if _wrong_type(part0):
            digest = ""
        elif isinstance(part0, bytes):
            digest = hashlib.sha1(part0).hexdigest()  # a digest, not part 0 itself: it may be a part_bytes value
        else:
            return
        keys = [base + b"%d" % i for i in range(part_count)]
        # A script runs whole anyway; sent as a transaction, like a write.
        self._run([("EVAL", _UNLINK_IF_PART0, len(keys), *keys, digest)], deadline_at, base, atomic=True)

    def _learn_parts(self, layout_id: bytes, count: int, payload_bytes: int, written: bool) -> None:
        """From a successful write, or a read checked against the caller's size, only."""
        with self._lock:
            self._parts_hint[layout_id] = count
            self._layout_bytes[layout_id] = payload_bytes
            self._max_parts = max(self._max_parts, count)
            if written:
                self._max_written_parts = max(self._max_written_parts, count)


class _Expected(NamedTuple):
    """What a read must find: the layout and key it asks under; the size and boundary when the
    caller says (None: not checked)."""

    layout_id: bytes
    key_tag: bytes
    payload_bytes: int | None
    boundary_tokens: int | None


def _reply_problem(replies: Sequence[Any]) -> MissReason | None:
    """What failed replies say: "corrupt" for a key of ours of another type (removed like a bad
    value, or it would be an "error" miss for good), "oom" for a read a Redis over maxmemory
    refused (up, and full: not an error), "error" for any other failure, None if none."""
    errors = [r for r in replies if isinstance(r, ResponseError)]
    if not errors:
        return None
    if any(_wrong_type(r) for r in errors):
        return "corrupt"
    return "oom" if all(isinstance(r, OutOfMemoryError) for r in errors) else "error"


def _peek_commands(base: bytes, part_count: int) -> list[Command]:
    """Per part, its header's bytes (GETRANGE: inclusive end) and its length."""
    cmds: list[Command] = []
    for i in range(part_count):
        key = base + b"%d" % i
        cmds += [("GETRANGE", key, 0, (HEADER.size if i == 0 else PART_HEADER.size) - 1), ("STRLEN", key)]
    return cmds


def _miss_reason(failure: Failure) -> MissReason:
    if failure in ("breaker-open", "oom"):
        return failure  # oom: Redis is up and full, not failing
    return "timeout" if failure == "timeout" else "error"


def _skip_reason(failure: Failure) -> SkipReason:
    if failure == "breaker-open":
        return "breaker-open"
    if failure == "oom":
        return "oom"
    return "timeout" if failure == "timeout" else "error"
