"""Unit tests of NgramIndex: incremental updates and match selection (no model needed)."""

from __future__ import annotations

import random

import pytest
from specdec_ngram.index import NgramIndex, NgramMatch


def build(tokens, **kw):
    """An index over ``tokens``; exact matching unless the test asks for edits/realignment."""
    kw.setdefault("max_edits", 0)
    kw.setdefault("realign", False)
    idx = NgramIndex(**kw)
    idx.extend(tokens)
    return idx


def brute_force_best(tokens, min_n, max_n, max_extend):
    """Reference: longest backwards match (first n with any match, max_n down), then most recent."""
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n :]
        best = None
        for pos in range(n, end):  # pos = token following the occurrence
            if tokens[pos - n : pos] != suffix:
                continue
            length = n
            while (
                length < max(max_extend, max_n)
                and pos - length - 1 >= 0
                and tokens[pos - length - 1] == tokens[end - length - 1]
            ):
                length += 1
            if best is None or length >= best[1]:
                best = (pos, length)
        if best is not None:
            return NgramMatch(best[0], best[1], n)
    return None


def test_no_match_returns_none():
    assert build([1, 2, 3, 4, 5]).find() is None
    assert build([]).find() is None
    assert build([7]).find() is None


def test_simple_match_and_continuation():
    idx = build([1, 2, 3, 4, 9, 9, 1, 2, 3], min_n=2, max_n=4)
    m = idx.find()
    assert m == NgramMatch(position=3, length=3, n=3)
    assert idx.continuation(m, 4) == [4, 9, 9, 1]


def test_longest_match_beats_more_recent_shorter_one():
    # [5, 1, 2] occurs at the start; a more recent [1, 2] occurrence has a shorter context.
    toks = [5, 1, 2, 10, 11, 8, 1, 2, 20, 21, 5, 1, 2]
    idx = build(toks, min_n=2, max_n=3)
    m = idx.find()
    assert m.position == 3 and m.length == 3
    assert idx.continuation(m, 2) == [10, 11]


def test_most_recent_wins_on_equal_length():
    toks = [1, 2, 10, 7, 1, 2, 20, 8, 1, 2]
    idx = build(toks, min_n=2, max_n=2)
    m = idx.find()
    assert m.position == 6 and m.length == 2
    assert idx.continuation(m, 1) == [20]


def test_backwards_extension_beyond_max_n_decides():
    # Both occurrences match the last 2 tokens (max_n=2); extending backwards, the older
    # one matches 4 tokens, the recent one only 2.
    toks = [3, 4, 1, 2, 50, 9, 9, 1, 2, 60, 3, 4, 1, 2]
    idx = build(toks, min_n=2, max_n=2)
    m = idx.find()
    assert m.position == 4 and m.length == 4 and m.n == 2
    assert idx.continuation(m, 1) == [50]


def test_falls_back_to_shorter_n():
    toks = [1, 2, 3, 30, 9, 8, 2, 3]
    idx = build(toks, min_n=1, max_n=4)
    m = idx.find()
    assert m.n == 2 and m.position == 3


def test_min_n_bounds_matches():
    toks = [1, 5, 9, 1]  # only a 1-gram repeats
    assert build(toks, min_n=2, max_n=4).find() is None
    m = build(toks, min_n=1, max_n=4).find()
    assert m == NgramMatch(1, 1, 1)


def test_incremental_equals_batch():
    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(300)]
    for kw in ({"max_edits": 0, "realign": False}, {}):
        inc = NgramIndex(2, 5, **kw)
        for i, t in enumerate(toks):
            inc.append(t)
            batch = NgramIndex(2, 5, **kw)
            batch.extend(toks[: i + 1])
            assert inc.find() == batch.find()
        assert inc.tokens == toks


def test_matches_brute_force_reference():
    rng = random.Random(1)
    for trial in range(200):
        vocab = rng.choice([2, 3, 5, 20])
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        min_n = rng.choice([1, 2, 3])
        max_n = rng.choice([min_n, min_n + 1, 6])
        idx = build(toks, min_n=min_n, max_n=max_n, max_candidates=10_000, max_extend=16)
        assert idx.find() == brute_force_best(toks, min_n, max_n, 16), (trial, toks)


def test_no_rescan_entries_grow_linearly():
    idx = NgramIndex(2, 4)
    idx.extend(range(10))
    e10 = idx.entries
    idx.extend(range(10, 20))
    # 3 n-gram sizes per token once the sequence is long enough: nothing re-indexed.
    assert idx.entries - e10 == 30


def test_self_overlapping_copy_repeats_period():
    idx = build([9, 1, 2, 1, 2], min_n=2, max_n=2)
    m = idx.find()
    assert m.position == 3  # [1, 2] followed at position 3 by [1, 2]
    assert idx.continuation(m, 5) == [1, 2, 1, 2, 1]


def test_limit_restricts_matches_and_copies_to_the_prompt():
    prompt = [1, 2, 3, 4]
    idx = NgramIndex(2, 3, limit=len(prompt))
    idx.extend(prompt + [8, 2, 3, 4, 5, 8, 2])
    m = idx.find()
    # [8, 2] occurred in the output only, past the limit: no match.
    assert m is None
    idx.append(3)
    m = idx.find()
    assert m.position == 3
    assert idx.continuation(m, 5) == [4]  # stops at the prompt's end


def test_max_candidates_bounds_the_walk():
    # 50 recent occurrences of [1, 2] with short context; the long match is older.
    toks = [7, 7, 1, 2, 99]
    for _ in range(50):
        toks += [0, 1, 2, 5]
    toks += [7, 7, 1, 2]
    assert build(toks, min_n=2, max_n=2, max_candidates=4).find().position == len(toks) - 5
    assert build(toks, min_n=2, max_n=2, max_candidates=100).find().position == 4
    # A larger max_n finds the long match directly.
    assert build(toks, min_n=2, max_n=4, max_candidates=4).find().position == 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(0, 2)
    with pytest.raises(ValueError, match="must be <="):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="limit"):
        NgramIndex(1, 2, limit=-1)
    with pytest.raises(ValueError, match="max_edits"):
        NgramIndex(1, 2, max_edits=3)


def test_clear():
    idx = build([1, 2, 1, 2])
    idx.clear()
    assert len(idx) == 0 and idx.entries == 0 and idx.find() is None


def test_hash_collisions_never_give_a_wrong_match(monkeypatch):
    # With a zero multiplier every n-gram's key is its oldest token: chains mix
    # unrelated n-grams, and only token-by-token comparison keeps the answer right.
    import specdec_ngram.index as index_module

    monkeypatch.setattr(index_module, "_MUL", 0)
    rng = random.Random(2)
    for trial in range(100):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        idx = build(toks, min_n=2, max_n=5, max_candidates=10_000, max_extend=12)
        assert idx.find() == brute_force_best(toks, 2, 5, 12), (trial, toks)


# -- copying with a small change: edits and realignment -----------------------------------

OLD, NEW, NEW2 = 90, 91, 92


def test_realign_after_a_substituted_token():
    source = [1, 2, 3, 4, OLD, 5, 6, 7, 8]
    idx = build(source + [9, 1, 2, 3, 4, NEW], realign=True)
    m = idx.find()
    assert m.skipped == 1 and m.position == 5  # copy on past OLD
    assert idx.continuation(m, 3) == [5, 6, 7]
    assert m.length == 4
    # without realignment nothing matches the new token
    assert build(source + [9, 1, 2, 3, 4, NEW]).find() is None


def test_realign_after_two_tokens_replacing_one():
    source = [1, 2, 3, 4, OLD, 5, 6, 7, 8]
    idx = build(source + [9, 1, 2, 3, 4, NEW, NEW2], realign=True)
    m = idx.find()
    assert m.skipped == 2 and idx.continuation(m, 3) == [5, 6, 7]


def test_exact_match_that_disagrees_wins_over_realignment():
    # NEW was already followed by 40 once (an earlier edit): trust that.
    source = [1, 2, 3, 4, OLD, 5, 6, 7, 8, 4, NEW, 40, 41]
    idx = build(source + [1, 2, 3, 4, NEW], realign=True)
    m = idx.find()
    assert m.skipped == 0 and idx.continuation(m, 2) == [40, 41]
    # ... but when it agrees on the next token the longer, aligned match wins
    source = [1, 2, 3, 4, OLD, 5, 6, 7, 8, 4, NEW, 5, 41]
    idx = build(source + [1, 2, 3, 4, NEW], realign=True)
    m = idx.find()
    assert m.skipped == 1 and idx.continuation(m, 4) == [5, 6, 7, 8]


def test_edit_in_the_extension_finds_the_aligned_occurrence():
    # Both occurrences of [OLD, 5, 6] match the last 2 tokens exactly; across the edit
    # the older one lines up with much more context.
    aligned = [11, 12, 13, 14, OLD, 5, 6, 20, 21, 22]
    recent = [30, 31, OLD, 5, 6, 40, 41, 42]
    history = [11, 12, 13, 14, NEW, 5, 6]
    exact = build(aligned + recent + history, min_n=2, max_n=2)
    assert exact.continuation(exact.find(), 3) == [40, 41, 42]  # most recent of a tie
    edits = build(aligned + recent + history, min_n=2, max_n=2, max_edits=1)
    m = edits.find()
    assert edits.continuation(m, 3) == [20, 21, 22]
    assert m.length == 6  # 2 + 4 across the edit; the edit itself is not counted


@pytest.mark.parametrize(
    "history, expected",
    [
        ([11, 12, 14, 15, 16], "deletion"),  # 13 dropped
        ([11, 12, 13, 99, 14, 15, 16], "insertion"),  # 99 added
    ],
)
def test_edit_kinds_in_the_extension(history, expected):
    aligned = [10, 11, 12, 13, 14, 15, 16, 50, 51]
    decoy = [7, 8, 14, 15, 16, 60, 61]
    idx = build(aligned + decoy + history, min_n=3, max_n=3, max_edits=1)
    assert idx.continuation(idx.find(), 2) == [50, 51], expected


def test_prefilter_keeps_results_with_edits():
    rng = random.Random(3)
    for trial in range(150):
        toks = [rng.randrange(3) for _ in range(rng.randrange(2, 70))]
        fast = build(toks, min_n=2, max_n=4, max_edits=1, max_candidates=10_000)
        slow = build(toks, min_n=2, max_n=4, max_edits=1, max_candidates=10_000)
        slow._may_beat = lambda pos, end, best: True  # compare every candidate in full
        assert fast.find() == slow.find(), (trial, toks)


# -- frequency-aware continuations ----------------------------------------------------------


def brute_force_ranked(
    tokens, match, count, *, max_n, max_candidates, limit=None, floor=None, min_share=0.0
):
    """Reference for ranked_continuation with exact matching (max_edits=0), from its rule.

    Candidates: the ``max_candidates`` most recent indexed occurrences of the last
    ``match.n`` tokens whose backwards match is >= min(match.length, floor or max_n), plus
    the match itself. A candidate survives step j when its tokens at offsets < j equal the
    block so far; the survivors that have a token at offset j vote.
    """
    end = len(tokens)
    stop = end if limit is None else min(limit, end)
    out, shares = [], []

    def token_at(c, j):
        src = c + j
        if src < stop:
            return tokens[src]
        return out[src - end] if limit is None else None

    if match.skipped:
        for j in range(count):
            t = token_at(match.position, j)
            if t is None:
                break
            out.append(t)
        return out, [1.0] * len(out)
    n = match.n
    need = min(match.length, max_n if floor is None else floor)
    occurrences = [
        p
        for p in range(end - 1, n - 1, -1)
        if (limit is None or p < limit) and tokens[p - n : p] == tokens[end - n :]
    ]

    def backwards(p):
        k = 0
        while p - 1 - k >= 0 and tokens[p - 1 - k] == tokens[end - 1 - k]:
            k += 1
        return k

    cands = [p for p in occurrences[:max_candidates] if p == match.position or backwards(p) >= need]
    for j in range(count):
        survivors = [c for c in cands if all(token_at(c, i) == out[i] for i in range(j))]
        votes = [(c, token_at(c, j)) for c in survivors if token_at(c, j) is not None]
        if not votes:
            break
        tally = {}
        for _, t in votes:
            tally[t] = tally.get(t, 0) + 1
        top = max(tally.values())
        best = next(t for _, t in votes if tally[t] == top)  # votes are most recent first
        share = top / len(votes)
        if j and share < min_share:
            break
        out.append(best)
        shares.append(share)
    return out, shares


def test_ranked_continuation_matches_brute_force_reference():
    rng = random.Random(4)
    checked = branched = 0
    for trial in range(400):
        vocab = rng.choice([2, 3, 4])
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        min_n = rng.choice([1, 2, 3])
        max_n = rng.choice([min_n, min_n + 1, 5])
        limit = rng.choice([None, None, rng.randrange(len(toks) + 1)])
        max_candidates = rng.choice([2, 5, 10_000])
        floor = rng.choice([None, 1, 2, 4, 100])
        min_share = rng.choice([0.0, 0.0, 0.5, 0.7, 1.0])
        count = rng.randrange(1, 14)
        realign = rng.random() < 0.3
        idx = build(
            toks,
            min_n=min_n,
            max_n=max_n,
            limit=limit,
            max_candidates=max_candidates,
            realign=realign,
        )
        m = idx.find()
        if m is None:
            continue
        got = idx.ranked_continuation(m, count, min_share=min_share, floor=floor)
        want = brute_force_ranked(
            toks,
            m,
            count,
            max_n=max_n,
            max_candidates=max_candidates,
            limit=limit,
            floor=floor,
            min_share=min_share,
        )
        assert got == want, (trial, toks, m, count, limit, max_candidates, floor, min_share)
        assert len(got[0]) == len(got[1]) and 1 <= len(got[0]) <= count
        checked += 1
        branched += any(s < 1.0 for s in got[1])
    assert checked > 250 and branched > 50  # the trials exercise branching points


def test_ranked_continuation_most_frequent_beats_most_recent():
    toks = [1, 2, 7, 8, 1, 2, 7, 8, 1, 2, 9, 9, 1, 2]
    idx = build(toks, min_n=2, max_n=2)
    m = idx.find()
    assert m.position == 10 and idx.continuation(m, 2) == [9, 9]  # the most recent
    tokens, shares = idx.ranked_continuation(m, 2)
    assert tokens == [7, 8]  # followed [1, 2] twice
    assert shares == [2 / 3, 1.0]


def test_ranked_continuation_ties_go_to_the_most_recent():
    idx = build([1, 2, 7, 1, 2, 8, 1, 2], min_n=2, max_n=2)
    assert idx.ranked_continuation(idx.find(), 1) == ([8], [0.5])
    idx = build([1, 2, 7, 1, 2, 8, 1, 2, 7, 1, 2, 8, 1, 2], min_n=2, max_n=2)
    assert idx.ranked_continuation(idx.find(), 1) == ([8], [0.5])  # 2 votes each


def test_ranked_continuation_min_share_shortens_the_block_at_the_branch():
    toks = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4, 5, 0, 1, 2]
    idx = build(toks, min_n=2, max_n=2)
    m = idx.find()
    tokens, shares = idx.ranked_continuation(m, 6)
    assert tokens == [3, 4, 5, 0, 1, 2]  # on through the branch with the winner
    assert shares == [1.0, 1.0, 2 / 3, 1.0, 1.0, 1.0]
    assert idx.ranked_continuation(m, 6, min_share=0.8) == ([3, 4], [1.0, 1.0])
    assert idx.ranked_continuation(m, 6, min_share=0.6) == (tokens, shares)
    # The first token is kept whatever its share; past it one candidate is left.
    idx = build([1, 2, 7, 1, 2, 8, 1, 2], min_n=2, max_n=2)
    assert idx.ranked_continuation(idx.find(), 3, min_share=0.9) == ([8, 1, 2], [0.5, 1.0, 1.0])


def test_ranked_continuation_respects_the_limit():
    prompt = [1, 2, 7, 8, 3, 1, 2, 7]
    idx = NgramIndex(2, 2, limit=len(prompt), max_edits=0, realign=False)
    idx.extend(prompt + [9, 1, 2])  # the output's [1, 2] is not indexed
    m = idx.find()
    assert m.position == 7 and idx.continuation(m, 4) == [7]  # stops at the prompt's end
    # The most recent candidate stops voting at the limit; the older one copies on, and
    # neither copies past it.
    tokens, shares = idx.ranked_continuation(m, 10)
    assert tokens == [7, 8, 3, 1, 2, 7] and shares == [1.0] * 6


def test_ranked_continuation_all_agree_gives_shares_of_one():
    toks = [5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 7, 1, 2]
    idx = build(toks, min_n=2, max_n=2)
    m = idx.find()
    assert idx.ranked_continuation(m, 2) == ([3, 4], [1.0, 1.0]) and idx.continuation(m, 2) == [
        3,
        4,
    ]
    # A single candidate, copying into itself, equals the plain continuation.
    idx = build([9, 1, 2, 1, 2], min_n=2, max_n=2)
    assert idx.ranked_continuation(idx.find(), 5) == ([1, 2, 1, 2, 1], [1.0] * 5)
    # max_candidates=1 leaves the match alone.
    idx = build([1, 2, 7, 8, 1, 2, 7, 8, 1, 2, 9, 9, 1, 2], min_n=2, max_n=2, max_candidates=1)
    m = idx.find()
    assert idx.ranked_continuation(m, 3) == (idx.continuation(m, 3), [1.0] * 3)
    assert idx.ranked_continuation(m, 0) == ([], [])


def test_ranked_continuation_of_a_realigned_match_is_the_plain_copy():
    source = [1, 2, 3, 4, OLD, 5, 6, 7, 8, 5, 6, 9]
    idx = build(source + [9, 1, 2, 3, 4, NEW], realign=True)
    m = idx.find()
    assert m.skipped == 1
    assert idx.ranked_continuation(m, 3, min_share=0.9) == ([5, 6, 7], [1.0, 1.0, 1.0])


def test_ranked_continuation_floor_keeps_an_edit_aligned_match():
    # [5, 6] matches after the edit; the aligned occurrence matches 6 tokens across the
    # edit, two decoys only the 2-gram. The default floor (max_n = 4) lets only the
    # aligned one vote; floor=2 lets the decoys outvote it.
    aligned = [11, 12, 13, 14, OLD, 5, 6, 20, 21, 22]
    decoys = [30, 5, 6, 40, 41, 31, 5, 6, 40, 42]
    history = [11, 12, 13, 14, NEW, 5, 6]
    idx = build(aligned + decoys + history, min_n=2, max_n=4, max_edits=1)
    m = idx.find()
    assert m.n == 2 and m.length == 6 and idx.continuation(m, 3) == [20, 21, 22]
    assert idx.ranked_continuation(m, 3) == ([20, 21, 22], [1.0, 1.0, 1.0])
    tokens, shares = idx.ranked_continuation(m, 2, floor=2)
    assert tokens == [40, 42] and shares == [2 / 3, 0.5]


def test_ranked_continuation_bad_arguments():
    idx = build([1, 2, 1, 2])
    m = idx.find()
    with pytest.raises(ValueError, match="min_share"):
        idx.ranked_continuation(m, 2, min_share=1.5)
    with pytest.raises(ValueError, match="floor"):
        idx.ranked_continuation(m, 2, floor=0)
