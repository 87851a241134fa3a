"""NgramCopyDrafter: proposes what followed the last occurrence of the recent tokens.

A copy drafter for models without a draft head. When an answer copies text it
was given (rewriting a file with a small change, quoting passages), the last few
committed tokens occurred before in the context, and what followed there is a
good guess for what comes next. Drafts are deterministic (``Draft.probs`` is
``None``), so greedy output stays token-identical to plain decoding and sampled
output keeps the target's distribution (point-mass acceptance).

How long a block is (``sizing``):

- ``"cost"`` (the default): the block size that maximises expected committed
  tokens per second (:func:`specdec.costs.best_block`), from per-position acceptance
  estimates (:class:`specdec.costs.AcceptanceEstimate`, one per match-length bucket,
  learnt from verified rounds and from shadow outcomes) times the voting share
  of each proposed token, and the measured cost of verifying ``k`` tokens at the
  current context length (``ctx.cost``, the pipeline's :class:`specdec.costs.CostModel`),
  plus what a drafted round costs beyond its forward (the pipelining that plain
  steps have and a drafted round gives up, measured on the pipeline's own rounds:
  :class:`specdec.costs.RoundOverhead`).
  Where no size pays it proposes nothing, and scores what it would have proposed
  against what the target commits (:class:`specdec.shadow.ShadowScore`), so it learns
  when copying pays again without a forward.
- ``"ladder"``: the fixed ``ladder`` of match lengths to block sizes.

Where the copy comes from (``cursor``): a :class:`~specdec_ngram.cursor.CopyCursor`
follows the output's place in the source across edits, so that a copy resumes
right after an edit (where the index would need a new match of a few tokens),
and with ``learn_edits`` writes each confirmed edit into later copies of the
same source tokens.

Which continuation (``continuation``): ``"frequent"`` (the default) lets every
earlier occurrence that matches as much context vote token by token
(:meth:`NgramIndex.ranked_continuation`); ``"recent"`` copies what followed the
most recent one.

Across requests (``store``): an optional :class:`~specdec_ngram.store.CopyStore` of
earlier requests' outputs (one per pipeline, in memory or in a file shared by
processes), looked up when the current context has no match, for agent loops
that re-emit what they produced before. Its matches have an acceptance estimate
of their own (the ``"store"`` bucket); every request's output is added to it
when the request ends.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import specdec
from specdec import BaseDrafter, BaseDrafterSession, Draft, RequestContext, RoundResult
from specdec.costs import AcceptanceEstimate, best_block
from specdec.options import Option, Options
from specdec.shadow import ShadowScore

from .cursor import CopyCursor, EditRule
from .index import NgramIndex, NgramMatch
from .store import CopyStore, CopyStoreError

NAME = "ngram_copy"

SOURCES = ("all", "prompt")
SIZINGS = ("cost", "ladder")
CONTINUATIONS = ("frequent", "recent")
LEARNS = ("continuation", "block")
#: The most proposals scored at once with ``learn = "continuation"`` (each resolves
#: within ``max_block + 1`` committed tokens, so only a long run of one-token rounds
#: after wide proposals reaches it; the oldest is dropped then).
MAX_TAILS = 32
#: Match-length buckets of the acceptance estimates (lower bounds); realigned
#: matches (right after an edit) have a bucket of their own.
MATCH_BUCKETS = (0, 4, 8, 16, 32)
#: The acceptance-estimate bucket of matches found in the cross-request store
#: (after the match-length buckets and the realigned one).
STORE_BUCKET = len(MATCH_BUCKETS) + 1
#: The acceptance-estimate bucket of copies from the cursor's place right after an
#: edit (a tentative realignment: see :mod:`specdec_ngram.cursor`).
CURSOR_BUCKET = STORE_BUCKET + 1
#: A pending shadow proposal that has matched this many tokens is scored at once
#: (as accepted that far), so a copy that resumes is drafted again within two steps.
SHADOW_EARLY = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_ladder(value: Any) -> tuple[tuple[int, int], ...]:
    """Validate a ladder: ``[[match_len, block], ...]`` with increasing ``match_len``."""
    try:
        rungs = [tuple(r) for r in value]
    except TypeError:
        rungs = None
    if not rungs or any(len(r) != 2 or not all(_is_int(x) for x in r) for r in rungs):
        raise ValueError(
            "option ladder must be a non-empty list of [match_len, block] "
            f"integer pairs, e.g. [[2, 4], [4, 8], [8, 16]]; got {value!r}"
        )
    prev = 0
    for match_len, block in rungs:
        if match_len <= prev:
            raise ValueError(
                f"ladder match lengths must be >= 1 and strictly increasing; got {value!r}"
            )
        if block < 1:
            raise ValueError(f"ladder block sizes must be >= 1; got {value!r}")
        prev = match_len
    return tuple((int(m), int(b)) for m, b in rungs)


def _store(value: Any) -> Any:
    """A store option: a bool, or a path that is not empty."""
    if not isinstance(value, bool) and not os.fspath(value):
        raise ValueError
    return value


#: The options of ``ngram_copy`` (see the README for what each one does).
OPTIONS = Options(
    NAME,
    [
        Option("source", str, default="all", choices=SOURCES),
        Option("min_n", int, default=2, minimum=1),
        Option("max_n", int, default=8, minimum=1),
        Option("ladder", default=((2, 4), (4, 8), (8, 16)), check=_parse_ladder),
        Option("max_block", int, default=16, minimum=1),
        Option("max_edits", int, default=1, minimum=0, maximum=2, accepted="0, 1 or 2"),
        Option("realign", bool, default=True),
        Option("cursor", bool, default=True),
        Option("learn_edits", bool, default=True),
        Option("edit_window", int, default=16, minimum=1, maximum=64),
        Option("sizing", str, default="cost", choices=SIZINGS),
        Option("continuation", str, default="frequent", choices=CONTINUATIONS),
        Option("min_share", float, default=0.0, minimum=0, maximum=1),
        Option("vote_floor", int, default=32, minimum=1),
        Option("round_overhead", bool, default=True),
        Option(
            "overhead_quantum",
            float,
            default=0.25,
            minimum=0,
            maximum=1,
            accepted="a number in [0, 1] (a share of a one-token step; 0: the measurements "
            "as they are)",
        ),
        Option("learn", str, default="block", choices=LEARNS),
        Option("learn_bonus", bool, default=False),
        Option("decay", float, default=0.95, minimum=0, maximum=1, exclusive_minimum=True),
        Option(
            "store",
            (bool, str, os.PathLike),
            default=False,
            check=_store,
            accepted="true, false or a file path",
        ),
        Option("store_max_tokens", int, default=200_000, minimum=1),
    ],
)
#: Default options of ``ngram_copy``.
DEFAULTS: Mapping[str, Any] = OPTIONS.defaults


class NgramCopyDrafter(BaseDrafter):
    """Prompt-lookup drafting from an incremental n-gram index.

    Args:
        source: ``"all"`` copies from the prompt and the generated output;
            ``"prompt"`` copies from the prompt only.
        min_n: the shortest n-gram that counts as a match.
        max_n: the longest n-gram looked up (longer matches are still measured by
            extending backwards, up to 64 tokens).
        ladder: ``[[match_len, block], ...]``: a match at least ``match_len`` tokens
            long proposes up to ``block`` tokens (the last rung that fits wins); a
            match shorter than the first rung proposes nothing.
        max_block: the largest block this drafter proposes. The core's
            ``max_len`` (policy ``max_block``, tokens left, the governor's budget)
            may cut it shorter.
        max_edits: edited tokens (substituted, inserted, deleted) a match may step
            over when it is extended backwards, 0 to 2 (0: exact matching).
        realign: right after an edit, copy on from the aligned source position
            past the edited token.
        cursor: follow the output's place in the source token by token, across
            edits (:class:`~specdec_ngram.cursor.CopyCursor`): after an edit of up to
            ``edit_window`` tokens, copy on from where the output meets the source
            again as soon as one token does, where the index would need a new match
            of a few tokens first.
        learn_edits: with ``cursor``, learn each confirmed edit (the source tokens
            replaced and what the output wrote instead) and write it into later
            copies of the same source tokens (an identifier renamed everywhere is
            drafted renamed from its second occurrence on).
        edit_window: with ``cursor``, the longest edit (source tokens replaced, or
            tokens written instead) after which the place is found again.
        sizing: ``"cost"`` chooses each block's size from acceptance estimates and
            the verify cost curve; ``"ladder"`` uses ``ladder`` (see the module
            docstring).
        continuation: ``"frequent"`` (earlier occurrences vote, most frequent token
            first, then most recent) or ``"recent"`` (the most recent occurrence).
        min_share: with ``"frequent"``, end the block before a token that fewer than
            this share of the voting occurrences agree on (0: never; the cost
            sizing already weighs each token by its share).
        vote_floor: with ``"frequent"``, the occurrences that vote are those whose
            backwards match is at least ``min(best, vote_floor)`` tokens long
            (``best``: the longest match's length), so one occurrence that matches
            far back (the place the answer is copying) is not outvoted by several
            that share only the last few tokens.
        round_overhead: with ``"cost"``, count what a drafted round costs beyond its
            verify forward, as the pipeline measured it (``ctx.cost.draft_overhead_s()``
            and ``round_overhead_s``); ``False`` prices a block by the verify cost
            curve alone (as 0.3.3 did), where drafting pays more often: for a model
            whose forward is as cheap as the loop's host work (a tiny test model).
        overhead_quantum: with ``round_overhead``, the two overheads enter the sizing
            in whole multiples of this share of a one-token step, and each moves to
            another multiple only once its measurement is more than one multiple away
            from the one in use (hysteresis), so that timing noise of a few
            milliseconds does not change block sizes: identical drafts get identical
            blocks from one run, and one policy, to the next. ``0``: the
            measurements as they are (0.3.6).
        learn: what the acceptance estimates learn from. ``"block"`` (the default):
            only the positions verified (as 0.3.7), plus the bonus token with
            ``learn_bonus``; unverified proposals are scored up to their first two
            tokens. ``"continuation"``: every continuation the drafter looked up
            (proposed, declined or shadowed) is scored in full against the tokens
            the target commits, round after round, and each of its positions is
            learnt as soon as it is known, so positions past a short block that
            was accepted in full are learnt too (without it they keep their prior,
            and short blocks that are always accepted never show that longer ones
            would pay). Replayed on the default model's answers it saved forwards
            (code-edit 67 to 58 of 400 tokens) but not time on this CPU, where a
            wide verify costs several steps (where wide verifies are cheap it
            gained about 1%); a 3-round bench of code-edit measured it 12% faster
            at temperature 0. Off by default until a full bench settles it (see
            the README).
        learn_bonus: with ``learn = "block"``, when a block is accepted in full,
            also score the continuation's next token against the round's bonus
            token (the target's next token), so the acceptance estimates learn the
            position past the block at no cost (``False``, the default: only the
            positions proposed; on the default model it saved 2 of 61 forwards on
            ``extraction`` and measured within noise of ``False``).
        decay: how much older outcomes keep of their weight in the acceptance
            estimates at each new one (1: no decay).
        store: a cross-request store of earlier requests' outputs, looked up when
            the context has no match: ``False`` (none), ``True`` (in memory, for
            this pipeline) or a file path (on disk, shared by every pipeline and
            process that names it; see :mod:`specdec_ngram.store`).
        store_max_tokens: the most tokens the store keeps (the oldest requests'
            outputs are dropped first).

    Attributes:
        store: the :class:`~specdec_ngram.store.CopyStore`, or ``None``.

    Raises:
        specdec.PolicyError: an option has a bad value, or the store's file is not
            a store (or is corrupt, or cannot be read).
    """

    name = NAME
    #: Sessions keep only their own history and store: rows of a batch are independent.
    supports_batch = True

    def __init__(self, **options: Any) -> None:
        o = OPTIONS.parse(options)
        if o.min_n > o.max_n:
            raise specdec.PolicyError(f"{NAME}: min_n ({o.min_n}) must be <= max_n ({o.max_n})")
        self.store_max_tokens = o.store_max_tokens
        self.store: CopyStore | None = None
        if o.store is not False:
            path = None if o.store is True else os.path.expanduser(os.fspath(o.store))
            try:
                self.store = CopyStore(
                    path, max_tokens=o.store_max_tokens, min_n=o.min_n, max_n=o.max_n
                )
            except (CopyStoreError, OSError) as exc:
                raise specdec.PolicyError(f"{NAME}: option store: {exc}") from exc
        self.sizing = o.sizing
        self.continuation = o.continuation
        self.min_share = o.min_share
        self.vote_floor = o.vote_floor
        self.round_overhead = o.round_overhead
        self.overhead_quantum = o.overhead_quantum
        self.learn = o.learn
        self.learn_bonus = o.learn_bonus
        self.decay = o.decay
        self.source = o.source
        self.min_n = o.min_n
        self.max_n = o.max_n
        self.ladder = o.ladder
        self.max_block = o.max_block
        self.max_edits = o.max_edits
        self.realign = o.realign
        self.cursor = o.cursor
        self.learn_edits = o.learn_edits
        self.edit_window = o.edit_window

    # -- the Drafter protocol -------------------------------------------------------

    @property
    def uses_verify_cost(self) -> bool:
        """The cost sizing reads the pipeline's verify cost curve (``ctx.cost``)."""
        return self.sizing == "cost"

    def session(self, ctx: RequestContext) -> NgramCopySession:
        """A request's session: the prompt indexed (O(1) per token); a store on disk
        is reloaded first when its file changed."""
        if self.store is not None:
            self.store.refresh()
        return NgramCopySession(self, ctx.prompt_tokens, cost=getattr(ctx, "cost", None))

    def reset(self) -> None:
        """Forget what earlier requests left: empty the store (on disk too). The
        benchmark calls it before each prelude request."""
        if self.store is not None:
            self.store.clear()

    def block_for(self, match_len: int) -> int:
        """The ladder's block size for a match of ``match_len`` tokens (0 below the first rung)."""
        block = 0
        for rung_len, rung_block in self.ladder:
            if match_len < rung_len:
                break
            block = rung_block
        return block


class NgramCopySession(BaseDrafterSession):
    """One request of ``ngram_copy``: its n-gram index, acceptance estimates and counts.

    Args:
        drafter: the drafter whose options apply.
        prompt_tokens: the request's prompt, indexed at once.
        cost: the pipeline's :class:`specdec.costs.CostModel` (for ``sizing = "cost"``;
            without one the session sizes blocks by the ladder and says so in
            ``stats()["sizing_used"]``).
    """

    #: a constrained request's forced tokens may end the history ``propose`` is given:
    #: they are indexed like committed ones (they cannot be rejected), and what follows
    #: them is copied; ``_outcome`` leaves them out of this drafter's acceptance.
    drafts_after_forced = True

    def __init__(
        self, drafter: NgramCopyDrafter, prompt_tokens: Sequence[int], *, cost: Any = None
    ) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.cost = cost
        self.sizing = drafter.sizing if (drafter.sizing != "cost" or cost is not None) else "ladder"
        self._prompt_len = 0
        self._dirty = False
        self._reset_stats()
        d = drafter
        self.estimates = [
            AcceptanceEstimate(max(d.max_block, 1), decay=d.decay) for _ in range(CURSOR_BUCKET + 1)
        ]
        #: every outcome, whichever bucket: the prior of a bucket with few outcomes.
        self.overall = AcceptanceEstimate(max(d.max_block, 1), decay=d.decay)
        self._bucket: int | None = None  # the bucket of the block in flight
        # the block in flight as proposed and the continuation's token after it
        self._proposed: list[int] = []
        self._next: int | None = None
        self._pending: ShadowScore | None = None  # an unverified proposal being scored
        self._pending_bucket = 0
        # learn = "continuation": every continuation looked up, scored as tokens come
        self._tails: list[_Tail] = []
        self._tail_mode = drafter.learn == "continuation"
        self.cursor: CopyCursor | None = None
        # the learnt edits written into the block in flight: (offset, rule)
        self._used: list[tuple[int, EditRule]] = []
        self._planned_used: list[tuple[int, EditRule]] = []
        self._planned_cursor = False
        self._rebuild([int(t) for t in prompt_tokens], prompt_len=len(prompt_tokens))

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Copy what followed the best earlier occurrence of the end of ``history``.

        Args:
            history: every committed token (prompt + output). Normally the index
                already holds it; new tokens are appended, and a history that
                disagrees with the index is re-indexed (counted in ``resyncs``).
            max_len: the most tokens the core accepts this round.

        Returns:
            A deterministic :class:`specdec.Draft`, or ``None`` when nothing matches
            (or no block size pays, or the match is shorter than the ladder's first
            rung, or ``max_len < 1``).
        """
        self._sync(history)
        self._bucket = None
        if max_len < 1:
            return None
        self.lookups += 1
        plan = self._plan(len(history), max_len)
        if plan is None:
            self.misses += 1
            return None
        match, tokens, bucket, size, accept = plan
        if size < 1:
            self.declined += 1
            t0 = time.perf_counter()
            self._start_shadow(len(history), tokens, bucket)
            self.shadow_time_s += time.perf_counter() - t0
            return None
        if self._tail_mode:
            self._track(len(history), tokens, bucket, shadow=False)
        self._next = tokens[size] if len(tokens) > size else None
        self._proposed = list(tokens[:size])
        tokens = tokens[:size]
        self.hits += 1
        if match.skipped:
            self.realigned += 1
        if bucket == STORE_BUCKET:
            self.store_hits += 1
            self.store_proposed_tokens += len(tokens)
        self.proposed_tokens += len(tokens)
        self.match_len_total += match.length
        self.longest_match = max(self.longest_match, match.length)
        self.last_match = match
        self.sizes[size] = self.sizes.get(size, 0) + 1
        self._bucket = bucket
        self._used = [(o, r) for o, r in self._planned_used if o < size]
        self.edits_written += len(self._used)
        self.cursor_proposals += self._planned_cursor
        est = None if accept is None else [min(1.0, max(0.0, a)) for a in accept[:size]]
        return Draft(tokens=tokens, acceptance=est)

    def shadow(self, history: Sequence[int], max_len: int) -> Draft | None:
        """What :meth:`propose` would propose, without counting it (for shadow scoring
        while the governor has suspended this drafter): ``None`` when nothing matches or
        no block size pays. The session scores the continuation itself either way."""
        t0 = time.perf_counter()
        self._sync(history)
        self._bucket = None
        out = None
        plan = self._plan(len(history), max_len) if max_len >= 1 else None
        if plan is not None:
            _, tokens, bucket, size, _ = plan
            self.shadow_lookups += 1
            self._start_shadow(len(history), tokens, bucket)
            if size >= 1:  # a block that would not pay is not proposed (but self-scored)
                out = Draft(tokens=tokens[:size])
        self.shadow_time_s += time.perf_counter() - t0
        return out

    def observe(self, result: RoundResult) -> None:
        """Index the tokens committed this round (whoever drafted them) and learn
        from the outcome of this drafter's block and of a pending shadow proposal."""
        if result.drafter == self.name:
            self.accepted_tokens += result.n_accepted - result.forced
            self.rounds_verified += 1
            if self._bucket is not None and result.block and not self._tail_mode:
                self._learn(self._bucket, *self._outcome(result))
            if self._used and result.block:
                f = result.forced
                hits, misses = CopyCursor.score(
                    self._used, result.n_accepted - f, len(result.block) - f
                )
                self.edits_accepted += hits
                self.edits_rejected += misses
            if self._bucket == STORE_BUCKET:
                self.store_accepted_tokens += result.n_accepted - result.forced
        self._bucket = None
        self._used = []
        committed = result.committed
        if self._tails:
            t0 = time.perf_counter()
            self._feed_tails(result)
            self.shadow_time_s += time.perf_counter() - t0
        if self._pending is not None:
            t0 = time.perf_counter()
            self._feed_shadow(result)
            self.shadow_time_s += time.perf_counter() - t0
        if not committed:
            return
        have = len(self.index)
        start = result.start_position
        if start <= 0 and have > 0:
            # The position is unknown: assume the round follows what is indexed.
            self._extend(committed)
            return
        if start > have:
            return  # a gap: propose() catches up from the history
        overlap = min(have - start, len(committed))
        if overlap and list(committed[:overlap]) != self.index.tokens[start : start + overlap]:
            self._dirty = True  # disagrees with what was indexed: re-index at propose()
            return
        self._extend(committed[overlap:])

    def end(self) -> None:
        """Add the request's output (the tokens after the prompt) to the store, if
        there is one, and drop the per-request index. A store that cannot be
        written is reported as a :class:`RuntimeWarning` (the core does not let an
        error in ``end()`` escape)."""
        store = self.drafter.store
        output = self.index.tokens[self._prompt_len :]
        if store is not None and output:
            try:
                store.add(output)
            except (CopyStoreError, OSError, ValueError) as exc:
                warnings.warn(
                    f"{NAME}: the request's output was not stored: {exc}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._prompt_len = 0
        self._pending = None
        self._tails = []
        self.index = self._new_index(0)
        if self.cursor is not None:
            self.cursor.rebind(self.index.tokens)

    def stats(self) -> dict:
        """Per-request counts: lookups, hits (``realigned``: after an edit), misses,
        proposed/accepted tokens, match lengths, index size, resyncs; the block sizes
        chosen, rounds declined (no size paid), shadow scoring, what the estimates
        learn from (``learn``; ``scoring``: continuations being scored now,
        ``continuations_scored``: resolved so far), the acceptance
        estimates per match-length bucket (and ``"store"``), and the cross-request
        store's hits, proposed and accepted tokens and size (as this request saw it);
        and the cursor's: blocks copied from its place, edits found, confirmed and
        places lost, rules learnt (retired ones included) and their uses written,
        accepted through and rejected inside (the ``cursor`` bucket holds the
        estimates of copies from a tentative place)."""
        names = [f"match>={b}" for b in MATCH_BUCKETS] + ["realigned", "store", "cursor"]
        store = self.drafter.store
        return {
            "source": self.drafter.source,
            "sizing_used": self.sizing,
            "continuation": self.drafter.continuation,
            "learn": self.drafter.learn,
            "scoring": len(self._tails),
            "continuations_scored": self.continuations_scored,
            "lookups": self.lookups,
            "hits": self.hits,
            "misses": self.misses,
            "declined": self.declined,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "rounds_verified": self.rounds_verified,
            "mean_match_len": (self.match_len_total / self.hits) if self.hits else 0.0,
            "longest_match": self.longest_match,
            "realigned": self.realigned,
            "cursor": self.cursor is not None,
            "cursor_proposals": self.cursor_proposals,
            "cursor_realigned": 0 if self.cursor is None else self.cursor.realigned,
            "cursor_confirmed": 0 if self.cursor is None else self.cursor.confirmed,
            "cursor_lost": 0 if self.cursor is None else self.cursor.lost,
            "edits_learnt": 0 if self.cursor is None else len(self.cursor.rules),
            "edits_written": self.edits_written,
            "edits_accepted": self.edits_accepted,
            "edits_rejected": self.edits_rejected,
            "indexed_tokens": len(self.index),
            "index_entries": self.index.entries,
            "resyncs": self.resyncs,
            "block_sizes": dict(sorted(self.sizes.items())),
            "overhead_steps": (
                None if self.cost is None else self.cost.overhead.steady_steps(self.name)
            ),
            "shadow_lookups": self.shadow_lookups,
            "shadow_scored": self.shadow_scored,
            "shadow_accepted": self.shadow_accepted,
            "shadow_time_s": self.shadow_time_s,
            "store": store is not None,
            "store_hits": self.store_hits,
            "store_proposed_tokens": self.store_proposed_tokens,
            "store_accepted_tokens": self.store_accepted_tokens,
            "store_tokens": 0 if store is None else store.n_tokens,
            "store_documents": 0 if store is None else store.n_documents,
            "overall_estimate": self.overall.to_dict(min(16, self.overall.max_positions)),
            "estimates": {
                n: e.to_dict(min(16, e.max_positions))
                for n, e in zip(names, self.estimates)
                if e.outcomes
            },
        }

    # -- helpers ------------------------------------------------------------------

    def _plan(
        self, context: int, max_len: int
    ) -> tuple[NgramMatch, list[int], int, int, list[float] | None] | None:
        """The match, its continuation, its bucket, the block size to propose (0: none
        pays) and the acceptance estimates it was priced with (``None`` with the ladder),
        or ``None`` when nothing matches. Without a match in the context,
        the store (if any) is looked up: its match (``position`` in the store) gets
        the ``"store"`` bucket and shares of 1.0."""
        d = self.drafter
        match = self.index.find()
        found = None
        cur = self.cursor
        from_cursor = False
        self._planned_used = []
        self._planned_cursor = False
        if cur is not None and cur.choose(
            None if match is None else (match.position, match.length), len(self.index)
        ):
            assert cur.pos is not None
            from_cursor = True
            match = NgramMatch(cur.pos, min(cur.run, self.index.max_extend), 0)
        if match is None:
            if d.store is None:
                return None
            found = d.store.match(self.index.tokens)
            if found is None:
                return None
            match = NgramMatch(found.position, found.length, found.n)
        if self.sizing == "ladder":
            count = min(d.block_for(match.length), d.max_block, max_len)
        else:
            count = min(d.max_block, max_len)
        if count < 1:
            return None
        if found is not None:
            tokens, shares = d.store.continuation(found, count), None
        elif from_cursor:
            assert cur is not None
            tokens, shares = cur.continuation(count), None
        elif d.continuation == "frequent":
            tokens, shares = self.index.ranked_continuation(
                match, count, min_share=d.min_share, floor=d.vote_floor
            )
        else:
            tokens, shares = self.index.continuation(match, count), None
        if not tokens:
            return None
        if cur is not None and d.learn_edits:
            edited, origin, used = cur.apply(self.index.tokens[-1], tokens, count)
            if used:
                tokens = edited
                shares = None if shares is None else [shares[i] for i in origin]
                self._planned_used = used
        if found is not None:
            bucket = STORE_BUCKET
        elif from_cursor and cur is not None and cur.tentative:
            bucket = CURSOR_BUCKET
        else:
            bucket = self._bucket_of(match)
        self._planned_cursor = from_cursor
        if self.sizing == "ladder":
            return match, tokens, bucket, len(tokens), None
        accept = self._accept_probs(bucket, len(tokens))
        if shares is not None:
            accept = [a * sh for a, sh in zip(accept, shares)]
        cost = self.cost

        def verify(width: int) -> float:
            return cost.cost(width, context)

        if d.round_overhead:  # what a round, and drafting, cost beyond the forward
            base, extra = cost.steady_overheads(self.name, context, d.overhead_quantum)
        else:
            base = extra = 0.0
        choice = best_block(
            accept, verify, max_size=len(tokens), overhead_s=base, draft_cost=lambda k: extra
        )
        return match, tokens, bucket, choice.size, accept

    def _accept_probs(self, bucket: int, n: int) -> list[float]:
        """The acceptance estimates of positions ``1 .. n`` for a match in ``bucket``.

        A match-length bucket is never priced below a shorter one: a match that reaches
        further back is at least as likely to go on as one that does not, and a bucket
        with few outcomes of its own (long matches are rarer) would otherwise take a
        single rejection as its rate for the positions after it (a 40-token match
        was sized at 2 tokens on ``code-edit`` after one 16-token block of that
        bucket failed at its second token). What is compared is the chance that the
        first ``i`` tokens are all accepted (the product of the estimates up to
        ``i``): the highest of the bucket's own and of the shorter buckets' with
        outcomes, turned back into per-position rates, so a block is never priced
        above what one bucket's evidence supports."""
        prior = self.overall.pooled()
        est = self.estimates[bucket]
        est.prior = prior
        accept = est.probs(n)
        if bucket >= len(MATCH_BUCKETS):
            return accept
        curves = [accept]
        for shorter in self.estimates[:bucket]:
            if shorter.outcomes:  # an empty bucket is only its prior: no evidence
                shorter.prior = prior
                curves.append(shorter.probs(n))
        if len(curves) == 1:
            return accept
        out: list[float] = []
        survive = [1.0] * len(curves)
        before = 1.0
        for i in range(n):
            survive = [s * c[i] for s, c in zip(survive, curves)]
            best = max(survive)
            out.append(best / before if before > 0 else 0.0)
            before = best
        return out

    @staticmethod
    def _bucket_of(match: NgramMatch) -> int:
        if match.skipped:
            return len(MATCH_BUCKETS)
        b = 0
        for i, lo in enumerate(MATCH_BUCKETS):
            if match.length >= lo:
                b = i
        return b

    def _start_shadow(self, position: int, tokens: list[int], bucket: int) -> None:
        if self._tail_mode:
            self._track(position, tokens, bucket, shadow=True)
            return
        if self._pending is None and tokens:
            self._pending = ShadowScore(position, tokens)
            self._pending_bucket = bucket

    def _track(self, position: int, tokens: list[int], bucket: int, *, shadow: bool) -> None:
        """Score the continuation ``tokens`` looked up at ``position`` against the
        tokens the target commits from there (``learn = "continuation"``)."""
        if not tokens:
            return
        tails = self._tails
        if tails and tails[-1].score.start_position == position and not tails[-1].learned:
            tails.pop()  # looked up again for the same position: the newer one counts
        tails.append(_Tail(ShadowScore(position, tokens), bucket, shadow))
        if len(tails) > MAX_TAILS:
            del tails[0]

    def _feed_tails(self, result: RoundResult) -> None:
        """Learn each scored continuation's positions that this round made known."""
        keep: list[_Tail] = []
        for tail in self._tails:
            score = tail.score
            done = score.feed(result.start_position, result.committed)
            if score.lost:
                continue  # a gap: what was learnt stays, nothing more can be
            if done or score.matched > tail.learned:
                if tail.shadow:  # an unverified proposal: counted once, when first scored
                    self.shadow_scored += tail.learned == 0
                    self.shadow_accepted += score.matched - tail.learned
                proposed = score.proposed if done else score.matched
                self._learn(tail.bucket, proposed, score.matched, start=tail.learned)
                tail.learned = score.matched
            if done:
                self.continuations_scored += 1
            else:
                keep.append(tail)
        self._tails = keep

    def _feed_shadow(self, result: RoundResult) -> None:
        p = self._pending
        assert p is not None
        if result.drafter == self.name and result.block:
            self._pending = None  # a verified block of ours scores these positions now
            return
        done = p.feed(result.start_position, result.committed)
        if not done and p.matched < SHADOW_EARLY:
            return
        self._pending = None
        if p.lost:
            return
        # Matching so far: what is known is that the first ``matched`` would have been
        # accepted (censored there), which is enough to start drafting again.
        proposed, accepted = p.outcome() if done else (p.matched, p.matched)
        self._learn(self._pending_bucket, proposed, accepted)
        self.shadow_scored += 1
        self.shadow_accepted += accepted

    def _outcome(self, result: RoundResult) -> tuple[int, int]:
        """(proposed, accepted) of this drafter's verified block. With ``learn_bonus``,
        a block accepted in full also scores the continuation's next token against
        the round's bonus token: the target's own next token, so a longer block
        would have had that token accepted exactly when they agree (at a temperature,
        with the chance the target gives it: a one-sample estimate of the same rate).
        Without it, a run of fully accepted short blocks never shows that longer
        ones would pay: the positions past them keep their prior."""
        f = result.forced  # a grammar's forced tokens before this drafter's
        block, n = result.block[f:], result.n_accepted - f
        k = len(block)
        nxt = self._next
        if (
            self.drafter.learn_bonus
            and nxt is not None
            and list(block) == self._proposed  # not cut short by the core
            and n == k
            and len(result.committed) == f + k + 1
        ):
            return k + 1, k + 1 if result.committed[f + k] == nxt else k
        return k, n

    def _learn(self, bucket: int, proposed: int, accepted: int, *, start: int = 0) -> None:
        self.estimates[bucket].observe(proposed, accepted, start=start)
        self.overall.observe(proposed, accepted, start=start)

    def _new_index(self, prompt_len: int) -> NgramIndex:
        # "prompt": copy only from the first prompt_len tokens.
        d = self.drafter
        limit = prompt_len if d.source == "prompt" else None
        return NgramIndex(d.min_n, d.max_n, limit=limit, max_edits=d.max_edits, realign=d.realign)

    def _rebuild(self, tokens: list[int], *, prompt_len: int | None = None) -> None:
        if prompt_len is not None:
            self._prompt_len = prompt_len
        self.index = self._new_index(self._prompt_len)
        self.index.extend(tokens)
        self._dirty = False
        d = self.drafter
        if not d.cursor:
            return
        if self.cursor is None:
            limit = self._prompt_len if d.source == "prompt" else None
            self.cursor = CopyCursor(
                self.index.tokens, window=d.edit_window, limit=limit, learn=d.learn_edits
            )
        else:
            self.cursor.rebind(self.index.tokens)

    def _extend(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` after what is indexed, and let the cursor follow them."""
        have = len(self.index)
        self.index.extend(tokens)
        if self.cursor is not None:
            self.cursor.feed(have, tokens)

    def _sync(self, history: Sequence[int]) -> None:
        # Cheap checks only (length and boundary token): a full comparison would
        # rescan the context every round.
        have = len(self.index)
        n = len(history)
        toks = self.index.tokens
        if not self._dirty:
            if n == have and (n == 0 or int(history[-1]) == toks[-1]):
                return
            if n > have and (have == 0 or int(history[have - 1]) == toks[-1]):
                self._extend([int(t) for t in history[have:]])
                return
        self.resyncs += 1
        self._rebuild([int(t) for t in history])

    def _reset_stats(self) -> None:
        self.lookups = 0
        self.hits = 0
        self.misses = 0
        self.declined = 0
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.rounds_verified = 0
        self.match_len_total = 0
        self.longest_match = 0
        self.realigned = 0
        self.last_match: NgramMatch | None = None
        self.resyncs = 0
        self.sizes: dict[int, int] = {}
        self.shadow_lookups = 0
        self.continuations_scored = 0
        self.shadow_scored = 0
        self.shadow_accepted = 0
        self.shadow_time_s = 0.0
        self.store_hits = 0
        self.store_proposed_tokens = 0
        self.store_accepted_tokens = 0
        self.cursor_proposals = 0
        self.edits_written = 0
        self.edits_accepted = 0
        self.edits_rejected = 0


class _Tail:
    """A continuation being scored (``learn = "continuation"``): its score, its
    acceptance-estimate bucket, how many of its positions were learnt already, and
    whether it went unverified (declined, or shadowed while suspended)."""

    __slots__ = ("score", "bucket", "shadow", "learned")

    def __init__(self, score: ShadowScore, bucket: int, shadow: bool) -> None:
        self.score = score
        self.bucket = bucket
        self.shadow = shadow
        self.learned = 0


def create_ngram_copy(**options: Any) -> NgramCopyDrafter:
    """Factory registered as ``ngram_copy``: builds the drafter from policy options.

    Raises:
        specdec.PolicyError: an unknown option (naming the accepted ones) or a bad value.
    """
    return NgramCopyDrafter(**options)
