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
