"""The weighted fair share: guarantees hold whatever another member holds; only what nobody is
owed may be borrowed; refusals say which limit."""

from __future__ import annotations

import pytest

from policies.fair_share import FairShare, most_over_share, weighted_split


def test_each_member_is_guaranteed_its_weighted_share() -> None:
    fs = FairShare(10, {"a": 1.0, "b": 1.0})
    assert [fs.try_take("a", 1) for _ in range(5)] == [None] * 5
    r = fs.try_take("a", 1)
    assert r is not None and r.limit == "share" and (r.used, r.share, r.total) == (5, 5, 10)
    assert [fs.try_take("b", 1) for _ in range(5)] == [None] * 5  # b's five are untouched
    fs.give_back("a", 1)
    assert fs.try_take("a", 1) is None


def test_only_the_rounding_remainder_may_be_borrowed() -> None:
    fs = FairShare(10, {"a": 1.0, "b": 2.0})  # shares 3 and 6; one unit nobody is owed
    assert fs.share("a") == 3 and fs.share("b") == 6
    assert fs.try_take("a", 4) is None
    assert fs.try_take("a", 1) is not None
    assert fs.try_take("b", 6) is None  # b still gets all of its share
    r = fs.try_take("b", 1)
    assert r is not None and r.limit == "ceiling"


def test_a_lone_member_has_the_whole_budget() -> None:
    fs = FairShare(8, {"default": 1.0})
    assert fs.try_take("default", 8) is None
    r = fs.try_take("default", 1)
    assert r is not None and r.limit == "ceiling"


def test_an_unnamed_member_joins_with_the_default_weight() -> None:
    fs = FairShare(12, {"a": 1.0, "b": 1.0})
    assert fs.share("c") == 4 and fs.share("a") == 4
    assert fs.try_take("c", 4) is None and fs.try_take("c", 1) is not None


def test_bad_amounts_are_refused() -> None:
    fs = FairShare(4, {"a": 1.0})
    with pytest.raises(ValueError):
        fs.try_take("a", -1)
    with pytest.raises(ValueError):
        fs.give_back("a", 1)
    with pytest.raises(ValueError):
        FairShare(4, {"a": 0.0})


# --- a byte budget shared by eviction (the embedded local pool) ------------------------------------
def test_weighted_split_is_between_the_members_only() -> None:
    # c is configured but holds nothing: it reserves nothing. d is not named: weight 1.
    assert weighted_split(900, {"a": 2.0, "b": 1.0, "c": 5.0}, ["a", "b"]) == {"a": 600.0, "b": 300.0}
    assert weighted_split(900, {"a": 2.0}, ["a", "d", "a"]) == {"a": 600.0, "d": 300.0}
    assert weighted_split(900, {}, []) == {}


def test_most_over_share_picks_the_tenant_most_over_then_the_soonest_expiry() -> None:
    shares = {"a": 50.0, "b": 50.0, "w": 50.0}
    # b is 30 over, a 10 over: b gives way whatever the expiries.
    assert most_over_share({"a": (60, 1.0), "b": (80, 9.0)}, shares, "w", 10) == "b"
    # Equally over: the one whose next entry expires soonest.
    assert most_over_share({"a": (70, 5.0), "b": (70, 3.0)}, shares, "w", 10) == "b"
    # The writer counts with what it adds: 45 + 20 puts it 15 over, past a's 10.
    assert most_over_share({"a": (60, 1.0), "w": (45, 9.0)}, shares, "w", 20) == "w"


def test_a_tenant_within_its_share_is_never_picked_for_another() -> None:
    shares = {"a": 50.0, "b": 50.0, "w": 50.0}
    assert most_over_share({"a": (50, 1.0), "b": (10, 0.5)}, shares, "w", 40) is None
    # The writer may always give up its own entries, even within its share.
    assert most_over_share({"a": (50, 1.0), "w": (10, 9.0)}, shares, "w", 5) == "w"
    assert most_over_share({}, shares, "w", 5) is None
