"""What a workload run measured, and the figures derived from it: the cases, the three bills, the
persistent-bytes ratio against the predecessor-style baseline, and throughput.

Role: `RequestLog` holds one row per request in numpy columns (both modes fill it); `TierIntegrals`
holds occupancy integrated over time; `RunResult` ties them to the run's settings and `summary()`
turns them into the JSON object `kvstore bench workload --json` prints.

Definitions (per request unless said otherwise):
- case: cold (no global hit), warm (global and local hit), expired (global hit, local miss);
- `prefill_tokens_avoided`: the global hit, as the service bills it (also where the engine could not
  use it: expired, no replay); `prefill_tokens` what the engine still prefilled, and
  `net_prefill_tokens_avoided` the hit it used less the replay (replay is reported apart);
- `hbm_byte_seconds`: the request's runtime KV × its residency, plus its share (1/requests) of the
  device tier's byte-seconds;
- `persistent_bytes`: bytes this request parked off the GPU: its new global chunks, its local
  snapshot, and the snapshot a replay rebuilt (the coordinator keeps it in the pool);
- `persistent_bytes_loaded`: bytes it moved back to the GPU from DRAM, SSD and the local pool;
- persistent bytes held: time-averaged distinct global chunks in DRAM ∪ LMDB (payload bytes) plus
  the local pool's entries (payload + the embedded pool's per-entry overhead); per token: over the
  tokens those chunks hold. Held over time per request: `persistent_byte_seconds` the global chunks'
  (DRAM and LMDB, as the service's ledger bills them), `pool_byte_seconds` the local pool's apart.
- `global_bytes_per_token`: the device tier's bytes over the tokens it holds, time-averaged (the
  HBM figure to set against the layout's 890 B/token; page rounding shows up here).

The baseline (`Baseline`) is a counterfactual on the same run: every global chunk kvstore holds off
the GPU is held at the predecessor's size (`global_factor` × larger), and the local SWA state is
persisted with it for as long as the global KV lives (no TTL), making up `swa_share` of the
baseline's persistent bytes. So baseline bytes/token = B × global_factor / (1 − swa_share); with
the report's figures (4, ½) that is 8 × 890 = 7,120 B/token, and the ratio comes out ⅛ plus what
kvstore's short-lived pool adds.

What it does not know: how the rows were produced (simulator or live driver).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.layout import TIER_NAMES, ModelSpec

CASES = ("cold", "warm", "expired")
LOCAL_REASONS = ("", "ttl", "capacity", "never")


@dataclass(frozen=True)
class Baseline:
    global_factor: float = 4.0  # predecessor global KV per token ÷ kvstore's (the report: "about 4×")
    swa_share: float = 0.5  # SWA's share of the predecessor's persistent bytes (the report: "about half")

    def bytes_per_token(self, global_bytes_per_token: float) -> float:
        return global_bytes_per_token * self.global_factor / (1.0 - self.swa_share)

    def describe(self, global_bytes_per_token: float) -> dict[str, Any]:
        return {
            "global_factor": self.global_factor,
            "swa_share": self.swa_share,
            "bytes_per_token": self.bytes_per_token(global_bytes_per_token),
            "assumptions": (
                "same run, same chunks held for the same time; global KV at global_factor x kvstore's "
                "bytes/token; local SWA state persisted with the global KV (no TTL) and making up "
                "swa_share of the baseline's persistent bytes"
            ),
        }


class RequestLog:
    """One row per request; columns are preallocated numpy arrays."""

    def __init__(self, capacity: int) -> None:
        n = capacity
        self.n = 0
        self.case = np.zeros(n, np.int8)
        self.tenant = np.zeros(n, np.int32)
        self.session = np.zeros(n, np.int32)
        self.turn = np.zeros(n, np.int32)
        self.arrival = np.zeros(n, np.float64)
        self.start = np.zeros(n, np.float64)
        self.ttft = np.zeros(n, np.float64)
        self.prompt = np.zeros(n, np.int64)
        self.hit = np.zeros(n, np.int64)  # global hit found (tokens)
        self.usable = np.zeros(n, np.int64)  # global hit used (0 for expired when replay is off)
        self.by_tier = np.zeros((n, 3), np.int64)  # chunks loaded per tier: device, DRAM, LMDB
        self.replay = np.zeros(n, np.int64)
        self.prefill = np.zeros(n, np.int64)
        self.snapshot_loaded = np.zeros(n, np.int64)
        self.runtime_byte_seconds = np.zeros(n, np.float64)
        self.gpu_seconds = np.zeros(n, np.float64)
        self.local_reason = np.zeros(n, np.int8)
        self.written_chunks = np.zeros(n, np.int64)
        self.durable_chunks = np.zeros(n, np.int64)
        self.skipped_chunks = np.zeros(n, np.int64)
        self.snapshot_written = np.zeros(n, np.int64)
        self.stored_at = np.zeros(n, np.float64)

    def add(
        self, *, case: int, tenant: int, session: int, turn: int, arrival: float, start: float, ttft: float,
        prompt: int, hit: int, usable: int, by_tier: tuple[int, int, int], replay: int, prefill: int,
        snapshot_loaded: int, runtime_byte_seconds: float, gpu_seconds: float, local_reason: str,
    ) -> int:
        i = self.n
        assert i < self.case.shape[0], "more requests than the log was sized for"
        self.case[i], self.tenant[i], self.session[i], self.turn[i] = case, tenant, session, turn
        self.arrival[i], self.start[i], self.ttft[i] = arrival, start, ttft
        self.prompt[i], self.hit[i], self.usable[i] = prompt, hit, usable
        self.by_tier[i] = by_tier
        self.replay[i], self.prefill[i], self.snapshot_loaded[i] = replay, prefill, snapshot_loaded
        self.runtime_byte_seconds[i], self.gpu_seconds[i] = runtime_byte_seconds, gpu_seconds
        self.local_reason[i] = LOCAL_REASONS.index(local_reason)
        self.n += 1
        return i

    def stored(self, i: int, written: int, durable: int, skipped: int, snapshot_written: int, at: float) -> None:
        self.written_chunks[i], self.durable_chunks[i], self.skipped_chunks[i] = written, durable, skipped
        self.snapshot_written[i] += snapshot_written  # a replay may have written one already
        self.stored_at[i] = at

    def freeze(self) -> RequestLog:
        for name, col in vars(self).items():
            if isinstance(col, np.ndarray):
                setattr(self, name, col[: self.n])
                col.flags.writeable = False
        return self


@dataclass
class TierIntegrals:
    """Occupancy integrated over the run (byte-seconds and token-seconds), tiers in TIER_NAMES order."""

    tier_byte_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    tier_token_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    persistent_chunk_seconds: float = 0.0  # distinct chunks in DRAM ∪ LMDB
    runtime_byte_seconds: float = 0.0
    runtime_token_seconds: float = 0.0


@dataclass(frozen=True)
class RunResult:
    mode: str
    spec: ModelSpec
    log: RequestLog
    integrals: TierIntegrals
    end_seconds: float
    pool_byte_seconds: float
    settings: dict[str, Any]  # workload, deployment and cost model, as reported
    counters: dict[str, Any] = field(default_factory=dict)
    baseline: Baseline = field(default_factory=Baseline)
    elapsed_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        log, lay = self.log, self.spec.layout
        chunk_bytes, chunk_tokens = lay.chunk_bytes, lay.chunk_tokens
        b_per_token = chunk_bytes / chunk_tokens
        out: dict[str, Any] = {"mode": self.mode, "model": self.spec.name, "requests": log.n}
        out["cases"] = self.cases()
        reasons = {r: int(np.count_nonzero(log.local_reason == k)) for k, r in enumerate(LOCAL_REASONS) if r}
        out["local_miss_reasons"] = reasons
        out["hit_rate_by_tier"] = self.hit_rate_by_tier()
        out["bills_per_request"] = self.bills_per_request()
        g_bs = self.integrals.persistent_chunk_seconds * chunk_bytes
        tok_s = self.integrals.persistent_chunk_seconds * chunk_tokens
        base = self.baseline.bytes_per_token(b_per_token)
        kv_per_token = (g_bs + self.pool_byte_seconds) / tok_s if tok_s else float("nan")
        out["persistent_bytes_per_token"] = {
            "kvstore": kv_per_token,
            "kvstore_global_only": g_bs / tok_s if tok_s else float("nan"),
            "baseline": base,
        }
        out["persistent_bytes_ratio_vs_baseline"] = kv_per_token / base if tok_s else float("nan")
        out["baseline"] = self.baseline.describe(b_per_token)
        dev_bs, dev_ts = self.integrals.tier_byte_seconds[0], self.integrals.tier_token_seconds[0]
        rt_bs, rt_ts = self.integrals.runtime_byte_seconds, self.integrals.runtime_token_seconds
        out["global_bytes_per_token"] = dev_bs / dev_ts if dev_ts else b_per_token
        out["global_bytes_per_token_layout"] = lay.global_bytes_per_token
        out["hbm_bytes_per_token"] = {
            "device_tier": dev_bs / dev_ts if dev_ts else None,
            "runtime_with_local_state": rt_bs / rt_ts if rt_ts else None,
            "layout_global": lay.global_bytes_per_token,
            "note": "runtime includes the encoder SWA window of each request in flight",
        }
        out["throughput"] = self.throughput()
        out["settings"] = self.settings
        out["counters"] = self.counters
        out["elapsed_seconds"] = round(self.elapsed_seconds, 3)
        return out

    def cases(self) -> dict[str, dict[str, Any]]:
        log = self.log
        out: dict[str, dict[str, Any]] = {}
        for k, name in enumerate(CASES):
            ttft = log.ttft[log.case == k]
            out[name] = {
                "count": int(ttft.shape[0]),
                "share": float(ttft.shape[0] / max(log.n, 1)),
                "ttft_p50_ms": _pct_ms(ttft, 50),
                "ttft_p99_ms": _pct_ms(ttft, 99),
                "ttft_mean_ms": float(ttft.mean() * 1e3) if ttft.size else None,
            }
        return out

    def hit_rate_by_tier(self) -> dict[str, float]:
        """Shares of prompt tokens by where they came from: each tier counts only the hits the engine
        could use (`usable`); `miss` is what it prefilled. A hit loaded and then thrown away (an
        expired hit with replay off, or a replay that failed) is a miss, and is also counted apart in
        `loaded_unused`; `global_hit_found` counts every hit found, used or not."""
        log, ct = self.log, self.spec.layout.chunk_tokens
        prompt = float(log.prompt.sum()) or 1.0
        used = log.usable > 0
        per = log.by_tier[used].sum(axis=0) * ct
        out: dict[str, float] = {t: float(per[k] / prompt) for k, t in enumerate(TIER_NAMES)}
        out["miss"] = float(log.prefill.sum() / prompt) if log.n else 1.0
        out["loaded_unused"] = float(log.by_tier[~used].sum() * ct / prompt)
        found = float(log.hit.sum() / prompt)
        out["global_hit_found"] = found  # includes hits left unused (expired with replay off)
        return out

    def bills_per_request(self) -> dict[str, float]:
        log, spec = self.log, self.spec
        lay = spec.layout
        n = max(log.n, 1)
        loaded_persistent = float(log.by_tier[:, 1:].sum() * lay.chunk_bytes + log.snapshot_loaded.sum())
        written = float(log.written_chunks.sum() * lay.chunk_bytes + log.snapshot_written.sum())
        cache_share = self.integrals.tier_byte_seconds[0] / n
        return {
            "prefill_tokens_avoided": float(log.hit.sum() / n),
            "net_prefill_tokens_avoided": float((log.usable.sum() - log.replay.sum()) / n),
            "prefill_flops_avoided": float(log.usable.sum() / n * spec.prefill_flops_per_token),
            "prefill_tokens": float(log.prefill.sum() / n),
            "replay_tokens": float(log.replay.sum() / n),
            "replay_flops": float(log.replay.sum() / n * spec.prefill_flops_per_token),
            "hbm_byte_seconds": float(log.runtime_byte_seconds.sum() / n + cache_share),
            "hbm_runtime_byte_seconds": float(log.runtime_byte_seconds.sum() / n),
            "hbm_cache_byte_seconds": float(cache_share),
            "persistent_bytes": written / n,
            "persistent_bytes_loaded": loaded_persistent / n,
            "persistent_byte_seconds": float(self.integrals.persistent_chunk_seconds * lay.chunk_bytes / n),
            "pool_byte_seconds": float(self.pool_byte_seconds / n),
        }

    def throughput(self) -> dict[str, float | None]:
        """Rates over the middle 80 % of request starts: the ramp-up and the tail of a few long think
        times would otherwise dilute the steady state a capacity planner asks about."""
        log = self.log
        out: dict[str, float | None] = {"makespan_seconds": self.end_seconds}
        order = np.argsort(log.start, kind="stable")
        lo, hi = int(log.n * 0.1), max(int(np.ceil(log.n * 0.9)) - 1, 0)
        window = float(log.start[order[hi]] - log.start[order[lo]]) if log.n > 1 else 0.0
        if window > 0:
            mid = order[lo:hi]
            out["window_seconds"] = window
            out["requests_per_second"] = float(mid.shape[0] / window)
            out["prompt_tokens_per_second"] = float(log.prompt[mid].sum() / window)
            out["gpu_busy_fraction"] = float(log.gpu_seconds[mid].sum() / window)
        else:
            out.update(window_seconds=0.0, requests_per_second=None, prompt_tokens_per_second=None,
                       gpu_busy_fraction=None)
        out["queue_wait_p50_ms"] = _pct_ms(log.start - log.arrival, 50)
        out["queue_wait_p99_ms"] = _pct_ms(log.start - log.arrival, 99)
        return out


def _pct_ms(x: np.ndarray, q: float) -> float | None:
    if x.size == 0:
        return None
    return float(np.percentile(x, q) * 1e3)
