"""The copy cursor: following the output's place in the source across edits, and
writing learnt edits into later copies (no model)."""

from __future__ import annotations

import pytest
from specdec import RoundResult
from specdec.bench.workloads import load_workloads
from specdec.testing import feed_round, request_context
from specdec_ngram import create_ngram_copy
from specdec_ngram.cursor import CopyCursor


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from specdec.models import default_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path()))


def follow(source, output, *, seat=0, **options):
    """A cursor over ``source`` seated at ``seat``, fed ``output`` one token at a time."""
    toks = list(source)
    cur = CopyCursor(toks, **options)
    cur.seat(seat, 8, len(toks))
    for t in output:
        toks.append(t)
        cur.feed(len(toks) - 1, [t])
    return cur


SRC = list(range(100, 140))  # 40 distinct tokens


def test_follows_a_verbatim_copy():
    cur = follow(SRC, SRC[:10])
    assert (cur.pos, cur.run, cur.div) == (10, 18, None)
    assert cur.continuation(3) == SRC[10:13]


def test_a_replaced_token_is_found_again_and_learnt_with_its_context():
    # 105 written as 7, 8; the copy resumes at 106
    out = SRC[:5] + [7, 8] + SRC[6:12]
    cur = follow(SRC, out[:8])  # ... 104, 7, 8, 106
    assert cur.tentative and cur.pos == 7 and cur.resumed == 1
    cur = follow(SRC, out)
    assert not cur.tentative and cur.pos == 12 and cur.confirmed == 1
    (rule,) = cur.rules.values()
    assert (rule.old, rule.new, rule.context) == ((105,), (7, 8), False)


def test_an_inserted_and_a_deleted_token():
    ins = follow(SRC, SRC[:5] + [7] + SRC[5:12])
    assert ins.pos == 12 and [r.new for r in ins.rules.values()] == [(104, 7, 105)]
    dele = follow(SRC, SRC[:5] + SRC[7:14])
    assert dele.pos == 14 and [r.old for r in dele.rules.values()] == [(104, 105, 106, 107)]


def test_a_short_resumption_after_a_long_edit_is_not_taken():
    # 9 tokens written instead of one: one or two source tokens after them are no
    # evidence of the place; three are.
    out = SRC[:5] + [1, 2, 3, 4, 5, 6, 7, 8, 9] + SRC[6:9]
    cur = follow(SRC, out[:-1])
    assert cur.pos is None and cur.div == 5
    cur = follow(SRC, out)
    assert cur.pos == 9 and cur.resumed == 3


def test_an_edit_longer_than_the_window_loses_the_place():
    cur = follow(SRC, SRC[:5] + list(range(1, 40)), window=4)
    assert cur.pos is None and cur.div is None and cur.lost == 1
    cur.feed(999, [1])  # not seated: nothing happens
    assert cur.pos is None


def test_a_gap_in_what_is_fed_loses_the_place():
    toks = list(SRC)
    cur = CopyCursor(toks)
    cur.seat(0, 8, len(toks))
    toks.extend([100, 101])
    cur.feed(len(toks) - 1, [101])  # skipped position 40
    assert cur.pos is None and cur.lost == 1


def test_apply_writes_the_rule_and_maps_positions():
    cur = follow(SRC, SRC[:5] + [7, 8] + SRC[6:12])
    # a later copy of 103..108 (the rule's old token 105 inside it)
    out, origin, used = cur.apply(102, [103, 104, 105, 106, 107, 108], 10)
    assert out == [103, 104, 7, 8, 106, 107, 108]
    assert origin == [0, 1, 2, 2, 3, 4, 5]
    assert [(o, r.old) for o, r in used] == [(2, (105,))]
    # the context token may be the last committed one
    out, _, used = cur.apply(104, [105, 106, 107], 3)
    assert out == [7, 8, 106] and used[0][0] == 0
    # cut to count
    assert cur.apply(102, [103, 104, 105, 106], 3)[0] == [103, 104, 7]


def test_a_rule_that_misses_more_than_it_hits_is_no_longer_applied():
    cur = follow(SRC, SRC[:5] + [7, 8] + SRC[6:12])
    (rule,) = cur.rules.values()
    _, _, used = cur.apply(102, [103, 104, 105, 106, 107], 5)
    assert CopyCursor.score(used, 5, 5) == (1, 0)  # accepted through the trailing context
    assert CopyCursor.score(used, 2, 5) == (0, 1)  # rejected at the first written token
    assert CopyCursor.score(used, 1, 5) == (0, 0)  # rejected before it: no verdict
    assert CopyCursor.score(used, 3, 3) == (0, 0)  # the block ended inside it
    assert rule.active
    CopyCursor.score(used, 3, 5)
    assert not rule.active
    assert cur.apply(102, [103, 104, 105, 106], 4)[0] == [103, 104, 105, 106]


def test_choose_keeps_the_place_over_a_shorter_match_and_moves_for_a_longer():
    cur = follow(SRC, SRC[:10])  # run 18
    at = len(SRC) + 10
    assert cur.choose(None, at) is True
    assert cur.choose((10, 40), at) is False  # the same place
    assert cur.choose((3, 5), at) is True
    assert cur.choose((3, 30), at) is False and cur.pos == 3 and cur.run == 30
    assert cur.choose((7, 2), at + 1) is False and cur.pos == 7  # not fed: lost, re-seated


def replay(prompt, answer, **options):
    """The rounds a session of ``ngram_copy`` (with ``options``, blocks sized by a
    ladder that drafts up to 16 tokens on any match) takes while a target writes
    ``answer`` after ``prompt``, and the session's stats. No model: each round
    commits the block's tokens that agree with ``answer`` and the next one."""
    d = create_ngram_copy(sizing="ladder", ladder=[[2, 16]], **options)
    s = d.session(request_context(prompt))
    hist, i, rounds = list(prompt), 0, 0
    while i < len(answer):
        draft = s.propose(hist, min(16, len(answer) - i))
        block = tuple(draft.tokens) if draft else ()
        n = 0
        while n < len(block) and block[n] == answer[i + n]:
            n += 1
        got = answer[i : i + n + 1]
        s.observe(
            RoundResult(
                drafter="ngram_copy" if block else None,
                block=block,
                n_accepted=n,
                token=got[-1],
                committed=tuple(got),
                start_position=len(hist),
            )
        )
        hist += got
        i += len(got)
        rounds += 1
    return rounds, s.stats()


def test_rename_everywhere_is_drafted_renamed_from_the_second_occurrence():
    # A "file" of distinct tokens where identifier 90 occurs 4 times; the answer
    # writes it as 91, 92 everywhere.
    chunks = [list(range(10 + 12 * i, 22 + 12 * i)) for i in range(5)]
    source = chunks[0] + [90] + chunks[1] + [90] + chunks[2] + [90] + chunks[3] + [90] + chunks[4]
    answer = []
    for t in source:
        answer += [91, 92] if t == 90 else [t]
    plain, _ = replay(source, answer, cursor=False)
    rounds, stats = replay(source, answer)
    assert stats["edits_learnt"] == 1
    assert stats["edits_written"] >= 2 and stats["edits_accepted"] >= 2
    assert stats["edits_rejected"] == 0
    assert stats["cursor_confirmed"] >= 1
    assert rounds < plain
    assert replay(source, answer, learn_edits=False)[1]["edits_written"] == 0


def test_a_real_rename_through_the_default_tokenizer_takes_fewer_rounds(smollm2_tokenizer):
    # code-edit's file and its expected answer (`filename` renamed to `file_path` at
    # 43 places), tokenized by the default model's tokenizer, the answer written
    # faithfully after the file (what a model that follows the request does).
    ws = load_workloads()
    code = ws["code-edit"]
    prompt = smollm2_tokenizer.encode(code.request)
    answer = smollm2_tokenizer.encode(code.expected)
    index_only, _ = replay(prompt, answer, cursor=False)
    no_edits, _ = replay(prompt, answer, learn_edits=False)
    rounds, stats = replay(prompt, answer)
    assert rounds <= no_edits <= index_only
    assert rounds < 0.7 * index_only  # 107 against 194 when measured
    assert stats["edits_accepted"] >= 20 and stats["edits_rejected"] <= stats["edits_accepted"] // 4


def test_the_session_rebinds_the_cursor_on_a_resync():
    source = list(range(10, 40))
    s = create_ngram_copy().session(request_context(source))
    h = feed_round(s, source, [10, 11, 12, 13])
    assert s.propose(h, 4) is not None
    assert s.cursor is not None and s.cursor.pos == 4
    other = [5, 6, 7, 8] + list(range(10, 30))
    s.propose(other, 4)  # a history that disagrees: re-indexed
    assert s.stats()["resyncs"] == 1
    assert s.cursor._toks is s.index.tokens
    assert create_ngram_copy(cursor=False).session(request_context(source)).cursor is None


def test_a_rejection_at_the_blocks_end_counts_and_a_retired_rule_returns():
    cur = follow(SRC, SRC[:5] + [7, 8] + SRC[6:12])
    (rule,) = cur.rules.values()
    _, _, used = cur.apply(102, [103, 104, 105], 3)  # the block ends inside the rule
    assert used[0][0] == 2
    assert CopyCursor.score(used, 2, 3) == (0, 1)  # 7 rejected: counted
    assert not rule.active
    # the cursor confirms the same edit at a later occurrence: the rule is back
    toks = list(SRC) + SRC[:5] + [7, 8] + SRC[6:12]
    cur._toks = toks
    cur.seat(0, 8, len(toks))
    for t in SRC[:5] + [7, 8] + SRC[6:12]:
        toks.append(t)
        cur.feed(len(toks) - 1, [t])
    assert rule.hits == 1 and rule.active and len(cur.rules) == 1


def test_rules_that_would_repeat_themselves_are_not_kept_and_learning_can_be_off():
    # 105 written as 7, 105, 8: the new tokens contain the old one
    cur = follow(SRC, SRC[:5] + [7, 105, 8] + SRC[6:12])
    assert cur.confirmed >= 1 and not [r for r in cur.rules.values() if not r.context]
    off = follow(SRC, SRC[:5] + [7, 8] + SRC[6:12], learn=False)
    assert off.confirmed == 1 and not off.rules and off.pos == 12


def test_source_prompt_never_copies_past_the_limit():
    toks = list(SRC)
    cur = CopyCursor(toks, limit=20)
    cur.seat(10, 8, len(toks))
    for t in SRC[10:19] + [SRC[19]]:
        toks.append(t)
        cur.feed(len(toks) - 1, [t])
    assert cur.pos is None  # reached the limit: the place is given up
    assert cur.continuation(4) == []
