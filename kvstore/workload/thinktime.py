"""Think-time distributions: how long an agent session waits between two turns.

Role: parse a small textual mixture (`"0.6*lognormal(4,0.8)+0.4*lognormal(200,1.0)"`), draw
gaps from it with an injected numpy generator, and say analytically what share of gaps exceeds
a given TTL (so a report can show the expected share of expired returns beside the measured one).

Components (seconds):
- `fixed(s)`               always s;
- `exp(mean)`              exponential with that mean;
- `lognormal(median, sigma)` exp(N(ln median, sigma));
- `uniform(lo, hi)`        uniform on [lo, hi].
Weights are normalised; a component without `w*` has weight 1. Every number must be finite; times
are at most 1e9 s and a lognormal's sigma at most 10.

Why a mixture: agentic returns are bimodal. Tool calls come back in seconds, humans come back in
minutes, and the local TTL (minutes) sits between the two modes, which is what makes the
warm/expired split interesting. A single distribution would put nearly all returns on one side.

What it does not know: sessions, turns, TTLs or the store.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np

from kvstore.errors import InvalidInput

ThinkKind = Literal["fixed", "exp", "lognormal", "uniform"]
_ARITY: dict[str, int] = {"fixed": 1, "exp": 1, "lognormal": 2, "uniform": 2}
_COMPONENT = re.compile(r"^\s*(?:([0-9.eE+-]+)\s*\*\s*)?([a-z]+)\s*\(([^)]*)\)\s*$")

DEFAULT_THINK_TIME = "0.6*lognormal(4,0.8)+0.4*lognormal(200,1.0)"
# Bounds that keep every drawn gap, and simulated time summed over turns, finite: a gap of 1e308 s
# overflowed to inf after two turns, and lognormal(1,1000) drew inf. 1e9 s is about 32 years.
MOST_THINK_SECONDS = 1e9
MOST_LOGNORMAL_SIGMA = 10.0


@dataclass(frozen=True)
class ThinkComponent:
    weight: float
    kind: ThinkKind
    a: float  # fixed: seconds; exp: mean; lognormal: median; uniform: low
    b: float = 0.0  # lognormal: sigma; uniform: high

    def fraction_above(self, seconds: float) -> float:
        if self.kind == "fixed":
            return 1.0 if self.a > seconds else 0.0
        if self.kind == "exp":
            return math.exp(-seconds / self.a)
        if self.kind == "uniform":
            if self.b == self.a:  # uniform(a, a) is fixed(a): no width to divide by
                return 1.0 if self.a > seconds else 0.0
            if seconds <= self.a:
                return 1.0
            return max(0.0, (self.b - seconds) / (self.b - self.a))
        z = (math.log(max(seconds, 1e-300)) - math.log(self.a)) / self.b
        return 0.5 * math.erfc(z / math.sqrt(2.0))

    def describe(self) -> str:
        args = f"{self.a:g}" if _ARITY[self.kind] == 1 else f"{self.a:g},{self.b:g}"
        return f"{self.weight:g}*{self.kind}({args})"


@dataclass(frozen=True)
class ThinkTime:
    components: tuple[ThinkComponent, ...]

    @classmethod
    def parse(cls, spec: str) -> ThinkTime:
        parts = [p for p in spec.split("+") if p.strip()]
        if not parts:
            raise InvalidInput("think time is empty; e.g. '0.6*lognormal(4,0.8)+0.4*lognormal(200,1)'")
        raw: list[ThinkComponent] = []
        for part in parts:
            raw.append(_parse_component(part))
        total = sum(c.weight for c in raw)
        if not math.isfinite(total):  # each weight is finite, their sum may not be
            raise InvalidInput(f"think-time weights sum to {total}; the sum must be a finite number")
        return cls(tuple(ThinkComponent(c.weight / total, c.kind, c.a, c.b) for c in raw))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n gaps in seconds, float64, shape (n,)."""
        weights = np.array([c.weight for c in self.components])
        which = rng.choice(len(self.components), size=n, p=weights)
        out = np.empty(n, dtype=np.float64)
        # Draw every component for every slot and select: the draws consumed do not depend on
        # which component won, so changing one weight does not reshuffle the other components.
        for i, c in enumerate(self.components):
            if c.kind == "fixed":
                draw = np.full(n, c.a)
            elif c.kind == "exp":
                draw = rng.exponential(c.a, size=n)
            elif c.kind == "lognormal":
                draw = np.exp(rng.normal(math.log(c.a), c.b, size=n))
            else:
                draw = rng.uniform(c.a, c.b, size=n)
            out[which == i] = draw[which == i]
        return out

    def fraction_above(self, seconds: float) -> float:
        """The share of gaps longer than `seconds` (e.g. the local TTL), analytically."""
        return sum(c.weight * c.fraction_above(seconds) for c in self.components)

    def describe(self) -> str:
        return "+".join(c.describe() for c in self.components)


def _parse_component(part: str) -> ThinkComponent:
    m = _COMPONENT.match(part)
    if m is None:
        raise InvalidInput(f"think-time component '{part.strip()}' is not 'w*kind(args)'")
    weight_s, kind, args_s = m.groups()
    if kind not in _ARITY:
        raise InvalidInput(f"think-time kind '{kind}' is unknown; known: {', '.join(sorted(_ARITY))}")
    try:
        weight = float(weight_s) if weight_s else 1.0
        args = [float(x) for x in args_s.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(f"think-time component '{part.strip()}' has a non-numeric value") from None
    if len(args) != _ARITY[kind]:
        raise InvalidInput(f"think-time '{kind}' takes {_ARITY[kind]} argument(s), got {len(args)}")
    # NaN passes `< 0` and inf gaps never end a think: both are refused here, not met downstream.
    if not all(math.isfinite(x) for x in (weight, *args)):
        raise InvalidInput(f"think-time component '{part.strip()}' has a value that is not a finite number")
    if weight <= 0 or any(x < 0 for x in args):
        raise InvalidInput(f"think-time component '{part.strip()}' needs a positive weight and values >= 0")
    a = args[0]
    b = args[1] if len(args) > 1 else 0.0
    if kind in ("exp", "lognormal") and a <= 0:
        raise InvalidInput(f"think-time '{kind}' needs a positive first argument")
    if kind == "lognormal" and not 0 < b <= MOST_LOGNORMAL_SIGMA:
        raise InvalidInput(f"think-time lognormal needs sigma in (0, {MOST_LOGNORMAL_SIGMA:g}]")
    if any(x > MOST_THINK_SECONDS for x in (args if kind != "lognormal" else args[:1])):
        raise InvalidInput(f"think-time component '{part.strip()}' has a time above {MOST_THINK_SECONDS:g} s")
    if kind == "uniform" and b < a:
        raise InvalidInput("think-time uniform needs low <= high")
    return ThinkComponent(weight, cast(ThinkKind, kind), a, b)
