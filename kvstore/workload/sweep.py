"""The cliff sweep: throughput and hit rate over concurrency, for several device/DRAM capacities.

Role: for each capacity point and each concurrency C, simulate C concurrent sessions of the same
workload shape (`sessions = concurrency = C`, same seed), and record throughput (requests per
second over the middle 80 % of request starts), hit rates and TTFT. Per capacity, the cliff is the
first concurrency above the throughput peak at which throughput falls below `cliff_fraction`
(70 %) of that peak; None when it never does within the sweep.

Why the cliff appears in the model: the runtime KV of requests in flight comes out of the device
tier's budget, so a higher concurrency leaves less device cache; once the sessions' working set no
longer fits the device and DRAM tiers (and the SSD tier, if the sweep has one), turns that used to
hit become misses, each miss prefills a whole context, the GPU saturates on recompute, and
throughput falls. With a large SSD tier the same sweep shows a plateau instead: SSD loads cost far
less than recompute, which is itself a finding for a capacity planner.

What it does not know: how a single run works (`simulator`), or how results are printed (`report`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidInput
from kvstore.layout import get_model
from kvstore.workload.generator import WorkloadSpec, generate
from kvstore.workload.results import RunResult
from kvstore.workload.simulator import SimConfig, simulate

CLIFF_FRACTION = 0.7
DEFAULT_SWEEP_CONCURRENCY: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
GiB = 1 << 30
DEFAULT_SWEEP_CAPACITIES: tuple[tuple[int, int, int], ...] = (
    (2 * GiB, 8 * GiB, 0),
    (4 * GiB, 16 * GiB, 0),
    (8 * GiB, 32 * GiB, 0),
    (16 * GiB, 64 * GiB, 0),
)
# A point simulates `concurrency` sessions, held in memory whole: the bound of `--sessions` (1,000,000
# ran out of memory after 36 s).
MAX_SWEEP_CONCURRENCY = 100_000
# Fewer policy operations per run than a single run allows: a sweep is many runs.
SWEEP_BLOCK_OP_BUDGET = 500_000

# Capacities end up as int64 (numpy, torch, LMDB): a larger size would overflow there, not here.
MAX_SIZE_BYTES = (1 << 63) - 1
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1 << 10, "KI": 1 << 10, "M": 10**6, "MB": 10**6,
          "MIB": 1 << 20, "MI": 1 << 20, "G": 10**9, "GB": 10**9, "GIB": 1 << 30, "GI": 1 << 30,
          "T": 10**12, "TB": 10**12, "TIB": 1 << 40, "TI": 1 << 40}


@dataclass(frozen=True)
class Capacity:
    device_bytes: int
    dram_bytes: int
    lmdb_bytes: int

    @property
    def label(self) -> str:
        s = f"device {format_bytes(self.device_bytes)} / DRAM {format_bytes(self.dram_bytes)}"
        return s + (f" / SSD {format_bytes(self.lmdb_bytes)}" if self.lmdb_bytes else "")


@dataclass(frozen=True)
class SweepPoint:
    capacity: Capacity
    concurrency: int
    requests: int
    requests_per_second: float
    prompt_tokens_per_second: float
    gpu_busy_fraction: float
    global_hit_rate: float  # prompt tokens served from any tier
    device_hit_rate: float
    warm_share: float
    expired_share: float
    cold_share: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


@dataclass(frozen=True)
class Cliff:
    capacity: Capacity
    peak_requests_per_second: float
    peak_concurrency: int
    cliff_concurrency: int | None  # None: throughput never fell below the threshold in the sweep


@dataclass(frozen=True)
class SweepResult:
    points: tuple[SweepPoint, ...]
    cliffs: tuple[Cliff, ...]
    cliff_fraction: float


def run_sweep(
    spec: WorkloadSpec,
    cfg: SimConfig,
    capacities: Sequence[Capacity],
    concurrencies: Sequence[int],
    progress: Callable[[str], None] | None = None,
    cliff_fraction: float = CLIFF_FRACTION,
    stop_after_cliff: bool = True,
) -> SweepResult:
    if not capacities or not concurrencies or min(concurrencies) < 1:
        raise InvalidInput("a sweep needs at least one capacity and concurrencies >= 1")
    conc = sorted(set(concurrencies))
    points: list[SweepPoint] = []
    cliffs: list[Cliff] = []
    for cap in capacities:
        row: list[SweepPoint] = []
        for c in conc:
            wspec = dataclasses.replace(spec, sessions=c, concurrency=c, tenants=min(spec.tenants, c))
            workload = generate(wspec)
            point_cfg = dataclasses.replace(
                cfg, device_capacity_bytes=cap.device_bytes, dram_capacity_bytes=cap.dram_bytes,
                lmdb_capacity_bytes=cap.lmdb_bytes,
                block_chunks=cfg.block_chunks or _sweep_block(workload.requests, workload.max_context_tokens,
                                                              cfg.model),
            )
            result = simulate(workload, point_cfg)
            row.append(_point(cap, c, result))
            if progress is not None:
                p = row[-1]
                progress(f"{cap.label}, concurrency {c}: {p.requests_per_second:.3f} req/s, "
                         f"hit {p.global_hit_rate:.2f}, warm {p.warm_share:.2f}")
            if stop_after_cliff and find_cliff(cap, row, cliff_fraction).cliff_concurrency is not None:
                break  # past the cliff every larger concurrency costs more to simulate and shows less
        points += row
        cliffs.append(find_cliff(cap, row, cliff_fraction))
    return SweepResult(tuple(points), tuple(cliffs), cliff_fraction)


def find_cliff(cap: Capacity, row: Sequence[SweepPoint], fraction: float = CLIFF_FRACTION) -> Cliff:
    """The first concurrency past the peak whose throughput is below `fraction` of the peak."""
    ordered = sorted(row, key=lambda p: p.concurrency)
    peak = max(ordered, key=lambda p: p.requests_per_second)
    cliff = next(
        (p.concurrency for p in ordered
         if p.concurrency > peak.concurrency and p.requests_per_second < fraction * peak.requests_per_second),
        None,
    )
    return Cliff(cap, peak.requests_per_second, peak.concurrency, cliff)


def _point(cap: Capacity, concurrency: int, r: RunResult) -> SweepPoint:
    cases = r.cases()
    hits = r.hit_rate_by_tier()
    tp = r.throughput()
    n = max(r.log.n, 1)
    ttft = r.log.ttft
    return SweepPoint(
        capacity=cap, concurrency=concurrency, requests=r.log.n,
        requests_per_second=float(tp["requests_per_second"] or 0.0),
        prompt_tokens_per_second=float(tp["prompt_tokens_per_second"] or 0.0),
        gpu_busy_fraction=float(tp["gpu_busy_fraction"] or 0.0),
        global_hit_rate=1.0 - hits["miss"], device_hit_rate=hits["device"],
        warm_share=cases["warm"]["count"] / n, expired_share=cases["expired"]["count"] / n,
        cold_share=cases["cold"]["count"] / n,
        ttft_p50_ms=float(np.percentile(ttft, 50) * 1e3) if ttft.size else None,
        ttft_p99_ms=float(np.percentile(ttft, 99) * 1e3) if ttft.size else None,
    )


def _sweep_block(requests: int, max_context_tokens: int, model: str) -> int:
    chunk = get_model(model).layout.chunk_tokens
    max_chunks = max(1, max_context_tokens // chunk)
    blocks = max(64, SWEEP_BLOCK_OP_BUDGET // max(1, requests))
    return max(1, -(-max_chunks // blocks))


def parse_size(text: str) -> int:
    """'32GiB', '1.5TB', '0', '1e9' -> bytes."""
    m = _SIZE.match(text)
    if m is None or (m.group(2) is not None and m.group(2).upper() not in _UNITS):
        raise InvalidInput(f"'{text}' is not a size (e.g. 32GiB, 256GB, 0)")
    unit = (m.group(2) or "").upper()
    number = m.group(1)
    n: float | int
    if number.isdigit():
        # Whole numbers exactly: through a float, 2**63 - 1 became 2**63, refused as too large.
        # Over 19 digits it is too large anyway (and int() of thousands of digits is refused).
        n = int(number) * _UNITS[unit] if len(number.lstrip("0")) <= 19 else math.inf
    else:
        n = float(number) * _UNITS[unit]  # '1e400' is inf here, and int(inf) raised OverflowError
    if not n <= MAX_SIZE_BYTES:
        raise InvalidInput(f"'{text}' is too large a size (at most 2**63 - 1 bytes)")
    return int(n)


def parse_capacities(text: str, default_lmdb_bytes: int) -> list[Capacity]:
    """'4GiB:16GiB,8GiB:32GiB:1TiB' -> capacity points (device:DRAM[:SSD])."""
    out: list[Capacity] = []
    for item in text.split(","):
        parts = [p for p in item.split(":")]
        if len(parts) not in (2, 3) or not all(p.strip() for p in parts):
            raise InvalidInput(f"capacity '{item}' is not DEVICE:DRAM[:SSD], e.g. 8GiB:32GiB")
        sizes = [parse_size(p) for p in parts]
        out.append(Capacity(sizes[0], sizes[1], sizes[2] if len(sizes) == 3 else default_lmdb_bytes))
    return out


def parse_concurrencies(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(f"'{text}' is not a comma-separated list of concurrencies") from None
    if not out:
        raise InvalidInput("concurrencies must be integers >= 1")
    bad = [c for c in out if not 1 <= c <= MAX_SWEEP_CONCURRENCY]
    if bad:
        raise InvalidInput(f"concurrencies must be integers from 1 to {MAX_SWEEP_CONCURRENCY:,}, got {bad[0]:,}")
    return out


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"
