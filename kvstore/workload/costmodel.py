"""The simulated mode's time model: what a request costs the GPU, and how long until its first token.

Role: price one request from the counts the byte model produces. Every parameter is a field with
its unit in the name, documented here and overridable from the command line (`--cost KEY=VALUE`).

Time to first token (no overlap between the terms; a conservative, stated simplification):

    TTFT = queue wait                                 (FIFO GPU, and HBM admission, see below)
         + lookup_seconds                             (one Lookup/Resume round trip)
         + prefill_tokens × prefill_seconds_per_token (tokens not served from the cache)
         + [replay_fixed_seconds + replay_tokens × prefill_seconds_per_token]   (expired hits)
         + Σ_tier bytes_loaded[tier] / bandwidth[tier]   (device, DRAM, LMDB → HBM)
         + snapshot_bytes / pool_bandwidth + pool_latency (warm hits: the local snapshot)

`prefill_seconds_per_token` defaults to the model's prefill FLOPs per token / (gpu_flops × mfu):
for DeepSeek-V4.1-Flash 2 × 8e9 FLOPs / (989e12 × 0.4) ≈ 40 µs, i.e. ~25k tokens/s on one H200
class GPU. Attention cost growing with context is not modelled (CSA2 reads at most 512 global
entries per query; the indexer's first scan is ignored). Replay runs the encoder path like prefill.

The GPU is busy for a request's TTFT work plus its share of batched decode
(`output_tokens × decode_gpu_seconds_per_token`). The request's runtime KV ((prompt + output)
tokens × global bytes/token) is resident in HBM from its start until its decode ends
(`output_tokens × decode_step_seconds` after the first token), and that HBM comes out of the
device tier's budget: the concurrency-dependent HBM budget that makes the cliff appear.

What it does not know: which tier held a chunk (it is given byte counts), TTLs, or policies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvstore.errors import InvalidInput
from kvstore.layout import TIER_NAMES, ModelSpec


@dataclass(frozen=True)
class CostModel:
    prefill_seconds_per_token: float = 0.0  # 0: derived from the model, gpu_flops and mfu
    gpu_flops: float = 989e12  # dense BF16 peak of one H200-class GPU
    mfu: float = 0.4  # achieved fraction of peak during prefill
    replay_fixed_seconds: float = 0.002  # launch overhead of one replay (latency-bound at 128 tokens)
    lookup_seconds: float = 0.0005  # one Lookup/Resume round trip to the sidecar
    device_bandwidth_bytes_per_second: float = 2.0e12  # HBM → HBM copy
    dram_bandwidth_bytes_per_second: float = 40e9  # pinned host DRAM → HBM over PCIe Gen5 x16
    lmdb_bandwidth_bytes_per_second: float = 5e9  # NVMe read incl. zstd decode, into HBM
    pool_bandwidth_bytes_per_second: float = 5e9  # local pool (Redis on the host) → HBM
    pool_latency_seconds: float = 0.0005  # one pool round trip
    decode_step_seconds: float = 0.03  # wall time per output token in a batch
    decode_gpu_seconds_per_token: float = 0.0005  # one request's share of a batched decode step

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            # NaN passes every comparison, and inf prices a request at forever: both are refused.
            if not math.isfinite(v) or v < 0 or (f.name.endswith("_per_second") and v <= 0):
                raise InvalidInput(f"cost model '{f.name}' must be a finite number >= 0 (> 0 for a rate), got {v}")
        if self.gpu_flops <= 0 or not 0 < self.mfu <= 1:
            raise InvalidInput(f"cost model needs gpu_flops > 0 and mfu in (0, 1], got {self.gpu_flops}, {self.mfu}")

    def resolved(self, model: ModelSpec) -> CostModel:
        """A copy with `prefill_seconds_per_token` filled in from the model's FLOPs."""
        if self.prefill_seconds_per_token > 0:
            return self
        per_token = model.prefill_flops_per_token / (self.gpu_flops * self.mfu)
        return dataclasses.replace(self, prefill_seconds_per_token=per_token)

    def bandwidth(self, tier: str) -> float:
        return float(getattr(self, f"{tier}_bandwidth_bytes_per_second"))

    def load_seconds(self, bytes_by_tier: tuple[int, int, int]) -> float:
        """Seconds to bring global chunks into HBM; bytes in tier order device, DRAM, LMDB."""
        return sum(b / self.bandwidth(t) for t, b in zip(TIER_NAMES, bytes_by_tier, strict=True) if b)

    def ttft_work_seconds(
        self, prefill_tokens: int, replay_tokens: int, bytes_by_tier: tuple[int, int, int], snapshot_bytes: int,
    ) -> float:
        """TTFT minus queueing. `prefill_seconds_per_token` must be resolved."""
        assert self.prefill_seconds_per_token > 0, "call resolved(model) first"
        t = self.lookup_seconds + prefill_tokens * self.prefill_seconds_per_token
        if replay_tokens:
            t += self.replay_fixed_seconds + replay_tokens * self.prefill_seconds_per_token
        t += self.load_seconds(bytes_by_tier)
        if snapshot_bytes:
            t += self.pool_latency_seconds + snapshot_bytes / self.pool_bandwidth_bytes_per_second
        return t

    def describe(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def parse_cost_overrides(base: CostModel, items: list[str]) -> CostModel:
    """Apply `KEY=VALUE` overrides (e.g. `dram_bandwidth_bytes_per_second=25e9`)."""
    known = {f.name for f in dataclasses.fields(CostModel)}
    changes: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            raise InvalidInput(f"--cost '{item}': expected KEY=VALUE with KEY one of {', '.join(sorted(known))}")
        try:
            changes[key] = float(value)
        except ValueError:
            raise InvalidInput(f"--cost '{item}': '{value}' is not a number") from None
    return dataclasses.replace(base, **changes)
