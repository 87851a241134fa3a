"""Unit tests of the ngram_copy drafter: options, ladder, caps, incremental updates (no model)."""

from __future__ import annotations

import pytest
import specdec
from specdec import Draft, RoundResult
from specdec.testing import feed_round, request_context
from specdec_ngram import DEFAULTS, create_ngram_copy


def started(prompt, **options):
    """A session of a drafter built with ``options``, for a request with ``prompt``."""
    return create_ngram_copy(**options).session(request_context(prompt))


# -- options -------------------------------------------------------------------------


def test_defaults_documented_and_applied():
    d = create_ngram_copy()
    assert d.name == "ngram_copy"
    assert (d.source, d.min_n, d.max_n, d.max_block) == ("all", 2, 8, 16)
    assert d.ladder == ((2, 4), (4, 8), (8, 16))
    assert (d.max_edits, d.realign) == (1, True)
    assert (d.sizing, d.continuation, d.min_share, d.decay) == ("cost", "frequent", 0.0, 0.95)
    assert d.vote_floor == 32 and d.round_overhead is True and d.learn_bonus is False
    assert d.learn == "block"
    assert d.overhead_quantum == 0.25
    assert d.uses_verify_cost
    assert not create_ngram_copy(sizing="ladder").uses_verify_cost
    assert (d.store, d.store_max_tokens) == (None, 200_000)
    assert set(DEFAULTS) == {
        "store",
        "store_max_tokens",
        "sizing",
        "continuation",
        "min_share",
        "vote_floor",
        "round_overhead",
        "overhead_quantum",
        "learn",
        "learn_bonus",
        "decay",
        "source",
        "min_n",
        "max_n",
        "ladder",
        "max_block",
        "max_edits",
        "realign",
        "cursor",
        "learn_edits",
        "edit_window",
    }
    assert (d.cursor, d.learn_edits, d.edit_window) == (True, True, 16)


def test_unknown_option_names_the_accepted_ones():
    with pytest.raises(specdec.PolicyError) as exc:
        create_ngram_copy(min_m=2)
    msg = str(exc.value)
    assert "min_m" in msg
    for name in DEFAULTS:
        assert name in msg


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"source": "output"}, "source"),
        ({"min_n": 0}, "min_n"),
        ({"max_n": 1.5}, "max_n"),
        ({"min_n": 4, "max_n": 3}, "min_n"),
        ({"max_block": 0}, "max_block"),
        ({"ladder": []}, "ladder"),
        ({"sizing": "fixed"}, "sizing"),
        ({"continuation": "oldest"}, "continuation"),
        ({"min_share": 1.5}, "min_share"),
        ({"vote_floor": 0}, "vote_floor"),
        ({"vote_floor": 2.5}, "vote_floor"),
        ({"decay": 0.0}, "decay"),
        ({"ladder": [[2, 4], [2, 8]]}, "increasing"),
        ({"ladder": [[2, 0]]}, "block"),
        ({"ladder": [[2, 4, 6]]}, "ladder"),
        ({"ladder": 5}, "ladder"),
        ({"max_edits": 3}, "max_edits"),
        ({"realign": "yes"}, "realign"),
    ],
)
def test_bad_option_values(options, fragment):
    with pytest.raises(specdec.PolicyError, match=fragment):
        create_ngram_copy(**options)


def test_ladder_accepts_toml_style_lists():
    d = create_ngram_copy(ladder=[[1, 2], [3, 6]])
    assert d.ladder == ((1, 2), (3, 6))


# -- ladder and caps --------------------------------------------------------------------


def test_block_for_ladder():
    d = create_ngram_copy(ladder=[[2, 3], [4, 6], [7, 10]])
    assert [d.block_for(m) for m in range(1, 10)] == [0, 3, 3, 6, 6, 6, 10, 10, 10]


def test_block_grows_with_match_length():
    body = list(range(10, 40))
    d = started([1, 2, *body, 3], ladder=[[2, 2], [4, 5], [6, 9]], max_block=20)
    # history ends with a 2-token match, then a longer one
    h = [1, 2, *body, 3, 10, 11]
    assert d.propose(h, 20).tokens == (12, 13)
    h = [1, 2, *body, 3, *body[:4]]
    assert d.propose(h, 20).tokens == tuple(body[4:9])
    h = [1, 2, *body, 3, *body[:7]]
    assert d.propose(h, 20).tokens == tuple(body[7:16])


def test_capped_at_max_len_and_max_block():
    body = list(range(10, 60))
    h = [*body, 1, *body[:20]]
    d = started(h)
    assert len(d.propose(h, 100).tokens) == 16  # max_block default
    assert d.propose(h, 5).tokens == tuple(body[20:25])
    assert d.propose(h, 1).tokens == (body[20],)
    assert d.propose(h, 0) is None
    d = started(h, max_block=3)
    assert d.propose(h, 100).tokens == tuple(body[20:23])


def test_no_match_is_none():
    d = started([1, 2, 3, 4, 5])
    assert d.propose([1, 2, 3, 4, 5], 8) is None
    assert d.stats()["misses"] == 1 and d.stats()["hits"] == 0


def test_match_below_first_rung_is_none():
    d = started([5, 6, 7, 9, 5, 6], min_n=2, ladder=[[3, 4]])
    assert d.propose([5, 6, 7, 9, 5, 6], 8) is None


def test_draft_is_deterministic():
    d = started([1, 2, 3, 4, 1, 2])
    draft = d.propose([1, 2, 3, 4, 1, 2], 8)
    assert isinstance(draft, Draft) and draft.probs is None
    assert draft.tokens[:2] == (3, 4)


# -- longest, then most recent ------------------------------------------------------------


def test_prefers_longest_then_most_recent():
    prompt = [9, 1, 2, 30, 31, 32, 8, 1, 2, 40, 41, 42, 7, 1, 2, 50, 51, 52]
    d = started(prompt, ladder=[[2, 3]])
    # only the last two tokens match everywhere: most recent wins
    assert d.propose([*prompt, 6, 1, 2], 3).tokens == (50, 51, 52)
    # a longer context matches the first occurrence: longest wins
    assert d.propose([*prompt, 6, 9, 1, 2], 3).tokens == (30, 31, 32)


# -- incremental updates -------------------------------------------------------------------


def test_observe_indexes_committed_tokens():
    prompt = [1, 2, 3]
    d = started(prompt)
    h = feed_round(d, prompt, [70, 71, 72])
    h = feed_round(d, h, [5, 70, 71])
    assert d.stats()["indexed_tokens"] == len(h)
    assert d.propose(h, 4).tokens[:2] == (72, 5)
    assert d.stats()["resyncs"] == 0


def test_source_prompt_ignores_output():
    prompt = [1, 2, 3]
    d = started(prompt, source="prompt")
    h = feed_round(d, prompt, [70, 71, 72, 5, 70, 71])
    assert d.propose(h, 4) is None
    h = feed_round(d, h, [9, 1, 2])
    assert d.propose(h, 4).tokens == (3,)  # copies stop at the prompt's end
    assert create_ngram_copy(source="all").source == "all"


def test_propose_catches_up_from_history_without_observe():
    prompt = [1, 2, 3, 4, 5, 6]
    d = started(prompt)
    h = [*prompt, 1, 2]  # the first tokens were never observed
    assert d.propose(h, 3).tokens == (3, 4, 5)
    assert d.stats()["resyncs"] == 0
    # observing them afterwards (with positions) does not index them twice
    h2 = feed_round(d, prompt, [1, 2])
    assert h2 == h and d.stats()["indexed_tokens"] == len(h)
    h = feed_round(d, h, [3])
    assert d.propose(h, 2).tokens == (4, 5)
    assert d.stats()["resyncs"] == 0


def test_inconsistent_history_resyncs():
    prompt = [1, 2, 3, 4, 5, 6]
    d = started(prompt)
    feed_round(d, prompt, [7, 8])
    h = [*prompt, 7, 9, 4, 5]  # disagrees with what was indexed at the boundary
    assert d.propose(h, 1).tokens == (6,)
    assert d.stats()["resyncs"] == 1
    assert d.stats()["indexed_tokens"] == len(h)


def test_conflicting_observe_resyncs_at_next_propose():
    prompt = [1, 2, 3, 4]
    d = started(prompt)
    feed_round(d, prompt, [5, 6])
    # a round that claims to start inside what was indexed, with other tokens
    d.observe(RoundResult(None, (), 0, 9, (8, 9), start_position=len(prompt)))
    assert d.propose([*prompt, 8, 9, 1, 2], 2).tokens == (3, 4)
    assert d.stats()["resyncs"] == 1


def test_stats_count_acceptances():
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    d = started(prompt)
    draft = d.propose(prompt, 4)
    assert draft.tokens == (3, 4, 5, 6)
    feed_round(d, prompt, [3, 4, 9], block=draft.tokens, n_accepted=2, drafter="ngram_copy")
    s = d.stats()
    assert s["lookups"] == 1 and s["hits"] == 1
    assert s["proposed_tokens"] == 4 and s["accepted_tokens"] == 2
    assert s["rounds_verified"] == 1
    assert s["longest_match"] == 2 and s["mean_match_len"] == 2.0


def test_each_session_starts_fresh_and_end_drops_state():
    drafter = create_ngram_copy()
    d = drafter.session(request_context([1, 2, 3, 1, 2]))
    assert d.propose([1, 2, 3, 1, 2], 4) is not None
    other = drafter.session(request_context([4, 5, 6]))  # a second request on the same drafter
    assert other.stats()["lookups"] == 0
    assert other.propose([4, 5, 6], 4) is None
    assert d.stats()["lookups"] == 1 and d.stats()["indexed_tokens"] == 5  # untouched
    d.end()
    assert d.stats()["indexed_tokens"] == 0


def test_index_cost_is_per_token():
    prompt = list(range(1000))
    d = started(prompt, min_n=2, max_n=4)
    entries = d.stats()["index_entries"]
    h = feed_round(d, prompt, [1, 2, 3])
    assert d.stats()["index_entries"] - entries == 3 * 3
    d.propose(h, 4)
    assert d.stats()["index_entries"] - entries == 3 * 3


def test_rename_is_copied_through():
    # The output copies the prompt with 90 renamed to 91: after the rename the copy
    # continues from the aligned position.
    source = list(range(10, 30)) + [90] + list(range(30, 50))
    d = started(source)
    h = feed_round(d, source, [10, 11, 12, 13, 14])
    h = feed_round(d, h, list(range(15, 30)) + [91])
    draft = d.propose(h, 8)
    assert draft.tokens == tuple(range(30, 38))
    assert d.stats()["realigned"] == 1
    exact = started(source, max_edits=0, realign=False)
    assert exact.propose(h, 8) is None


# -- cost-aware block sizes, frequency-aware continuations, shadow scoring ---------------


def cost_ctx(prompt, cost):
    c = request_context(prompt)
    c.cost = specdec.costs.CostModel(None, curve=cost) if cost is not None else None
    return c


def flat_curve(step=1.0, per_token=0.01):
    widths = (1, 2, 4, 8, 17)
    row = tuple(step + per_token * (w - 1) for w in widths)
    return specdec.costs.VerifyCostCurve(widths=widths, contexts=(1,), seconds=(row,))


PERIOD = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def test_without_a_cost_model_the_session_sizes_by_the_ladder_and_says_so():
    s = create_ngram_copy().session(request_context(PERIOD * 3))
    assert s.sizing == "ladder" and s.stats()["sizing_used"] == "ladder"


def test_cheap_verify_drafts_the_whole_continuation():
    s = create_ngram_copy().session(cost_ctx(PERIOD * 3, flat_curve(per_token=0.0)))
    d = s.propose(PERIOD * 3, 16)
    assert d is not None and len(d.tokens) == 16  # wide verify free: all of it
    assert s.stats()["block_sizes"] == {16: 1} and s.stats()["sizing_used"] == "cost"


def test_what_a_drafted_round_costs_beyond_its_forward_counts_in_the_size():
    # Verify is cheap on this curve, so a first block pays; once the pipeline measured
    # that a drafted round costs most of a step more than a plain one (the pipelining
    # it gives up), an unproven match of the same kind does not.
    ctx = cost_ctx(PERIOD * 2, flat_curve(per_token=0.1))
    assert create_ngram_copy().session(ctx).propose(PERIOD * 2, 16) is not None
    for _ in range(30):
        ctx.cost.observe_round("drafted", 17, len(PERIOD) * 2, 2.6 + 0.95, "ngram_copy")
    assert ctx.cost.draft_overhead_s("ngram_copy") > 0.8
    s = create_ngram_copy().session(ctx)
    assert s.propose(PERIOD * 2, 16) is None
    assert s.stats()["declined"] == 1
    # round_overhead = false prices the block by the curve alone, as before.
    assert create_ngram_copy(round_overhead=False).session(ctx).propose(PERIOD * 2, 16)
    with pytest.raises(specdec.PolicyError, match="round_overhead must be true or false"):
        create_ngram_copy(round_overhead="yes")


def test_overhead_quantum_is_a_share_of_a_step():
    assert create_ngram_copy(overhead_quantum=0).overhead_quantum == 0.0
    for bad in (-0.1, 1.5, True, "0.25"):
        with pytest.raises(
            specdec.PolicyError, match=r"overhead_quantum must be a number in \[0, 1\]"
        ):
            create_ngram_copy(overhead_quantum=bad)


def measured(prompt, per_token, drafted_s, ctx=None):
    """A request context whose cost model measured rounds of ``ngram_copy`` costing
    ``drafted_s`` beyond their forward (what another pipeline's timing would give);
    ``ctx``: measure on in that one's."""
    ctx = ctx or cost_ctx(prompt, flat_curve(per_token=per_token))
    width, context = 17, len(prompt)
    for _ in range(200):
        seconds = ctx.cost.cost(width, context) + drafted_s
        ctx.cost.observe_round("drafted", width, context, seconds, "ngram_copy")
    return ctx


def test_timing_noise_within_a_quarter_step_leaves_the_blocks_alone():
    # Two pipelines (the copy and ngram presets, say) measure a drafted round at 0.53
    # and 0.58 of a step beyond its forward. Priced as measured, the same match is a
    # 3-token block on one and no block on the other; read in quarter steps, both
    # price it at half a step and propose the same block.
    prompt = PERIOD * 2

    def sizes(ctxs, **options):
        out = []
        for ctx in ctxs:
            p = create_ngram_copy(**options).session(ctx).propose(prompt, 16)
            out.append(0 if p is None else len(p.tokens))
        return out

    ctxs = [measured(prompt, 0.1, x) for x in (0.55, 0.6)]
    assert [c.cost.draft_overhead_s("ngram_copy") for c in ctxs] == [
        pytest.approx(0.53, abs=0.01),
        pytest.approx(0.58, abs=0.01),
    ]
    assert sizes(ctxs, overhead_quantum=0) == [3, 0]
    assert sizes([measured(prompt, 0.1, x) for x in (0.55, 0.6)]) == [3, 3]
    # One pipeline whose measurement drifts from 0.53 to 0.58 keeps its block, and
    # the stats say what the sizing used.
    ctx = measured(prompt, 0.1, 0.55)
    d = create_ngram_copy()
    s = d.session(ctx)
    assert len(s.propose(prompt, 16).tokens) == 3
    measured(prompt, 0.1, 0.6, ctx)
    assert ctx.cost.draft_overhead_s("ngram_copy") == pytest.approx(0.58, abs=0.01)
    s = d.session(ctx)
    assert len(s.propose(prompt, 16).tokens) == 3
    assert s.stats()["overhead_steps"] == {"round": 0.0, "drafted": 0.5}
    # Past a whole quarter from it (0.83 steps), the estimate moves to its nearest.
    measured(prompt, 0.1, 0.86, ctx)
    assert d.session(ctx).propose(prompt, 16) is None
    assert ctx.cost.overhead.steady_steps("ngram_copy")["drafted"] == 0.75


@pytest.mark.parametrize("learn", ["continuation", "block"])
def test_dear_verify_declines_and_shadow_outcomes_make_it_draft_again(learn):
    # Every extra token costs as much as a step: only near-certain tokens pay.
    s = create_ngram_copy(learn=learn).session(cost_ctx(PERIOD * 2, flat_curve(per_token=0.6)))
    history = PERIOD * 2
    assert s.propose(history, 16) is None
    assert s.stats()["declined"] == 1
    assert (s._pending is not None) if learn == "block" else (len(s._tails) == 1)
    proposed = None
    for i in range(40):  # plain steps that follow the copy: the shadow outcomes match
        tok = PERIOD[i % len(PERIOD)]
        history = feed_round(s, history, [tok])
        proposed = s.propose(history, 16)
        if proposed is not None:
            break
    assert proposed is not None, s.stats()
    st = s.stats()
    assert st["shadow_scored"] >= 1 and st["shadow_accepted"] >= 1
    assert any(e["pooled"] > 0.5 for e in st["estimates"].values())


def test_verified_outcomes_shape_the_estimates():
    # learn = "block": the rounds below report each block rejected at its first token
    # yet commit the copy's own token (no target would), which only the verified
    # outcome says; "continuation" learns from the committed tokens and would see
    # every position accepted.
    s = create_ngram_copy(learn="block").session(cost_ctx(PERIOD * 3, flat_curve(per_token=0.05)))
    history = PERIOD * 3
    sizes = []
    for i in range(12):  # every block is rejected at its first token
        tok = PERIOD[i % len(PERIOD)]
        d = s.propose(history, 16)
        if d is None:
            sizes.append(0)
            history = feed_round(s, history, [tok])
            continue
        sizes.append(len(d.tokens))
        history = feed_round(s, history, [tok], block=d.tokens, n_accepted=0, drafter=s.name)
    # Blocks shrink, then stop paying (the shadow outcomes, which match here since the
    # committed tokens continue the copy, soon make it try again).
    assert sizes[0] > 1 and sizes[1] < sizes[0] and 0 in sizes, sizes
    assert s.stats()["declined"] > 0


def test_a_block_accepted_in_full_scores_the_next_token_against_the_bonus():
    # A copy whose blocks are accepted in full: with learn_bonus each round also scores
    # the continuation's next token against the bonus token (the target's next one),
    # so position k + 1 gets evidence and the next block is longer; without it the
    # positions past the block only have their prior.
    def first_two(**options):
        history = list(range(100, 140)) * 2
        s = create_ngram_copy(**options).session(cost_ctx(history, flat_curve(per_token=0.3)))
        sizes, scored = [], []
        for _ in range(2):
            d = s.propose(history, 16)
            k = len(d.tokens)
            copy = history[len(history) - 40 : len(history) - 40 + k + 1]  # it goes on
            history = feed_round(s, history, copy, block=d.tokens, n_accepted=k, drafter=s.name)
            est = s.estimates[s._bucket_of(s.last_match)]
            sizes.append(k)
            scored.append(est.reached[k] if k < est.max_positions else None)
        return sizes, scored

    (k1, k2), (scored, _) = first_two(learn="block", learn_bonus=True)
    (b1, b2), (unscored, _) = first_two(learn="block")  # learn_bonus's default: off
    assert k1 == b1 and scored > 0 and unscored == 0  # position k + 1 scored, or not
    assert k2 > b2, (k2, b2)
    # A bonus that disagrees with the continuation: position k + 1 was rejected.
    history = list(range(100, 140)) * 2
    s = create_ngram_copy(learn="block", learn_bonus=True).session(
        cost_ctx(history, flat_curve(per_token=0.3))
    )
    d = s.propose(history, 16)
    k = len(d.tokens)
    feed_round(s, history, [*d.tokens, 7], block=d.tokens, n_accepted=k, drafter=s.name)
    est = s.estimates[s._bucket_of(s.last_match)]
    assert est.reached[k] > 0 and est.accepted[k] == 0 and est.accepted[k - 1] > 0
    # A block the core cut short: the bonus follows its last token, not the one the
    # proposal continued with, so it scores nothing past the block.
    s = create_ngram_copy(learn="block", learn_bonus=True).session(
        cost_ctx(history, flat_curve(per_token=0.05))
    )
    d = s.propose(history, 16)
    k = len(d.tokens) - 1
    assert k >= 1
    copy = history[len(history) - 40 : len(history) - 40 + k + 1]
    feed_round(s, history, copy, block=d.tokens[:k], n_accepted=k, drafter=s.name)
    est = s.estimates[s._bucket_of(s.last_match)]
    assert est.reached[k - 1] > 0 and est.reached[k] == 0
    with pytest.raises(specdec.PolicyError, match="learn_bonus must be true or false"):
        create_ngram_copy(learn_bonus=1)


def test_continuations_are_learnt_past_the_block_as_the_target_commits():
    # A copy that goes on for 40 tokens, proposed in short blocks (a dear verify): with
    # learn = "continuation" each block's whole continuation is scored against the
    # tokens committed in the rounds after it, so the positions past the block are
    # learnt (and the blocks grow); with "block" they keep their prior.
    def run(learn, rounds):
        history = list(range(100, 140)) * 2
        s = create_ngram_copy(learn=learn).session(cost_ctx(history, flat_curve(per_token=0.3)))
        sizes = []
        for _ in range(rounds):
            d = s.propose(history, 16)
            k = len(d.tokens)
            copy = history[len(history) - 40 : len(history) - 40 + k + 1]  # it goes on
            history = feed_round(s, history, copy, block=d.tokens, n_accepted=k, drafter=s.name)
            sizes.append(k)
        return s, sizes

    # After one round: the block's bonus token scored position k + 1, or not.
    tail, (k,) = run("continuation", rounds=1)
    block, (b,) = run("block", rounds=1)
    assert k == b and k < 16
    est = tail.estimates[tail._bucket_of(tail.last_match)]
    assert est.reached[k] > 0 and est.accepted[k] == est.reached[k]  # past the block
    assert block.estimates[block._bucket_of(block.last_match)].reached[k] == 0
    # After two: the first continuation's further positions too; the blocks grow faster.
    tail, tail_sizes = run("continuation", rounds=3)
    block, block_sizes = run("block", rounds=3)
    est = tail.estimates[tail._bucket_of(tail.last_match)]
    assert est.reached[tail_sizes[0] + 2] > 0
    assert tail_sizes[1] > block_sizes[1], (tail_sizes, block_sizes)
    st = tail.stats()
    assert st["learn"] == "continuation" and st["continuations_scored"] >= 1
    assert st["scoring"] == len(tail._tails)


def test_a_continuation_learns_each_position_once_and_resolves_at_a_mismatch():
    history = list(range(100, 140)) * 2
    s = create_ngram_copy(max_block=8, learn="continuation").session(
        cost_ctx(history, flat_curve(per_token=0.3))
    )
    d = s.propose(history, 8)
    k = len(d.tokens)
    assert 1 <= k < 8
    bucket = s._bucket_of(s.last_match)
    est = s.estimates[bucket]
    before = est.outcomes
    src = history[len(history) - 40 :]
    # The block is accepted in full with its bonus, then plain steps follow the copy
    # for two tokens and leave it.
    history = feed_round(s, history, src[: k + 1], block=d.tokens, n_accepted=k, drafter=s.name)
    assert est.outcomes == before + 1 and est.accepted[k] > 0  # the bonus: position k + 1
    history = feed_round(s, history, src[k + 1 : k + 2])
    history = feed_round(s, history, [7])  # not what the continuation holds
    assert all(t.score.start_position != len(history) - k - 3 for t in s._tails)
    reached, accepted = list(est.reached), list(est.accepted)
    assert est.outcomes == before + 1  # one outcome, learnt in parts
    # positions 1 .. k + 2 accepted, k + 3 rejected (decayed by the outcomes after it)
    assert accepted[k + 2] == 0 and reached[k + 2] > 0 and accepted[k + 1] > 0


def test_a_block_rejected_inside_is_learnt_at_once_and_the_scoring_is_bounded():
    history = PERIOD * 3
    s = create_ngram_copy(learn="continuation").session(
        cost_ctx(history, flat_curve(per_token=0.05))
    )
    d = s.propose(history, 16)
    k = len(d.tokens)
    assert k > 2
    feed_round(s, history, [*d.tokens[:1], 7], block=d.tokens, n_accepted=1, drafter=s.name)
    assert not s._tails  # resolved: position 2 was rejected
    est = s.estimates[s._bucket_of(s.last_match)]
    assert est.reached[1] > 0 and est.accepted[1] == 0 and est.reached[2] == 0
    # Declined lookups that are never resolved (one-token rounds that keep matching
    # a long continuation) are scored at most MAX_TAILS at a time.
    from specdec_ngram.drafter import MAX_TAILS

    for i in range(MAX_TAILS + 8):
        s._track(10_000 + i, list(range(16)), 0, shadow=True)
    assert len(s._tails) == MAX_TAILS
    with pytest.raises(
        specdec.PolicyError, match=r"learn must be one of \['continuation', 'block'\]"
    ):
        create_ngram_copy(learn="tail")


def test_a_long_match_is_never_priced_below_a_shorter_one():
    history = list(range(100, 160)) * 2  # the end matches 60 tokens back: bucket >= 32
    s = create_ngram_copy().session(cost_ctx(history, flat_curve(per_token=0.05)))
    for _ in range(10):  # 4-to-7-token matches were copied whole all along
        s._learn(1, 16, 16)
    s._learn(4, 16, 1)  # the one long match so far broke at its second token
    own = s.estimates[4].probs(16)
    assert own[1] < 0.5  # on its own, the long bucket would price position 2 low
    d = s.propose(history, 16)
    assert d is not None and len(d.tokens) == 16, s.stats()["estimates"]


def test_shadow_is_not_counted_as_a_proposal():
    s = create_ngram_copy().session(cost_ctx(PERIOD * 3, flat_curve(per_token=0.001)))
    d = s.shadow(PERIOD * 3, 16)
    assert d is not None and len(d.tokens) >= 1
    st = s.stats()
    assert st["hits"] == 0 and st["proposed_tokens"] == 0 and st["lookups"] == 0
    assert st["shadow_lookups"] == 1 and st["shadow_time_s"] > 0
    assert s.shadow([42], 16) is None  # nothing to copy


def test_frequent_continuation_beats_the_most_recent():
    # "1 2 3" was followed by 7 twice and by 9 once (most recently).
    prompt = [1, 2, 3, 7, 50, 1, 2, 3, 7, 51, 1, 2, 3, 9, 52, 1, 2, 3]
    freq = started(prompt, min_n=3, max_n=3, ladder=[[3, 1]], max_edits=0)
    recent = started(prompt, min_n=3, max_n=3, ladder=[[3, 1]], max_edits=0, continuation="recent")
    assert freq.propose(prompt, 1).tokens == (7,)
    assert recent.propose(prompt, 1).tokens == (9,)


def test_the_occurrence_matching_far_back_is_not_outvoted():
    # "1 2 3" was followed by 9 twice (short contexts) and by 7 once, where the
    # 9 tokens before it match the end of the history as well: that is the place
    # being copied, and vote_floor keeps the short matches out of the vote.
    long_ctx = [10, 11, 12, 13, 14, 15, 16, 17, 18, 1, 2, 3]
    prompt = long_ctx + [7, 50, 30, 1, 2, 3, 9, 51, 31, 1, 2, 3, 9, 52] + long_ctx
    opts = dict(min_n=3, max_n=3, ladder=[[3, 1]], max_edits=0)
    assert started(prompt, **opts).propose(prompt, 1).tokens == (7,)
    assert started(prompt, vote_floor=3, **opts).propose(prompt, 1).tokens == (9,)


def test_min_share_shortens_the_block_at_a_branch():
    prompt = [1, 2, 3, 4, 7, 60, 1, 2, 3, 4, 8, 61, 1, 2, 3]
    s = started(prompt, min_n=3, max_n=3, ladder=[[3, 8]], max_edits=0, min_share=0.6)
    assert s.propose(prompt, 8).tokens == (4,)  # the branch after 4 is a coin flip
    s2 = started(prompt, min_n=3, max_n=3, ladder=[[3, 8]], max_edits=0)
    assert len(s2.propose(prompt, 8).tokens) > 1
