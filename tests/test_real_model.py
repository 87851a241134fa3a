"""Speculation on the real default model (SmolLM2-135M-Instruct): identity, drafting, stops.

How fast and how faithful the model is on real workloads is measured by
``specdec bench``; these tests check that speculation on the real model runs
(drafts proposed and accepted, fewer target forwards) without changing a token.
"""

from __future__ import annotations

import specdec

SOURCE = '''def clamp(value, low, high):
    """Return value limited to the range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
'''
# The 135M model answers this in French and repeats itself: copy material for ngram_copy.
PROMPT = "Translate this function to use a docstring in French:\n\n```python\n" + SOURCE + "```"


def test_copy_policy_is_identical_and_needs_fewer_forwards(smollm2):
    model, tok = smollm2
    plain = specdec.assemble(model, tok, "none")
    copy = specdec.assemble(model, tok, "copy")
    ids = plain.encode_prompt(PROMPT)
    a = plain.generate(ids, max_tokens=64)
    b = copy.generate(ids, max_tokens=64)
    assert b.tokens == a.tokens
    assert b.text == a.text
    assert b.stats.drafted > 0 and b.stats.accepted > 0
    assert b.stats.target_forwards < a.stats.target_forwards == 64


def test_copy_policy_sampled_seeded_run_is_identical(smollm2):
    model, tok = smollm2
    plain = specdec.assemble(model, tok, "none")
    copy = specdec.assemble(model, tok, "copy")
    ids = plain.encode_prompt(PROMPT)
    a = plain.generate(ids, max_tokens=48, temperature=0.7, seed=7)
    b = copy.generate(ids, max_tokens=48, temperature=0.7, seed=7)
    assert b.tokens == a.tokens
    assert b.stats.drafted > 0


def test_eos_inside_a_copied_block_ends_the_stream(smollm2):
    model, tok = smollm2
    copy = specdec.assemble(model, tok, "copy")
    ids = copy.encode_prompt("The capital of France is Paris. Repeat the previous sentence.")
    out = copy.generate(ids, max_tokens=60)
    plain = specdec.assemble(model, tok, "none").generate(ids, max_tokens=60)
    assert out.tokens == plain.tokens
    assert out.text == plain.text == "The capital of France is Paris."
    assert out.finish_reason == plain.finish_reason == "stop"
    assert out.stats.accepted > 0
