"""What one commit decided, chunk by chunk: the tiers reserved for each chunk of the prefix's head,
and why every other chunk was skipped. `commit_txn` (commits.py) fills it in under the store's
lock and turns it into the `CommitResult`; it takes no lock and touches no tier itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvstore.store.types import SKIP_REASONS, CommitResult, SkipReason
from kvstore.tiers.base import TierName

# Skips that are a lack of room: a later chunk of the same commit needs as much room as the one
# refused, and room only shrinks while the commit holds its reservations.
ROOM_REASONS: frozenset[SkipReason] = frozenset({"no-room", "over-quota"})


@dataclass
class PlannedChunk:
    index: int
    payload: memoryview
    tiers: list[TierName]  # tiers holding a reservation for it (lmdb: written durably); [] once charged
    # The bytes reserved in each of them: given back and charged as reserved, though a layout
    # registered meanwhile may have raised a quantizing tier's footprint for this size.
    reserved: dict[TierName, int] = field(default_factory=dict)


@dataclass
class CommitPlan:
    new: list[tuple[int, memoryview]] = field(default_factory=list)  # chunks to store, head first
    planned: list[PlannedChunk] = field(default_factory=list)
    cut: SkipReason | None = None  # why the storable prefix ends, once it has
    full: set[TierName] = field(default_factory=set)  # tiers that refused a chunk of this commit
    already_present: int = 0
    inserted: set[int] = field(default_factory=set)  # chunk indexes this commit put in the index
    skipped: Counter[SkipReason] = field(default_factory=Counter)

    def after_cut(self) -> SkipReason:
        """Why a chunk after the cut is skipped: the same lack of room, or the gap before it."""
        assert self.cut is not None
        return self.cut if self.cut in ROOM_REASONS else "after-gap"

    def result(self, reach: int, durable: bool, remainder_tokens: int) -> CommitResult:
        """The reply, given how many leading chunks of the prefix the index holds now."""
        stored = sum(1 for i in self.inserted if i < reach)
        skipped = Counter(self.skipped)
        skipped["after-gap"] += len(self.inserted) - stored
        by_reason = {r: skipped[r] for r in SKIP_REASONS if skipped[r]}
        return CommitResult(
            stored_chunks=stored, already_present=self.already_present,
            skipped_chunks=sum(by_reason.values()), durable=durable,
            remainder_tokens=remainder_tokens, skipped_by_reason=by_reason,
        )
