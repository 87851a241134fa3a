"""The phases of a round, each in one place: plan → (coordinate) → verify → accept →
roll back → observe → (emit).

The single-request driver (:mod:`specdec.single`) and the batch driver
(:mod:`specdec.batch`) call these functions; neither has a copy of its own.

- :func:`plan`: the governor's budget, the drafter sessions in policy order, shadow
  proposals; fills a :class:`Round`'s block.
- :func:`settle`: the block becomes a tuple of ints (the one named point where a lazy
  block is read back; its ids are checked there), :func:`check_q`: its ``q`` checked.
- :func:`count_block`: the block-size histogram (after the coordinator agreed on it).
- :func:`choose_acceptor`, :func:`process`, :func:`accept`: logits processors, the
  acceptor and its bounds check.
- :func:`result`: the accepted round counted in the stats and described to the sessions.
- :func:`observe`: the history grows; sessions and governor learn the outcome.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Generator, Sequence
from typing import Any

import attrs
import mlx.core as mx

from . import guard
from .acceptors import auto_acceptor
from .errors import ComponentError
from .grammar import FORCED
from .roles import Acceptance, Ask, RoundResult, VerifyResult, optional

__all__ = [
    "FORCED",
    "Round",
    "RoundKind",
    "accept",
    "check_q",
    "choose_acceptor",
    "commit_grammar",
    "constrain",
    "count_block",
    "cut",
    "observe",
    "plan",
    "plan_steps",
    "process",
    "resume",
    "result",
    "settle",
]


class RoundKind(enum.Enum):
    """What a round is."""

    #: a request without drafter sessions: one token fed, its sample drawn lazily.
    PLAIN = "plain"
    #: a request with drafter sessions: ``[last, *block]`` fed (the block may be empty).
    SPECULATIVE = "speculative"
    #: a plain step queued ahead on the previous round's lazily sampled token.
    LOOKAHEAD = "lookahead"


@attrs.define
class Round:
    """One round: what was planned, fed, and is in flight.

    Attributes:
        kind: what the round is.
        position: absolute position of the round's first committed token.
        block: the drafted tokens (a tuple, or a lazy ``mx.array`` until :func:`settle`).
        q: the block's draft probabilities, or ``None``.
        chosen: the drafter whose block is verified (``None``: nothing drafted).
        proposals / shadows: as :class:`specdec.RoundResult`.
        acceptor: the name of the acceptor that decides the round.
        n_fed: tokens fed to the verify forward (``1 + len(block)``).
        txn: the open rollback transaction.
        vr: the lazy verify result; ``logits`` the processed logits.
        projected: greedy acceptance reads ``project_row(i)`` position by position
            (:attr:`rows`) instead of ``logits``, which stays unevaluated.
        token: a plain step's or lookahead's lazily sampled token.
        fed: a lookahead's input (the round before's lazy sample).
        committed: the transaction was committed already (a lookahead was queued on it).
        next_sample: the lazy sample of a round that drafted nothing, which the
            lookahead after it was fed.
        t_launch: when the verify forward was queued.
        forced: how many of the block's first tokens a grammar forced (their own
            :data:`FORCED` block when no drafter proposed after them).
        acceptance: the chosen draft's per-position acceptance estimates
            (:attr:`specdec.Draft.acceptance`; 1.0 at forced positions), or ``None``.
    """

    kind: RoundKind
    position: int
    block: Any = ()
    q: Any = None
    chosen: str | None = None
    proposals: dict = attrs.field(factory=dict)
    shadows: dict = attrs.field(factory=dict)
    acceptor: str | None = None
    n_fed: int = 1
    txn: Any = None
    vr: Any = None
    logits: Any = None
    projected: bool = False
    rows: Any = None
    token: Any = None
    fed: Any = None
    committed: bool = False
    next_sample: Any = None
    t_launch: float = 0.0
    forced: int = 0
    acceptance: tuple[float, ...] | None = None

    @property
    def block_size(self) -> int:
        """Drafted tokens (no host sync for a lazy block)."""
        if self.chosen is None:
            return 0
        b = self.block
        return len(b) if isinstance(b, tuple) else int(b.shape[0])


def is_lazy(block: Any) -> bool:
    """Whether a block is still a lazy array (not yet :func:`settle`-d)."""
    return not isinstance(block, tuple)


def settle(rnd: Round, state: Any = None) -> tuple:
    """The block as a tuple of ints (reading a lazy block back: the one host sync of the
    drafter's output), recorded as the winner's proposal too. With the request's
    ``state``, the ids read back are checked to be in the vocabulary.

    Raises:
        DraftError: an id read back is outside the vocabulary.
    """
    if is_lazy(rnd.block):
        rnd.block = tuple(int(t) for t in rnd.block.tolist())
        if rnd.chosen is not None:
            rnd.proposals[rnd.chosen] = rnd.block
            if state is not None:
                guard.check_ids(state, rnd.chosen, rnd.block, rnd.position)
    return rnd.block


def plan(state: Any, policy: Any, rnd: Round) -> None:
    """Ask the governor and the drafters, in policy order, for this round's block
    (:func:`plan_steps`, each session asked through its own ``propose``).

    Raises:
        ComponentError: a session or the governor raised (naming it, the round, the call).
        DraftError: the winning draft breaks the :class:`specdec.Draft` contract.
    """
    steps = plan_steps(state, policy, rnd)
    ask = next(steps, None)
    while ask is not None:
        try:
            draft = ask.session.propose(ask.history, ask.max_len)
        except Exception as exc:  # noqa: BLE001 - blamed inside, at the ask
            ask = steps.throw(exc)
        else:
            ask = resume(steps, draft)


def resume(steps: Generator[Ask, Any, None], draft: Any) -> Ask | None:
    """Give a :func:`plan_steps` generator the draft it asked for; its next ask, or
    ``None`` when the round's plan is done."""
    try:
        return steps.send(draft)
    except StopIteration:
        return None


def plan_steps(state: Any, policy: Any, rnd: Round) -> Generator[Ask, Any, None]:
    """:func:`plan` as a generator: it yields an :class:`specdec.roles.Ask` for each session
    to ask and is sent the session's :class:`specdec.Draft` (or ``None``), or thrown
    what ``propose`` raised; the batch driver collects the asks of all rows for a
    drafter with a :class:`specdec.roles.DrafterBatch` and answers them in one call.

    The first session that proposes at least ``policy.min_block`` tokens wins; sessions
    the governor gives no budget are asked for a shadow proposal instead when the
    governor scores them. The winning draft is checked (:func:`specdec.guard.check_draft`).

    A constrained request that drafts forced tokens (``state.forces``) opens the block
    with the tokens its grammar forces (:attr:`Round.forced`); the drafters that
    declare ``drafts_after_forced`` are asked for what follows them, the others are not
    asked on such a round.

    Raises:
        ComponentError: a session or the governor raised (naming it, the round, the call).
        DraftError: the winning draft breaks the :class:`specdec.Draft` contract.
    """
    limit = min(policy.max_block, state.emitter.remaining - 1)
    forced = state.grammar.forced(limit) if state.forces else []
    history = state.history
    if forced:
        rnd.block, rnd.chosen, rnd.forced = tuple(forced), FORCED, len(forced)
        rnd.proposals[FORCED] = rnd.block
        history = [*history, *forced]
        limit -= len(forced)
    if limit < policy.min_block:
        return
    gov = state.governor
    shadows = gov is not None and optional(gov, "governor_session", "wants_shadows")
    for name, s in state.sessions:
        if forced and not optional(s, "drafter_session", "drafts_after_forced"):
            continue
        if gov is None:
            budget = limit
        else:
            try:
                budget = min(gov.budget(name, limit), limit)
            except Exception as exc:
                guard.blame(state, "governor", policy.governor, "budget", exc, rnd.position)
        if budget < policy.min_block:
            fn = optional(s, "drafter_session", "shadow") if shadows else None
            if fn is not None:
                _shadow(state, rnd, name, fn, limit, history)
            continue
        try:
            draft = yield Ask(state.row, name, s, history, budget)
        except Exception as exc:
            guard.blame(state, "drafter", name, "propose", exc, rnd.position)
        if draft is None or draft.size < policy.min_block:
            continue
        guard.check_draft(state, name, draft, budget, rnd.position + len(forced))
        rnd.proposals[name] = draft.tokens
        rnd.chosen = name
        est = draft.acceptance
        if not forced:
            rnd.block, rnd.q, rnd.acceptance = draft.tokens, draft.probs, est
            return
        rnd.acceptance = None if est is None else (1.0,) * len(forced) + est
        toks = draft.tokens
        if is_lazy(toks):
            toks = tuple(int(t) for t in toks.tolist())
            guard.check_ids(state, name, toks, rnd.position + len(forced))
            rnd.proposals[name] = toks
        rnd.block = (*forced, *toks)
        if draft.probs is not None:  # the forced positions: point masses
            head = mx.zeros((len(forced), draft.probs.shape[-1]), dtype=draft.probs.dtype)
            head[mx.arange(len(forced)), mx.array(forced)] = 1.0
            rnd.q = mx.concatenate([head, draft.probs], axis=0)
        return


def _shadow(
    state: Any, rnd: Round, name: str, shadow: Any, limit: int, history: Sequence[int]
) -> None:
    """Ask a session the governor refused what it would have proposed (shadow scoring)."""
    t0 = time.perf_counter()
    try:
        draft = shadow(history, limit)
    except Exception as exc:
        guard.blame(state, "drafter", name, "shadow", exc, rnd.position)
    if draft is not None and draft.size:
        toks = draft.tokens
        rnd.shadows[name] = tuple(toks.tolist()) if is_lazy(toks) else tuple(toks)
        state.stats.shadow_proposals += 1
    state.stats.shadow_time_s += time.perf_counter() - t0


def constrain(state: Any, rnd: Round) -> None:
    """A constrained request's block (settled) cut before the first token its grammar
    forbids or a stop token, and the grammar's mask filled for every position to verify
    (the matcher advanced through the block until :func:`commit_grammar`); nothing
    without a grammar.

    Raises:
        DraftError: an id read back from a lazy block is outside the vocabulary.
        ComponentError: the grammar engine failed.
    """
    g = state.grammar
    if g is None:
        return
    block = settle(rnd, state)
    n = g.advance(block)
    if n < len(block):
        gs = state.stats.grammar
        gs["cut"] = gs.get("cut", 0) + len(block) - n
        cut(rnd, n)
    if rnd.q is not None:
        # the drafts verified are those q drew inside the mask: q conditioned on it
        rnd.q = g.renormalise(rnd.q)


def cut(rnd: Round, n: int) -> None:
    """The round's block cut to its first ``n`` tokens (``q`` and the acceptance
    estimates with it); a block left with none of its drafter's tokens is the grammar's
    (:data:`FORCED`), or nothing."""
    if n >= rnd.block_size:
        return
    rnd.block = rnd.block[:n]
    if rnd.q is not None:
        rnd.q = rnd.q[:n] if n else None
    if rnd.acceptance is not None:
        rnd.acceptance = rnd.acceptance[:n]
    if n <= rnd.forced:  # nothing of the drafter's is left
        rnd.chosen = FORCED if n else None


def commit_grammar(state: Any, n_accepted: int, token: int) -> None:
    """The round committed: the grammar matcher keeps the accepted tokens and ``token``."""
    if state.grammar is not None:
        state.grammar.commit(n_accepted, token)


def check_q(state: Any, rnd: Round, n_accepted: int) -> None:
    """After the acceptor, before the commit: the block's draft probabilities ``q``, when
    it has them, where acceptance read them (:func:`specdec.guard.check_q`).

    Raises:
        DraftError: ``q`` is not finite, negative, or zero at a drafted token.
    """
    if rnd.q is not None and rnd.block:
        guard.check_q(state, rnd.chosen, rnd.block, rnd.q, n_accepted, rnd.position)


def count_block(stats: Any, rnd: Round) -> None:
    """Count the round's block in the block-size histogram (0: nothing drafted)."""
    k = rnd.block_size
    stats.block_sizes[k] = stats.block_sizes.get(k, 0) + 1


def choose_acceptor(policy: Any, sampler: Any, rnd: Round) -> None:
    """The policy's acceptor, or for ``auto`` the one the sampler and ``q`` call for."""
    if policy.acceptor == "auto":
        rnd.acceptor = auto_acceptor(sampler, rnd.q is not None)
    else:
        rnd.acceptor = policy.acceptor


def process(logits: mx.array, history: list, block: Sequence[int], processors: list) -> mx.array:
    """Apply the logits processors to every verified position, each with its own history
    (the committed tokens, then the block's tokens before it)."""
    if not processors:
        return logits
    hist = mx.array(history)
    rows = []
    for i in range(logits.shape[0]):
        h = hist if i == 0 else mx.concatenate([hist, mx.array(list(block[:i]))])
        r = logits[i : i + 1]
        for p in processors:
            r = p(h, r)
        rows.append(r)
    return mx.concatenate(rows, axis=0).astype(mx.float32)


def accept(acceptors: dict, rnd: Round, sampler: Any, state: Any = None) -> Acceptance:
    """The round's acceptor over its (processed) logits, its answer checked; with the
    request's ``state``, an acceptor's exception is named.

    Raises:
        ComponentError: the acceptor raised, or accepted more tokens than the block has.
    """
    positions = range(rnd.position, rnd.position + rnd.n_fed)
    try:
        acc = acceptors[rnd.acceptor].accept(rnd.block, rnd.q, rnd.logits, sampler, positions)
    except Exception as exc:
        if state is None:
            raise
        guard.blame(state, "acceptor", rnd.acceptor, "accept", exc, rnd.position)
    return checked(rnd, acc, state)


def checked(rnd: Round, acc: Acceptance, state: Any = None) -> Acceptance:
    """``acc`` with plain ints, after checking it accepts a prefix of the block.

    Raises:
        ComponentError: the acceptor accepted more tokens than the block has, or fewer
            than 0.
    """
    n_acc = int(acc.n_accepted)
    if not 0 <= n_acc <= len(rnd.block):
        what = f"accepted {n_acc} of a {len(rnd.block)}-token block"
        if state is None:
            raise ComponentError(f"acceptor {rnd.acceptor!r} {what}", role="acceptor")
        raise guard.component_error(
            state, "acceptor", rnd.acceptor, "accept", RuntimeError(what), rnd.position
        )
    return Acceptance(n_accepted=n_acc, token=int(acc.token))


def accept_rows(stats: Any, rnd: Round) -> Acceptance:
    """Greedy acceptance projecting the target's logits one position at a time, until
    the first position whose argmax is not the drafted token (the positions after it
    are never projected)."""
    block = rnd.block
    i = 0
    while True:
        tok = int(mx.argmax(rnd.rows(i), axis=-1).item())
        if i == len(block) or tok != block[i]:
            break
        i += 1
    rp = stats.row_projection
    rp["rounds"] = rp.get("rounds", 0) + 1
    rp["rows"] = rp.get("rows", 0) + i + 1
    rp["skipped"] = rp.get("skipped", 0) + len(block) - i
    return Acceptance(n_accepted=i, token=tok)


def result(state: Any, rnd: Round, n_acc: int, token: int) -> RoundResult:
    """Count an accepted round in the stats and describe it to the sessions."""
    stats, block = state.stats, rnd.block
    if state.sessions:  # plain decoding (a plain row of a batch) counts no acceptor
        stats.acceptors[rnd.acceptor] = stats.acceptors.get(rnd.acceptor, 0) + 1
    if rnd.chosen is not None:
        stats.drafted += len(block)
        stats.accepted += n_acc
        stats.rounds_with_draft += 1
        f = rnd.forced if rnd.chosen != FORCED else 0  # forced tokens before a draft
        pd = stats.per_drafter[rnd.chosen]
        pd["rounds"] += 1
        pd["drafted"] += len(block) - f
        pd["accepted"] += n_acc - f
        if f:
            pd = stats.per_drafter[FORCED]
            pd["drafted"] += f
            pd["accepted"] += f
        if rnd.forced:
            stats.grammar["forced"] = stats.grammar.get("forced", 0) + rnd.forced
    return RoundResult(
        drafter=rnd.chosen,
        block=tuple(block),
        n_accepted=n_acc,
        token=token,
        committed=(*block[:n_acc], token),
        verify=rnd.vr,
        start_position=rnd.position,
        proposals={k: tuple(v.tolist()) if is_lazy(v) else v for k, v in rnd.proposals.items()},
        shadows=rnd.shadows,
        forced=rnd.forced,
    )


def plain_result(rnd: Round, token: int, verify: VerifyResult | None) -> RoundResult:
    """A round that drafted nothing and committed ``token``."""
    return RoundResult(
        drafter=None,
        block=(),
        n_accepted=0,
        token=token,
        committed=(token,),
        verify=verify,
        start_position=rnd.position,
        shadows=rnd.shadows,
    )


def token_logprobs(
    state: Any, logits: Any, committed: Sequence[int]
) -> list[tuple[float, tuple[tuple[int, float], ...]]] | None:
    """Each committed token's log-probability and the ``state.request.logprobs`` most
    likely alternatives, from the round's (processed) logits, whose row ``i`` judged
    ``committed[i]``; ``None`` when the request did not ask for them. The same rows
    acceptance read: under speculation they are the target's own distribution at each
    committed position, as plain decoding computes it."""
    k = state.request.logprobs
    if k is None or logits is None:
        return None
    n = len(committed)
    rows = logits.reshape(-1, logits.shape[-1])[:n].astype(mx.float32)
    lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    own = mx.take_along_axis(lp, mx.array(list(committed), dtype=mx.int32)[:, None], axis=-1)
    k = min(k, lp.shape[-1])
    if k:
        idx = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(lp, idx, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        idx, vals = (
            mx.take_along_axis(idx, order, axis=-1),
            mx.take_along_axis(vals, order, axis=-1),
        )
        mx.eval(own, idx, vals)
        ids, vs = idx.tolist(), vals.tolist()
    else:
        mx.eval(own)
        ids = vs = [[] for _ in range(n)]
    # a grammar's mask leaves -inf alternatives where fewer tokens are allowed: left out
    return [
        (
            float(own[i, 0].item()),
            tuple((t, v) for t, v in zip(ids[i], vs[i]) if math.isfinite(v)),
        )
        for i in range(n)
    ]


def observe(state: Any, res: RoundResult) -> None:
    """A committed round: the history grows, the sessions and the governor see it.

    Raises:
        ComponentError: a session's ``observe`` or the governor's raised (naming it).
    """
    stats = state.stats
    position = res.start_position
    state.history.extend(res.committed)
    for name, s in state.sessions:
        try:
            s.observe(res)
        except Exception as exc:
            guard.blame(state, "drafter", name, "observe", exc, position)
    gov = state.governor
    if gov is not None:
        t0 = time.perf_counter()
        try:
            if res.drafter is not None and res.drafter != FORCED:
                # a grammar's forced tokens are nobody's draft
                f = res.forced
                gov.observe(res.drafter, len(res.block) - f, res.n_accepted - f)
            gov.observe_round(res)
        except Exception as exc:
            guard.blame(state, "governor", state.governor_name, "observe", exc, position)
        if res.shadows:
            stats.shadow_time_s += time.perf_counter() - t0
    stats.target_forwards += 1
