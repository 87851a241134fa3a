"""Unit tests of copy_governor: EMA, probation, suspension, backoff doubling and ceiling, reset."""

from __future__ import annotations

import json

import pytest
import specdec
from specdec_copy_governor import DEFAULTS, CopyGovernor, create_copy_governor

D = "ngram_copy"


def gov(**options):
    """A request's session of a copy governor built with ``options``."""
    return create_copy_governor(**options).session()


def round_(g, drafter, max_len, accepted):
    """One round: ask for a budget; if granted, propose that much and accept ``accepted`` of it.

    Returns the budget (0 when suspended)."""
    b = g.budget(drafter, max_len)
    if b > 0:
        g.observe(drafter, b, min(accepted, b) if accepted is not None else b)
    return b


def good(g, drafter=D, max_len=16):
    return round_(g, drafter, max_len, None)


def poor(g, drafter=D, max_len=16):
    return round_(g, drafter, max_len, 0)


def suspended_for(g, drafter=D):
    """Count rounds until the drafter gets a non-zero budget again (consumes that round)."""
    n = 0
    while g.budget(drafter, 16) == 0:
        n += 1
        assert n < 10_000
    return n


# -- options ---------------------------------------------------------------------------


def test_defaults():
    g = create_copy_governor()
    assert g.name == "copy_governor"
    for k, v in DEFAULTS.items():
        assert getattr(g, k) == v
    assert DEFAULTS == {
        "alpha": 0.3,
        "good_fraction": 0.5,
        "poor_fraction": 0.25,
        "probation_rounds": 2,
        "probation_cap": 4,
        "shrink_below": 0.3,
        "suspend_after": 3,
        "suspend_rounds": 8,
        "max_suspend_rounds": 256,
        "shadow": True,
        "resume_matches": 2,
    }


def test_unknown_option_names_the_accepted_ones():
    with pytest.raises(specdec.PolicyError) as exc:
        gov(probation=3)
    for name in DEFAULTS:
        assert name in str(exc.value)


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"alpha": 0}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"good_fraction": "x"}, "good_fraction"),
        ({"poor_fraction": 0.6, "good_fraction": 0.5}, "below"),
        ({"probation_rounds": -1}, "probation_rounds"),
        ({"probation_cap": 0}, "probation_cap"),
        ({"suspend_after": 0}, "suspend_after"),
        ({"suspend_rounds": 2.0}, "suspend_rounds"),
        ({"suspend_rounds": 8, "max_suspend_rounds": 4}, "max_suspend_rounds"),
        ({"shrink_below": True}, "shrink_below"),
        ({"shadow": "yes"}, "shadow"),
        ({"resume_matches": 0}, "resume_matches"),
    ],
)
def test_bad_option_values(options, fragment):
    with pytest.raises(specdec.PolicyError, match=fragment):
        gov(**options)


# -- EMA -----------------------------------------------------------------------------------


def test_ema_of_accepted_fraction():
    g = gov(alpha=0.5, probation_rounds=0)
    g.observe(D, 4, 4)
    assert g.state(D).ema == 1.0  # the first round sets it
    g.observe(D, 4, 2)
    assert g.state(D).ema == pytest.approx(0.75)
    g.observe(D, 8, 0)
    assert g.state(D).ema == pytest.approx(0.375)
    st = g.stats()["drafters"][D]
    assert st["ema"] == pytest.approx(0.375)
    assert (st["rounds"], st["proposed"], st["accepted"]) == (3, 16, 6)


def test_observe_ignores_empty_rounds_and_clamps():
    g = gov()
    g.observe(D, 0, 0)
    assert g.state(D).rounds == 0 and g.state(D).ema is None
    g.observe(D, 4, 9)
    assert g.state(D).ema == 1.0 and g.state(D).accepted == 4


# -- probation -----------------------------------------------------------------------------


def test_probation_caps_blocks_until_enough_good_rounds():
    g = gov(probation_rounds=2, probation_cap=4)
    assert g.on_probation(D)
    assert g.budget(D, 16) == 4
    assert g.budget(D, 3) == 3  # never more than max_len
    g.observe(D, 4, 4)
    assert g.budget(D, 16) == 4  # one good round is not enough
    g.observe(D, 4, 3)
    assert not g.on_probation(D)
    assert g.budget(D, 16) == 16
    assert g.stats()["drafters"][D]["cap"] is None


def test_neutral_and_poor_rounds_do_not_end_probation():
    g = gov(probation_rounds=1)
    g.observe(D, 4, 1)  # 0.25: poor
    g.observe(D, 4, 0)
    assert g.on_probation(D)
    g.observe(D, 10, 4)  # 0.4: neither good nor poor
    assert g.on_probation(D)


def test_no_probation_when_zero_rounds():
    assert gov(probation_rounds=0).budget(D, 16) == 16


def test_low_ema_shrinks_blocks_after_probation():
    g = gov(probation_rounds=1, probation_cap=4, shrink_below=0.5, alpha=1.0, suspend_after=99)
    g.observe(D, 4, 4)
    assert g.budget(D, 16) == 16
    g.observe(D, 16, 6)  # EMA 0.375 < 0.5 (alpha 1: the last round)
    assert g.budget(D, 16) == 4
    g.observe(D, 4, 4)
    assert g.budget(D, 16) == 16


# -- suspension and backoff -------------------------------------------------------------------


def test_suspends_after_consecutive_poor_rounds():
    g = gov(suspend_after=3, suspend_rounds=5)
    poor(g)
    poor(g)
    assert not g.suspended(D)
    poor(g)
    assert g.suspended(D)
    assert g.cap(D) == 0
    assert suspended_for(g) == 5
    st = g.stats()
    assert st["suspensions"] == 1 and st["suspended_rounds"] == 5
    assert st["drafters"][D]["suspended_rounds"] == 5


def test_poor_rounds_must_be_consecutive():
    g = gov(suspend_after=3)
    poor(g)
    poor(g)
    round_(g, D, 10, 4)  # 0.4: neutral, breaks the streak
    poor(g)
    poor(g)
    assert not g.suspended(D)
    poor(g)
    assert g.suspended(D)


def test_backoff_doubles_on_each_new_suspension_up_to_ceiling():
    g = gov(suspend_after=2, suspend_rounds=3, max_suspend_rounds=20)
    lengths = []
    for _ in range(6):
        rounds = 0
        while not g.suspended(D):  # poor rounds, no good round in between
            poor(g)
            rounds += 1
        assert rounds == 2
        lengths.append(suspended_for(g))
    assert lengths == [3, 6, 12, 20, 20, 20]
    st = g.stats()
    assert st["suspensions"] == 6
    assert st["suspended_rounds"] == sum(lengths)
    assert st["drafters"][D]["next_backoff"] == 20


def test_good_round_resets_backoff():
    g = gov(suspend_after=2, suspend_rounds=4, max_suspend_rounds=64)
    poor(g)
    poor(g)
    assert suspended_for(g) == 4
    g.observe(D, 4, 0)
    poor(g)
    assert suspended_for(g) == 8
    g.observe(D, 4, 4)  # a good round
    assert g.stats()["drafters"][D]["next_backoff"] == 4
    poor(g)
    poor(g)
    assert suspended_for(g) == 4


def test_probation_again_after_suspension():
    g = gov(probation_rounds=1, probation_cap=2, suspend_after=1, suspend_rounds=1)
    good(g)
    assert g.budget(D, 16) == 16
    g.observe(D, 16, 0)  # poor: suspended at once
    assert g.budget(D, 16) == 0
    assert g.on_probation(D)
    assert g.budget(D, 16) == 2
    g.observe(D, 2, 2)
    assert g.budget(D, 16) == 16


def test_each_drafter_has_its_own_state():
    g = gov(suspend_after=1, suspend_rounds=2)
    poor(g, "ngram_copy")
    assert g.budget("ngram_copy", 16) == 0
    assert g.budget("my_mtp", 16) == 4  # another drafter, any name, unaffected
    assert set(g.stats()["drafters"]) == {"ngram_copy", "my_mtp"}


def test_each_session_starts_fresh():
    governor = create_copy_governor(suspend_after=1)
    g = governor.session()
    poor(g)
    assert g.suspended(D)
    g = governor.session()  # the next request
    assert not g.suspended(D)
    st = g.stats()
    assert st["suspensions"] == 0 and st["suspended_rounds"] == 0
    assert st["drafters"][D]["rounds"] == 0


def test_stats_are_json_serialisable():
    g = gov()
    good(g)
    poor(g, "other")
    json.dumps(g.stats())


def test_is_a_governor():
    assert isinstance(create_copy_governor(), specdec.Governor)
    assert isinstance(create_copy_governor(), CopyGovernor)
    assert isinstance(gov(), specdec.GovernorSession)


def test_workload_shape_copy_then_prose():
    """A drafter that is right for a while, then wrong: probation, full blocks, suspension."""
    g = gov()
    budgets = [round_(g, D, 16, None) for _ in range(5)]
    assert budgets == [4, 4, 16, 16, 16]
    budgets = [round_(g, D, 16, 0) for _ in range(3 + 8 + 1)]
    assert budgets[:3] == [16, 16, 16]
    assert budgets[3:11] == [0] * 8
    assert budgets[11] == 4  # back on probation


def test_tokens_spent_suspended_are_counted_from_rounds():
    from specdec import RoundResult

    g = create_copy_governor(suspend_after=1, suspend_rounds=2).session()
    g.budget("d", 8)
    g.observe("d", 4, 0)  # poor round: suspended for 2 rounds
    assert g.budget("d", 8) == 0
    g.observe_round(RoundResult(drafter=None, block=(), n_accepted=0, token=1, committed=(1,)))
    assert g.budget("d", 8) == 0
    g.observe_round(RoundResult(drafter=None, block=(), n_accepted=0, token=2, committed=(2,)))
    assert g.budget("d", 8) > 0
    g.observe_round(
        RoundResult(drafter="d", block=(5, 6), n_accepted=2, token=3, committed=(5, 6, 3))
    )
    st = g.stats()
    assert st["suspended_rounds"] == 2
    assert st["suspended_tokens"] == 2
    assert st["drafters"]["d"]["suspended_tokens"] == 2


# -- shadow scoring ------------------------------------------------------------------


def rr(start, committed, shadows=None):
    """A round that committed ``committed`` at ``start`` (a plain step unless told)."""
    return specdec.RoundResult(
        drafter=None,
        block=(),
        n_accepted=0,
        token=committed[-1],
        committed=tuple(committed),
        start_position=start,
        shadows=shadows or {},
    )


def suspend(g, drafter=D):
    for _ in range(g.config.suspend_after):
        poor(g, drafter)
    assert g.suspended(drafter)


def test_matching_shadow_proposals_end_a_suspension():
    g = gov(resume_matches=2)
    suspend(g)
    assert g.budget(D, 16) == 0
    g.observe_round(rr(100, [5], {D: (5, 6, 7, 8)}))  # one token matched so far
    assert g.suspended(D)
    assert g.budget(D, 16) == 0
    g.observe_round(rr(101, [6], {D: (6, 7, 8, 9)}))  # a second one: resume
    assert not g.suspended(D)
    st = g.stats()["drafters"][D]
    assert st["shadow_resumes"] == 1 and st["shadow_rounds"] == 1
    assert st["shadow_accepted"] == 2 and st["good_rounds"] == 1
    assert g.budget(D, 16) > 0


def test_a_fully_matched_short_shadow_resumes_at_once():
    g = gov(resume_matches=8)
    suspend(g)
    g.budget(D, 16)
    g.observe_round(rr(50, [1, 2, 3], {D: (1, 2)}))  # another drafter's round committed 3
    assert not g.suspended(D)
    assert g.stats()["shadow_resumes"] == 1


def test_poor_shadows_extend_the_suspension_with_the_backoff():
    g = gov(suspend_rounds=4, suspend_after=2)
    suspend(g)
    first = g.state(D).suspended_left
    assert first == 4
    pos = 10
    for _ in range(2):  # two poor shadow outcomes in a row while suspended
        g.budget(D, 16)
        g.observe_round(rr(pos, [1], {D: (9, 9, 9)}))
        pos += 1
    s = g.state(D)
    assert s.suspensions == 2 and s.shadow_extensions == 1
    assert s.suspended_left == 8  # the doubled backoff, counted from now
    assert g.stats()["shadow_extensions"] == 1


def test_shadows_are_ignored_when_off_and_dropped_once_drafting_resumes():
    g = gov(shadow=False)
    suspend(g)
    g.budget(D, 16)
    g.observe_round(rr(0, [5], {D: (5, 6)}))
    g.budget(D, 16)
    g.observe_round(rr(1, [6], {D: (6, 7)}))
    assert g.suspended(D) and g.stats()["shadow_rounds"] == 0
    g2 = gov(resume_matches=5, suspend_rounds=1)
    suspend(g2)
    assert g2.budget(D, 16) == 0  # the last suspended round
    g2.observe_round(rr(0, [5], {D: (5, 6, 7, 8, 9, 10)}))
    assert g2.state(D).pending is not None
    assert g2.budget(D, 16) > 0  # drafting for real again
    g2.observe_round(rr(1, [6]))
    assert g2.state(D).pending is None and g2.stats()["shadow_rounds"] == 0


def test_a_shadow_is_scored_at_the_probation_cap_it_would_resume_with():
    g = gov(probation_cap=3, resume_matches=8)
    suspend(g)
    g.budget(D, 16)
    # 3 of 8 would match: a poor 3/8 at full length, but the block after the
    # suspension is capped at 3, and those 3 all match.
    g.observe_round(rr(0, [1, 2, 3, 9], {D: (1, 2, 3, 4, 5, 6, 7, 8)}))
    s = g.state(D)
    assert s.shadow_rounds == 1 and s.shadow_proposed == 3 and s.shadow_accepted == 3
    assert not g.suspended(D) and s.shadow_resumes == 1
    g2 = gov(probation_rounds=0, resume_matches=8)
    suspend(g2)
    g2.budget(D, 16)
    g2.observe_round(rr(0, [1, 2, 3, 9], {D: (1, 2, 3, 4, 5, 6, 7, 8)}))
    assert g2.state(D).shadow_proposed == 8  # no probation: scored at full length


def test_the_session_says_whether_it_reads_shadows():
    assert gov().wants_shadows is True
    assert gov(shadow=False).wants_shadows is False
    assert specdec.BaseGovernorSession().wants_shadows is True  # absent means True too


def test_shadow_across_a_gap_is_dropped_unscored():
    g = gov()
    suspend(g)
    g.budget(D, 16)
    g.observe_round(rr(0, [5], {D: (5, 6, 7)}))
    g.budget(D, 16)
    g.observe_round(rr(7, [6]))  # positions 1..6 never seen
    assert g.state(D).pending is None and g.stats()["shadow_rounds"] == 0


def test_shadow_after_forced_tokens_is_scored_from_after_them():
    """On a constrained request's round whose block opened with forced tokens, a
    suspended drafter's shadow was proposed after them: scored from there, a right
    shadow counts as right."""
    gov = CopyGovernor().session()
    s = gov.state("ngram_copy")
    s.suspended_left = 3
    assert gov.budget("ngram_copy", 8) == 0
    gov.observe_round(
        specdec.RoundResult(
            drafter="grammar",
            block=(10, 11),
            n_accepted=2,
            token=20,
            committed=(10, 11, 20),
            start_position=100,
            shadows={"ngram_copy": (20, 21, 22)},
            forced=2,
        )
    )
    p = gov.state("ngram_copy").pending
    assert p is not None and p.matched == 1 and not p.resolved
