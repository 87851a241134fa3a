"""CopyGovernor: probation, suspension with backoff, and an acceptance EMA per drafter.

A copy drafter is free when it has nothing to say (no match, no draft), but a
wrong block costs a wider verify forward. The governor keeps that cost small:

- **EMA.** After every verified block it updates an exponential moving average
  of the fraction of the block that was accepted.
- **Probation.** Until a drafter has had ``probation_rounds`` good rounds
  (fraction ``>= good_fraction``), its blocks are capped at ``probation_cap``.
  After a suspension it is on probation again. Off probation, a drafter whose
  EMA has fallen below ``shrink_below`` is capped at ``probation_cap`` too.
- **Suspension.** After ``suspend_after`` poor rounds in a row (fraction
  ``<= poor_fraction``) the drafter gets a budget of 0 for the next
  ``backoff`` rounds. ``backoff`` starts at ``suspend_rounds``, doubles on each
  new suspension up to ``max_suspend_rounds``, and resets to ``suspend_rounds``
  after a good round.

- **Shadow scoring** (``shadow``, on by default). While a drafter is suspended,
  the core asks it what it *would* have proposed (``DrafterSession.shadow``, for
  drafters whose proposals are cheap) and hands that to the governor in
  ``RoundResult.shadows``. The governor compares the proposal with the tokens the
  target commits from then on (:class:`specdec.shadow.ShadowScore`: no extra forward)
  and scores the outcome as it scores a verified round: a good shadow round ends
  the suspension at once and counts towards probation, poor ones in a row extend
  it (with the doubling backoff). A suspension also ends as soon as a pending
  shadow proposal has matched ``resume_matches`` tokens.

A round is one call of :meth:`CopyGovernor.budget` for that drafter; while it is
suspended, each of its rounds is a round in which it was not asked (a plain
decode step when no other drafter proposes, i.e. one token). The governor
works for any drafter, by name; each drafter has its own state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import specdec
from specdec import BaseGovernor, BaseGovernorSession, RequestContext, RoundResult
from specdec.options import Option, Options
from specdec.shadow import ShadowScore

NAME = "copy_governor"


def _above_zero(value: float) -> float:
    if value == 0:
        raise ValueError(f"option alpha must be > 0, got {value!r}")
    return float(value)


#: The options of ``copy_governor`` (see the README for what each one does).
OPTIONS = Options(
    NAME,
    [
        Option("alpha", float, default=0.3, minimum=0, maximum=1, check=_above_zero),
        Option("good_fraction", float, default=0.5, minimum=0, maximum=1),
        Option("poor_fraction", float, default=0.25, minimum=0, maximum=1),
        Option("probation_rounds", int, default=2, minimum=0),
        Option("probation_cap", int, default=4, minimum=1),
        Option("shrink_below", float, default=0.3, minimum=0, maximum=1),
        Option("suspend_after", int, default=3, minimum=1),
        Option("suspend_rounds", int, default=8, minimum=1),
        Option("max_suspend_rounds", int, default=256, minimum=1),
        Option("shadow", bool, default=True),
        Option("resume_matches", int, default=2, minimum=1),
    ],
)
#: Default options of ``copy_governor``.
DEFAULTS: Mapping[str, Any] = OPTIONS.defaults


class DrafterState:
    """What the governor knows about one drafter (mutable, per request)."""

    __slots__ = (
        "ema",
        "rounds",
        "proposed",
        "accepted",
        "good_rounds",
        "poor_streak",
        "suspended_left",
        "suspensions",
        "suspended_rounds",
        "suspended_tokens",
        "skipped_this_round",
        "backoff",
        "last_cap",
        "pending",
        "shadow_rounds",
        "shadow_proposed",
        "shadow_accepted",
        "shadow_resumes",
        "shadow_extensions",
    )

    def __init__(self, backoff: int) -> None:
        self.ema: float | None = None
        self.rounds = 0
        self.proposed = 0
        self.accepted = 0
        self.good_rounds = 0  # good rounds since the last suspension
        self.poor_streak = 0
        self.suspended_left = 0
        self.suspensions = 0
        self.suspended_rounds = 0
        self.suspended_tokens = 0
        self.skipped_this_round = False
        self.backoff = backoff
        self.last_cap: int | None = None
        self.pending: ShadowScore | None = None
        self.shadow_rounds = 0  # shadow proposals scored
        self.shadow_proposed = 0
        self.shadow_accepted = 0
        self.shadow_resumes = 0  # suspensions ended by a shadow outcome
        self.shadow_extensions = 0  # suspensions extended by poor shadow outcomes


class CopyGovernor(BaseGovernor):
    """Caps and suspends drafters whose blocks are not accepted.

    Args:
        alpha: weight of the newest round in the acceptance EMA (0 < alpha <= 1).
        good_fraction: a round whose accepted fraction is at least this is good.
        poor_fraction: a round whose accepted fraction is at most this is poor.
        probation_rounds: good rounds a drafter needs before its blocks are uncapped
            (0: no probation).
        probation_cap: the block cap on probation (and while the EMA is below
            ``shrink_below``).
        shrink_below: off probation, an EMA below this caps blocks at
            ``probation_cap`` again (0: never).
        suspend_after: poor rounds in a row that suspend a drafter.
        suspend_rounds: the first suspension's length in rounds; also what the
            backoff resets to after a good round.
        max_suspend_rounds: the ceiling of the doubling backoff.
        shadow: score the proposals a suspended drafter would have made (see the
            module docstring).
        resume_matches: a pending shadow proposal that has matched this many tokens
            ends a suspension before it is resolved.

    Raises:
        specdec.PolicyError: an option has a bad value.
    """

    name = NAME
    #: Sessions keep only their own counts: rows of a batch are independent.
    supports_batch = True

    def __init__(self, **options: Any) -> None:
        o = OPTIONS.parse(options)
        if o.poor_fraction >= o.good_fraction:
            raise specdec.PolicyError(
                f"{NAME}: poor_fraction ({o.poor_fraction}) must be below good_fraction "
                f"({o.good_fraction})"
            )
        if o.max_suspend_rounds < o.suspend_rounds:
            raise specdec.PolicyError(
                f"{NAME}: max_suspend_rounds ({o.max_suspend_rounds}) must be >= "
                f"suspend_rounds ({o.suspend_rounds})"
            )
        self.alpha = o.alpha
        self.good_fraction = o.good_fraction
        self.poor_fraction = o.poor_fraction
        self.probation_rounds = o.probation_rounds
        self.probation_cap = o.probation_cap
        self.shrink_below = o.shrink_below
        self.suspend_after = o.suspend_after
        self.suspend_rounds = o.suspend_rounds
        self.max_suspend_rounds = o.max_suspend_rounds
        self.shadow = o.shadow
        self.resume_matches = o.resume_matches

    # -- the Governor protocol ----------------------------------------------------

    def session(self, ctx: RequestContext | None = None) -> CopyGovernorSession:
        """Start a request: every drafter starts fresh (on probation, not suspended)."""
        return CopyGovernorSession(self)


class CopyGovernorSession(BaseGovernorSession):
    """One request's governing state: a :class:`DrafterState` per drafter.

    Args:
        config: the :class:`CopyGovernor` whose options apply.
    """

    def __init__(self, config: CopyGovernor) -> None:
        self.config = config
        self._states: dict[str, DrafterState] = {}
        #: Shadow proposals are asked for only when ``shadow`` is on.
        self.wants_shadows = config.shadow

    def budget(self, drafter: str, max_len: int) -> int:
        """How many tokens ``drafter`` may propose this round (0 while it is suspended)."""
        s = self.state(drafter)
        if s.suspended_left > 0:
            s.suspended_left -= 1
            s.suspended_rounds += 1
            s.skipped_this_round = True
            return 0
        cap = self.cap(drafter)
        s.last_cap = cap
        return max(0, min(cap, max_len)) if cap is not None else max(0, max_len)

    def observe(self, drafter: str, proposed: int, accepted: int) -> None:
        """Learn that ``drafter`` proposed ``proposed`` tokens and ``accepted`` were kept."""
        if proposed <= 0:
            return
        s = self.state(drafter)
        accepted = max(0, min(accepted, proposed))
        s.rounds += 1
        s.proposed += proposed
        s.accepted += accepted
        self._score(s, proposed, accepted)

    def _score(self, s: DrafterState, proposed: int, accepted: int) -> None:
        # One outcome, verified or shadow: EMA, probation, backoff and suspension.
        frac = accepted / proposed
        s.ema = (
            frac if s.ema is None else self.config.alpha * frac + (1.0 - self.config.alpha) * s.ema
        )
        if frac >= self.config.good_fraction:
            s.good_rounds += 1
            s.poor_streak = 0
            s.backoff = self.config.suspend_rounds
        elif frac <= self.config.poor_fraction:
            s.poor_streak += 1
            if s.poor_streak >= self.config.suspend_after:
                self._suspend(s)
        else:
            s.poor_streak = 0  # "several poor rounds" means in a row

    def observe_round(self, result: RoundResult) -> None:
        """Count the tokens committed in a round a drafter sat out suspended, and score
        shadow proposals against what the round committed."""
        sat_out = set()
        for name, s in self._states.items():
            if s.skipped_this_round:
                s.suspended_tokens += len(result.committed)
                s.skipped_this_round = False
                sat_out.add(name)
        if not self.config.shadow:
            return
        for name, tokens in result.shadows.items():
            s = self.state(name)
            if s.pending is None and tokens:
                # Scored at the length the drafter would get back: a suspension ends
                # on probation, where blocks are capped at probation_cap.
                if self.config.probation_rounds > 0:
                    tokens = tokens[: self.config.probation_cap]
                # proposed after the round's forced tokens (a grammar's), if any
                s.pending = ShadowScore(result.start_position + result.forced, tokens)
        for name, s in self._states.items():
            if s.pending is None:
                continue
            if name in sat_out:
                self._feed_shadow(s, result)
            else:
                s.pending = None  # drafting for real again: real rounds score it now

    def _feed_shadow(self, s: DrafterState, result: RoundResult) -> None:
        p = s.pending
        assert p is not None
        p.feed(result.start_position, result.committed)
        if p.lost:
            s.pending = None
            return
        if not p.resolved:
            if s.suspended_left > 0 and p.matched >= self.config.resume_matches:
                # Matching already: resume now, scored as the good round it is so far.
                s.pending = None
                s.shadow_rounds += 1
                s.shadow_proposed += p.matched
                s.shadow_accepted += p.matched
                self._score(s, p.matched, p.matched)
                s.suspended_left = 0
                s.shadow_resumes += 1
            return
        s.pending = None
        proposed, accepted = p.outcome()
        s.shadow_rounds += 1
        s.shadow_proposed += proposed
        s.shadow_accepted += accepted
        was_suspended = s.suspended_left > 0
        before = s.suspensions
        self._score(s, proposed, accepted)
        if was_suspended and accepted / proposed >= self.config.good_fraction:
            s.suspended_left = 0
            s.shadow_resumes += 1
        elif was_suspended and s.suspensions > before:
            s.shadow_extensions += 1

    def stats(self) -> dict:
        """Totals and per-drafter state: EMA, cap, probation, suspensions, rounds and tokens suspended."""
        drafters = {name: self._state_dict(name, s) for name, s in self._states.items()}
        states = self._states.values()
        return {
            "suspensions": sum(s.suspensions for s in states),
            "suspended_rounds": sum(s.suspended_rounds for s in states),
            "suspended_tokens": sum(s.suspended_tokens for s in states),
            "shadow_rounds": sum(s.shadow_rounds for s in states),
            "shadow_resumes": sum(s.shadow_resumes for s in states),
            "shadow_extensions": sum(s.shadow_extensions for s in states),
            "drafters": drafters,
        }

    # -- queries -----------------------------------------------------------------

    def state(self, drafter: str) -> DrafterState:
        """The state of ``drafter`` (created fresh on first use)."""
        s = self._states.get(drafter)
        if s is None:
            s = self._states[drafter] = DrafterState(self.config.suspend_rounds)
        return s

    def on_probation(self, drafter: str) -> bool:
        """Whether ``drafter`` has not yet had ``probation_rounds`` good rounds."""
        return self.state(drafter).good_rounds < self.config.probation_rounds

    def suspended(self, drafter: str) -> bool:
        """Whether ``drafter`` gets a budget of 0 at its next round."""
        return self.state(drafter).suspended_left > 0

    def cap(self, drafter: str) -> int | None:
        """The current block cap of ``drafter`` (``None``: uncapped; 0: suspended)."""
        s = self.state(drafter)
        if s.suspended_left > 0:
            return 0
        if self.on_probation(drafter):
            return self.config.probation_cap
        if s.ema is not None and s.ema < self.config.shrink_below:
            return self.config.probation_cap
        return None

    # -- helpers ------------------------------------------------------------------

    def _suspend(self, s: DrafterState) -> None:
        s.suspended_left = s.backoff
        s.suspensions += 1
        s.backoff = min(s.backoff * 2, self.config.max_suspend_rounds)
        s.poor_streak = 0
        s.good_rounds = 0  # back on probation when the suspension ends

    def _state_dict(self, name: str, s: DrafterState) -> dict:
        return {
            "ema": s.ema,
            "cap": self.cap(name),
            "on_probation": self.on_probation(name),
            "suspended": s.suspended_left > 0,
            "suspended_left": s.suspended_left,
            "suspensions": s.suspensions,
            "suspended_rounds": s.suspended_rounds,
            "suspended_tokens": s.suspended_tokens,
            "next_backoff": s.backoff,
            "good_rounds": s.good_rounds,
            "poor_streak": s.poor_streak,
            "rounds": s.rounds,
            "proposed": s.proposed,
            "accepted": s.accepted,
            "shadow_rounds": s.shadow_rounds,
            "shadow_proposed": s.shadow_proposed,
            "shadow_accepted": s.shadow_accepted,
            "shadow_resumes": s.shadow_resumes,
            "shadow_extensions": s.shadow_extensions,
        }


def create_copy_governor(**options: Any) -> CopyGovernor:
    """Factory registered as ``copy_governor``: builds the governor from policy options.

    Raises:
        specdec.PolicyError: an unknown option (naming the accepted ones) or a bad value.
    """
    return CopyGovernor(**options)
