"""A request's three bills (docs/architecture.md §7), as one typed value from the servicer that prices
it to the client that reads it and the observers that sum it.

`price` is the one pricing function: per tier the tokens and chunks hit and the bytes a load moves
(or would move), the prefill tokens (and FLOPs) avoided and still due, replay tokens (and FLOPs)
spent, and the local-snapshot bytes at the boundary. `to_pb` and `from_pb` are its `kvstore.v1.Bills`
message: the wire carries every field but the replay FLOPs, which `from_pb` prices again when told
the model's FLOPs per token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.layout import TIER_NAMES
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import PB_TO_TIER, TIER_TO_PB


@dataclass(frozen=True, slots=True)
class TierBill:
    hit_tokens: int = 0
    hit_chunks: int = 0
    bytes: int = 0  # a Lookup: bytes a load of the hit would move from this tier; a Resume: bytes it moved


@dataclass(frozen=True, slots=True)
class Bills:
    prompt_tokens: int
    prefill_tokens_avoided: int  # the global hit
    # Prompt tokens the engine still prefills: the prompt past the hit, or all of it when the
    # model keeps local state and the engine is left without it at the boundary.
    prefill_tokens: int
    replay_tokens: int  # tokens replayed to rebuild local state
    tiers: Mapping[str, TierBill]  # every tier of TIER_NAMES, fastest first
    local_bytes: int = 0  # local snapshot bytes at the boundary (held / moved)
    # The prefill compute the engine skips: the prompt tokens it does not prefill (prompt_tokens -
    # prefill_tokens) at the model's prefill FLOPs per token. The global hit, unless the engine is
    # left without local state at the boundary: then it prefills everything and skips nothing (0).
    prefill_flops_avoided: float = 0.0
    # At the model's prefill FLOPs per token; a client derives that from prefill_flops_avoided /
    # prefill_tokens_avoided (0.0 on a bill with no hit, where no replay runs, or one whose local
    # state was lost, where no replay rebuilt it).
    replay_flops: float = 0.0

    @property
    def bytes_moved(self) -> int:
        return sum(t.bytes for t in self.tiers.values()) + self.local_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_avoided": self.prefill_tokens_avoided,
            "prefill_tokens": self.prefill_tokens,
            "replay_tokens": self.replay_tokens,
            "prefill_flops_avoided": self.prefill_flops_avoided,
            "replay_flops": self.replay_flops,
            "local_bytes": self.local_bytes,
            "tiers": {name: {"hit_tokens": t.hit_tokens, "hit_chunks": t.hit_chunks, "bytes": t.bytes}
                      for name, t in self.tiers.items()},
        }


_NO_BILL = TierBill()
_NO_BILLS: dict[str, TierBill] = dict.fromkeys(TIER_NAMES, _NO_BILL)


def price(
    *,
    prompt_tokens: int,
    chunk_tokens: int,
    chunk_bytes: int,
    chunk_tiers: Sequence[str],
    flops_per_token: float,
    replay_tokens: int = 0,
    local_bytes: int = 0,
    moved: bool = True,
    local_lost: bool = False,
) -> Bills:
    """The bills of a request whose hit chunks sit in `chunk_tiers` (the tier of each, in order).
    `moved`: their bytes are (or would be) loaded; False when the engine kept the chunks and only
    the boundary was resumed. `local_lost`: the model keeps local state and the engine is left
    without it at the boundary (expired, not rebuilt): it cannot resume at the hit, so it prefills
    the whole prompt (`prefill_tokens` is the prompt, `prefill_flops_avoided` 0);
    `prefill_tokens_avoided` stays the global hit, what the store held (the chunks' tiers and bytes
    are billed as they were moved)."""
    n_hit = len(chunk_tiers)
    hit = n_hit * chunk_tokens
    if hit > prompt_tokens:
        raise ValueError(f"a hit of {hit} tokens is longer than the {prompt_tokens}-token prompt")
    # C-level counts, not a Python loop over every chunk (256 for 32K tokens); usually one tier
    # holds them all, and one count says so.
    if n_hit and chunk_tiers[0] in TIER_NAMES and chunk_tiers.count(chunk_tiers[0]) == n_hit:
        counts: dict[str, int] = {chunk_tiers[0]: n_hit}
    else:
        counts = {t: chunk_tiers.count(t) for t in TIER_NAMES}
    if sum(counts.values()) != n_hit:
        raise ValueError(f"unknown tiers in {sorted(set(chunk_tiers) - set(TIER_NAMES))}")
    per_chunk = chunk_bytes if moved else 0
    tiers = dict(_NO_BILLS)
    for name, n in counts.items():
        if n:
            tiers[name] = TierBill(n * chunk_tokens, n, n * per_chunk)
    prefill = prompt_tokens if local_lost else prompt_tokens - hit
    return Bills(
        prompt_tokens=prompt_tokens,
        prefill_tokens_avoided=hit,
        prefill_tokens=prefill,
        replay_tokens=replay_tokens,
        tiers=tiers,
        local_bytes=local_bytes,
        # What the engine skips, not what the store held: 0 when it prefills the whole prompt.
        prefill_flops_avoided=(prompt_tokens - prefill) * flops_per_token,
        replay_flops=replay_tokens * flops_per_token,
    )


def to_pb(b: Bills) -> pb.Bills:
    # Sub-messages given as mappings: the library fills them in place (a built TierBill is copied).
    return pb.Bills(
        prompt_tokens=b.prompt_tokens,
        prefill_tokens_avoided=b.prefill_tokens_avoided,
        prefill_tokens=b.prefill_tokens,
        replay_tokens=b.replay_tokens,
        tiers=[
            {"tier": TIER_TO_PB[name], "hit_tokens": t.hit_tokens, "hit_chunks": t.hit_chunks, "bytes": t.bytes}
            for name, t in b.tiers.items()
        ],
        local_bytes=b.local_bytes,
        prefill_flops_avoided=b.prefill_flops_avoided,
    )


def from_pb(m: pb.Bills, flops_per_token: float = 0.0) -> Bills:
    """The bills a reply carried; tiers the message left out (or that this client does not know)
    read as nothing hit. The replay FLOPs are priced at `flops_per_token` (0: not priced)."""
    got: dict[str, TierBill] = {}
    for t in m.tiers:
        name = PB_TO_TIER.get(t.tier)
        if name is not None:
            got[name] = TierBill(t.hit_tokens, t.hit_chunks, t.bytes)
    return Bills(
        prompt_tokens=m.prompt_tokens,
        prefill_tokens_avoided=m.prefill_tokens_avoided,
        prefill_tokens=m.prefill_tokens,
        replay_tokens=m.replay_tokens,
        tiers={name: got.get(name, _NO_BILL) for name in TIER_NAMES},
        local_bytes=m.local_bytes,
        prefill_flops_avoided=m.prefill_flops_avoided,
        replay_flops=m.replay_tokens * flops_per_token,
    )

