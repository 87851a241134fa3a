"""specdec.depth.AdaptiveDepth: the depth rule the model-head drafters share."""

from __future__ import annotations

import pytest
from specdec.depth import AdaptiveDepth


def test_adaptive_depth_rule():
    a = AdaptiveDepth(2, 4, window=32)
    for _ in range(31):
        assert a.observe(2, 2) == 2  # the window is not full yet
    assert a.observe(2, 2) == 3 and a.grew == 1
    for _ in range(7):
        assert a.observe(3, 2) == 3  # reached the third position 7 times, never accepted
    assert a.observe(3, 2) == 2 and a.shrank == 1
    b = AdaptiveDepth(2, 4, window=32)
    for i in range(32):
        b.observe(2, 2 if i % 2 else 1)  # half the rounds full: below 65%
    assert b.depth == 2
    d = AdaptiveDepth(3, 4, window=32)
    for _ in range(7):
        assert d.observe(3, 0) == 3  # nothing accepted: the deep positions never reached
    assert d.observe(3, 0) == 2 and d.shrank == 1
    for _ in range(8):
        d.observe(2, 0)
    assert d.depth == 1  # down to one draft, not below
    for _ in range(20):
        assert d.observe(1, 0) == 1
    c = AdaptiveDepth(2, 4, adaptive=False)
    for _ in range(40):
        c.observe(2, 2)
    assert c.depth == 2


def test_min_depth_is_a_floor_and_max_depth_a_ceiling():
    d = AdaptiveDepth(3, 5, window=8, min_depth=3)
    for _ in range(40):
        assert d.observe(3, 0) == 3  # never accepted: it would shrink, but 3 is the floor
    assert d.shrank == 0
    for _ in range(8):
        d.observe(3, 3)
    assert d.depth == 4 and d.grew == 1  # every round reached the depth: grow
    for _ in range(8):
        d.observe(4, 4)
    assert d.depth == 5
    for _ in range(16):
        assert d.observe(5, 5) == 5  # the ceiling
    for _ in range(8):
        d.observe(5, 3)  # the deeper positions stop paying: back down, not below 3
    assert d.depth == 4
    for _ in range(8):
        d.observe(4, 0)
    assert d.depth == 3
    for _ in range(8):
        d.observe(3, 0)
    assert d.depth == 3
    with pytest.raises(ValueError, match="min_depth <= depth <= max_depth"):
        AdaptiveDepth(2, 4, min_depth=3)


def test_outcomes_are_counted_per_position():
    d = AdaptiveDepth(3, 4, adaptive=False)
    assert d.stats()["position_reached"] == []
    d.observe(3, 3)  # all three accepted
    d.observe(3, 1)  # the first only
    d.observe(2, 0)  # a shorter block (max_len), none accepted
    st = d.stats()
    assert st["position_reached"] == [3, 3, 2]
    assert st["position_accepted"] == [2, 1, 1]
    assert st["position_acceptance"] == [round(2 / 3, 4), round(1 / 3, 4), 0.5]
    assert (st["depth"], st["depth_grew"], st["depth_shrank"]) == (3, 0, 0)
