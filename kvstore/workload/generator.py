"""The agentic workload generator: sessions, turns and think times, deterministic from a seed.

Role: turn a `WorkloadSpec` into a `Workload`, a fixed plan of sessions. Each tenant has its own
long system prompt, shared by all its sessions; each turn appends a tool result and a user
message to the context; the engine then generates `output_tokens`, which become part of the next
turn's prompt. Between turns a session waits a think time drawn from a mixture (seconds for tool
calls, minutes for humans), so some returns land inside the local TTL and some after it. Tenants
have Zipf-distributed sizes (numbers of sessions). `concurrency` sessions run at once; when there
are more sessions than that, a slot starts its next session after the previous one ends.

The plan holds lengths and gaps, not absolute times: when a turn starts depends on how long the
previous one took, which only the simulator or the live driver knows (a closed loop).
`planned_requests` gives the open-loop timeline (zero service time) for a quick look.
Token ids are generated on demand from the seed (`prompt_token_ids`), prefix-consistent: the
prompt of turn k is a prefix of the prompt of turn k+1.

Determinism: every random draw comes from `numpy.random.SeedSequence([seed, purpose, ...])`, so
the same spec gives the same plan and token ids on any machine, and changing the number of
sessions does not reshuffle an existing session's token ids.

What it does not know: caches, tiers, TTLs, timing of the service, or the wire protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import InvalidInput
from kvstore.workload.thinktime import DEFAULT_THINK_TIME, ThinkTime

# SeedSequence purposes: one stream per kind of draw.
_SEED_TENANTS = 1
_SEED_LENGTHS = 2
_SEED_GAPS = 3
_SEED_STARTS = 4
_SEED_SYSTEM_TOKENS = 5
_SEED_TURN_TOKENS = 6
SEED_LIMIT = 2**32  # seeds are in [0, 2**32): refused outside it, never wrapped


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Lengths in tokens, times in seconds."""

    sessions: int = 512
    turns: int = 12
    context_tokens: int = 131_072  # prompt length of a session's last turn
    system_tokens: int = 16_384  # each tenant's shared system prompt
    output_tokens: int = 512  # generated per turn; part of the next turn's prompt
    tool_fraction: float = 0.85  # share of a turn's new input that is tool output (rest: user)
    length_jitter_sigma: float = 0.5  # lognormal spread of per-turn input lengths (0: equal)
    tenants: int = 4
    tenant_skew: float = 1.0  # Zipf exponent of tenant sizes (0: equal sizes)
    think_time: str = DEFAULT_THINK_TIME
    concurrency: int = 0  # sessions running at once; 0: all of them
    ramp_seconds: float = 60.0  # first sessions of the slots start uniformly in [0, ramp)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise InvalidInput("a workload needs at least one session and one turn")
        if not 1 <= self.tenants <= self.sessions:
            raise InvalidInput(f"tenants must be in 1..sessions ({self.sessions}), got {self.tenants}")
        if self.system_tokens < 0 or self.output_tokens < 0:
            raise InvalidInput("system_tokens and output_tokens must be >= 0")
        if self.input_budget_tokens < self.turns:
            raise InvalidInput(
                f"context_tokens {self.context_tokens} leaves no room for {self.turns} turns after a "
                f"{self.system_tokens}-token system prompt and {self.output_tokens} output tokens per turn"
            )
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise InvalidInput("tool_fraction must be in [0, 1]")
        for name in ("length_jitter_sigma", "tenant_skew", "ramp_seconds"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):  # NaN passes `v < 0`
                raise InvalidInput(f"{name} must be a finite number >= 0, got {v}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise InvalidInput(f"seed must be in [0, 2**32), got {self.seed}")
        if self.concurrency < 0:
            raise InvalidInput("concurrency must be >= 0 (0: all sessions at once)")
        ThinkTime.parse(self.think_time)  # fail fast on a bad mixture

    @property
    def input_budget_tokens(self) -> int:
        """Tool + user tokens over all turns of a session, so the last prompt is context_tokens."""
        return self.context_tokens - self.system_tokens - (self.turns - 1) * self.output_tokens

    @property
    def slots(self) -> int:
        return self.sessions if self.concurrency == 0 else min(self.concurrency, self.sessions)


@dataclass(frozen=True)
class TurnPlan:
    turn: int
    think_seconds: float  # gap between the previous turn's end and this turn (turn 0: 0)
    tool_tokens: int
    user_tokens: int
    output_tokens: int
    prompt_tokens: int  # system + every earlier turn's input and output + this turn's input

    @property
    def new_tokens(self) -> int:
        return self.tool_tokens + self.user_tokens

    @property
    def context_after_tokens(self) -> int:
        """Tokens the engine holds after generating: what it stores."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class SessionPlan:
    index: int
    name: str
    tenant: str
    tenant_index: int
    slot: int
    start_seconds: float  # first session of a slot: offset from 0; later ones: gap after the previous
    first_in_slot: bool
    system_tokens: int
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True)
class PlannedRequest:
    """One request on the open-loop timeline (as if service took no time)."""

    time_seconds: float
    tenant: str
    session: str
    turn: int
    prompt_tokens: int
    shared_prefix: str  # identity of the tenant-wide shared prefix (the system prompt)
    shared_tokens: int


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    sessions: tuple[SessionPlan, ...]
    tenant_names: tuple[str, ...]
    think: ThinkTime = field(compare=False)

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def max_context_tokens(self) -> int:
        return max(s.turns[-1].context_after_tokens for s in self.sessions)

    def sessions_by_slot(self) -> list[list[SessionPlan]]:
        out: list[list[SessionPlan]] = [[] for _ in range(self.spec.slots)]
        for s in self.sessions:
            out[s.slot].append(s)
        return out

    def planned_requests(self) -> list[PlannedRequest]:
        """Every request on the open-loop timeline, sorted by time."""
        out: list[PlannedRequest] = []
        for slot in self.sessions_by_slot():
            t = 0.0
            for s in slot:
                t += s.start_seconds
                for turn in s.turns:
                    t += turn.think_seconds
                    out.append(PlannedRequest(t, s.tenant, s.name, turn.turn, turn.prompt_tokens,
                                              f"{s.tenant}:system", s.system_tokens))
        out.sort(key=lambda r: (r.time_seconds, r.session, r.turn))
        return out

    # --- token ids (for live mode and traces) --------------------------------------------------------

    def system_token_ids(self, tenant_index: int, vocab_size: int) -> np.ndarray:
        rng = _rng(self.spec.seed, _SEED_SYSTEM_TOKENS, tenant_index)
        return rng.integers(0, vocab_size, size=self.spec.system_tokens, dtype=np.uint32)

    def turn_token_ids(self, session: SessionPlan, turn: int, vocab_size: int) -> np.ndarray:
        """The tokens turn `turn` appends: its tool result, user message, then its output."""
        t = session.turns[turn]
        rng = _rng(self.spec.seed, _SEED_TURN_TOKENS, session.index, turn)
        return rng.integers(0, vocab_size, size=t.new_tokens + t.output_tokens, dtype=np.uint32)

    def context_token_ids(self, session: SessionPlan, vocab_size: int) -> np.ndarray:
        """The whole context after the session's last turn; every prompt is a prefix of it."""
        parts = [self.system_token_ids(session.tenant_index, vocab_size)]
        parts += [self.turn_token_ids(session, k, vocab_size) for k in range(len(session.turns))]
        return np.concatenate(parts)

    def prompt_token_ids(self, session: SessionPlan, turn: int, vocab_size: int) -> np.ndarray:
        ctx = self.context_token_ids(session, vocab_size)
        return ctx[: session.turns[turn].prompt_tokens]


def generate(spec: WorkloadSpec) -> Workload:
    """Build the plan. Vectorised over sessions; cheap for thousands of sessions."""
    think = ThinkTime.parse(spec.think_time)
    n, turns = spec.sessions, spec.turns
    tenant_of = _assign_tenants(spec)
    inputs = _split_inputs(spec)  # (n, turns) tool+user tokens per turn
    gaps = think.sample(_rng(spec.seed, _SEED_GAPS), n * turns).reshape(n, turns)
    gaps[:, 0] = 0.0
    slots = spec.slots
    start_rng = _rng(spec.seed, _SEED_STARTS)
    first_starts = np.sort(start_rng.uniform(0.0, spec.ramp_seconds, size=slots)) if spec.ramp_seconds else (
        np.zeros(slots))
    later_starts = think.sample(start_rng, n)
    tenant_names = tuple(f"t{i}" for i in range(spec.tenants))
    out: list[SessionPlan] = []
    for i in range(n):
        tool = np.rint(inputs[i] * spec.tool_fraction).astype(np.int64)
        user = inputs[i] - tool
        plans: list[TurnPlan] = []
        prompt = spec.system_tokens
        for k in range(turns):
            prompt += int(inputs[i, k])
            plans.append(TurnPlan(k, float(gaps[i, k]), int(tool[k]), int(user[k]), spec.output_tokens, prompt))
            prompt += spec.output_tokens
        slot = i % slots
        first = i < slots
        out.append(SessionPlan(
            index=i, name=f"s{i:06d}", tenant=tenant_names[tenant_of[i]], tenant_index=int(tenant_of[i]),
            slot=slot, start_seconds=float(first_starts[slot] if first else later_starts[i]),
            first_in_slot=first, system_tokens=spec.system_tokens, turns=tuple(plans),
        ))
    return Workload(spec, tuple(out), tenant_names, think)


def tenant_sizes(spec: WorkloadSpec) -> list[int]:
    """Sessions per tenant: Zipf weights 1/(i+1)^skew, largest remainder, at least one each."""
    # A negative power, not 1/x**skew: (i+1)**2000 overflowed; 2**-2000 is 0, and tenant 0 weighs 1.
    w = np.power(np.arange(1, spec.tenants + 1, dtype=np.float64), -spec.tenant_skew)
    spare = spec.sessions - spec.tenants
    share = w / w.sum() * spare
    counts = np.floor(share).astype(np.int64)
    left = spare - int(counts.sum())
    for j in np.argsort(-(share - counts), kind="stable")[:left]:
        counts[j] += 1
    return [int(c) + 1 for c in counts]


def _assign_tenants(spec: WorkloadSpec) -> np.ndarray:
    sizes = tenant_sizes(spec)
    tenant_of = np.repeat(np.arange(spec.tenants), sizes)
    _rng(spec.seed, _SEED_TENANTS).shuffle(tenant_of)
    return tenant_of


def _split_inputs(spec: WorkloadSpec) -> np.ndarray:
    """Per-turn input lengths, each row summing to the input budget exactly, every entry >= 1."""
    n, turns, budget = spec.sessions, spec.turns, spec.input_budget_tokens
    rng = _rng(spec.seed, _SEED_LENGTHS)
    if spec.length_jitter_sigma > 0:
        w = np.exp(rng.normal(0.0, spec.length_jitter_sigma, size=(n, turns)))
    else:
        w = np.ones((n, turns))
    spare = budget - turns  # one token per turn is guaranteed; the rest is split by weight
    share = w / w.sum(axis=1, keepdims=True) * spare
    out = np.floor(share).astype(np.int64)
    left = spare - out.sum(axis=1)
    # Largest remainder per row, vectorised: rank the fractional parts and add one to the top `left`.
    order = np.argsort(-(share - out), axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(turns)[None, :].repeat(n, axis=0), axis=1)
    out += (ranks < left[:, None]).astype(np.int64)
    out += 1
    assert (out.sum(axis=1) == budget).all()
    return out


def _rng(seed: int, *purpose: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *purpose]))  # WorkloadSpec checked the range


def expected_expired_share(workload: Workload, ttl_seconds: float) -> float:
    """Analytic share of returns (turns after the first) whose think time exceeds the TTL."""
    if workload.spec.turns < 2 or not math.isfinite(ttl_seconds):
        return 0.0
    return workload.think.fraction_above(ttl_seconds)
