"""The weighted fair share: guarantees hold whatever another member holds; only what nobody is
owed may be borrowed; refusals say which limit."""

from __future__ import annotations

import pytest

from policies.fair_share import FairShare


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
