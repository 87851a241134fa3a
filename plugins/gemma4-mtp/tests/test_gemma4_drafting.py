"""Drafting with gemma4_mtp: exact greedy and sampled output with drafts accepted, caches
equal to plain decoding's after every round, composition with ngram_copy, depth."""

from __future__ import annotations

import pytest
import specdec
from gemma4_support import policy
from specdec.testing import (
    FAULTS,
    check_batch_identity,
    check_caches_match_plain,
    check_drafter_faults,
    check_greedy_identity,
    check_sampled_distribution,
    check_sampled_identity,
    find_copy_prompt,
)
from specdec_gemma4_mtp import DEFAULTS

CASES = [
    ("gemma4", "dense"),
    ("gemma4", "centroids"),
    ("gemma4-k-eq-v", "dense"),
    ("llama", "dense"),
]


@pytest.mark.parametrize("name,kind", CASES)
def test_greedy_identity_with_drafts_accepted(trained, name, kind):
    model, folder, seqs, _ = trained(name, kind)
    pol = policy(folder)
    prompt = seqs[0][:8]
    # max_tokens 1..16 and 40 (the sliding window of 8 wraps), and a stop token inside
    # an accepted block
    totals = check_greedy_identity(model, pol, prompt, max_tokens_list=(*range(1, 17), 40))
    assert totals["accepted"] > 0
    rounds = []
    out = specdec.assemble(model, policy=pol).generate(
        prompt, max_tokens=40, on_round=lambda r, c: rounds.append(r)
    )
    assert out.tokens == seqs[0][8:48]
    # primed on the prompt's last hidden state in prefill: the first round drafts already
    assert rounds[0].drafter == "gemma4_mtp" and len(rounds[0].block) == 3
    st = out.stats.per_drafter["gemma4_mtp"]
    assert st["assistant"]["path"] == str(folder) and st["assistant"]["trained_by_specdec"]
    assert st["assistant"]["logits"] == ("centroids" if kind == "centroids" else "dense")
    assert st["position_acceptance"][0] > 0.7  # the text it was trained on
    assert st["rounds_without_state"] == 0 and st["position_reached"][0] == st["rounds"]
    assert out.stats.tokens_per_forward > 1.5


def test_greedy_identity_on_text_the_assistant_never_saw(trained):
    model, folder, _, _ = trained("gemma4", "dense")
    prompt = [5, 9, 2, 33, 17, 40, 1, 8]
    check_greedy_identity(
        model, policy(folder), prompt, max_tokens_list=(3, 24), require_drafts=False
    )


@pytest.mark.parametrize("position", ["bonus", "last"])
def test_both_position_conventions_are_exact(trained, tmp_path, position):
    from specdec_gemma4_mtp import new_assistant, save_assistant, train_assistant

    model, _, seqs, _ = trained("gemma4", "dense")
    init, _ = new_assistant(model, layers=["sliding_attention", "full_attention"])
    module, st = train_assistant(model, seqs, init=init, steps=120, position=position)
    folder = save_assistant(tmp_path / position, module)
    pol = policy(folder, position=position)
    totals = check_greedy_identity(model, pol, seqs[1][:8], max_tokens_list=(7, 30))
    assert totals["accepted"] > 0
    out = specdec.assemble(model, policy=pol).generate(seqs[1][:8], max_tokens=30)
    assert out.stats.per_drafter["gemma4_mtp"]["assistant"]["position"] == position
    assert out.stats.per_drafter["gemma4_mtp"]["position_acceptance"][0] > 0.7


def test_the_caches_equal_plain_decodings_after_every_round(trained):
    model, folder, seqs, _ = trained("gemma4", "dense")
    # 40 tokens after an 8-token prompt: the sliding caches wrap (window 8)
    check_caches_match_plain(model, policy(folder), seqs[2][:8], max_tokens=40)


@pytest.mark.parametrize("kind", ["dense", "centroids"])
def test_sampled_distribution_is_the_targets(trained, kind):
    model, folder, seqs, _ = trained("gemma4", kind)
    p = check_sampled_distribution(model, policy(folder), seqs[1][:8], max_tokens=2, n_samples=800)
    assert p > 1e-3


def test_seeded_identity_with_greedy_drafts(trained):
    model, folder, seqs, _ = trained("gemma4", "dense")
    pol = policy(folder, sampled_drafts="greedy")
    totals = check_sampled_identity(model, pol, seqs[3][:8], max_tokens=24, temperature=0.7)
    assert totals["accepted"] > 0


def test_composition_copies_on_a_match_and_uses_the_assistant_otherwise(trained):
    model, folder, _, _ = trained("gemma4", "dense")
    # Blocks priced by the verify curve alone: on a tiny model the measured round
    # overhead makes which copies pay depend on the machine's timing. And this tiny
    # target's text does not repeat itself, so whether copies hold is luck: the prompt
    # is searched for (a CI run accepted none of ngram_copy's blocks on a fixed one).
    pol = policy(folder, preset="copy-gemma4").with_options("ngram_copy", round_overhead=False)
    prompt = find_copy_prompt(
        model, pol, min_accepted=2, max_tokens=30, tries=32, drafter="ngram_copy"
    )
    check_greedy_identity(model, pol, prompt, max_tokens_list=(4, 30))
    out = specdec.assemble(model, policy=pol).generate(prompt, max_tokens=30)
    per = out.stats.per_drafter
    assert per["ngram_copy"]["rounds"] > 0 and per["ngram_copy"]["accepted"] > 0
    assert per["gemma4_mtp"]["rounds"] > 0  # where the context has no match
    # the assistant reads the hidden row of every round, copied ones included
    assert per["gemma4_mtp"]["rounds_without_state"] == 0


def test_the_depth_grows_to_the_requested_block_and_stays_exact(trained):
    model, folder, seqs, _ = trained("gemma4", "dense")
    pol = policy(folder, depth=1, max_depth=3, window=4)
    out = specdec.assemble(model, policy=pol).generate(seqs[0][:8], max_tokens=48)
    assert out.tokens == seqs[0][8:56]
    st = out.stats.per_drafter["gemma4_mtp"]
    assert st["depth_grew"] >= 1 and st["depth"] > 1  # position 1 is right: it grows
    assert st["depth_shrank"] == 0 or st["depth"] >= 1
    fixed = policy(folder, depth=2, adaptive=False)
    out = specdec.assemble(model, policy=fixed).generate(seqs[0][:8], max_tokens=48)
    assert out.tokens == seqs[0][8:56]
    assert out.stats.per_drafter["gemma4_mtp"]["depth"] == 2
    assert set(out.stats.block_sizes) <= {0, 1, 2}
    # the configured depth of the checkpoint (block_size 4: three drafts) by default
    assert DEFAULTS["depth"] is None


def test_a_faulty_assistant_drafter_ends_in_a_named_error_or_identical_output(trained):
    # the kit's fault check: out-of-range ids (lazy ones too), bad q, exceptions
    model, folder, seqs, _ = trained("gemma4", "dense")
    outcomes = check_drafter_faults(model, policy(folder), seqs[0][:8], max_tokens=16)
    assert {o.fault for o in outcomes} == set(FAULTS)


def test_a_conversation_continued_from_its_prompt_cache(trained):
    # Turn 2 starts from the cache turn 1 left (only the new tokens prefilled): the
    # assistant reads the target's K/V, which the cache holds, and drafts as from scratch.
    from mlx_lm.models.cache import make_prompt_cache

    model, folder, seqs, _ = trained("gemma4", "dense")
    pipe = specdec.assemble(model, policy=policy(folder))
    plain = specdec.assemble(model, policy="none")
    cache = make_prompt_cache(model)
    turn1 = pipe.generate(seqs[0][:8], prompt_cache=cache, max_tokens=12)
    held = next(c.offset for c in cache if isinstance(getattr(c, "offset", None), int))
    second = seqs[0][: held + 6]
    assert second[: 8 + len(turn1.tokens)] == seqs[0][:8] + turn1.tokens
    turn2 = pipe.generate(second, prompt_cache=cache, max_tokens=20)
    fresh = pipe.generate(second, max_tokens=20)
    assert turn2.tokens == fresh.tokens == plain.generate(second, max_tokens=20).tokens
    assert turn2.stats.cached_tokens == held
    assert turn2.stats.drafted > 0 and turn2.stats.accepted > 0


# -- rows of a batch --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "centroids"])
def test_batch_rows_draft_together_and_equal_each_prompt_alone(trained, kind, monkeypatch):
    """Rows past the sliding window of 8, two at a time (the others join as rows finish):
    each equals its prompt decoded alone, the assistant drafts for two rows in the same
    calls and is accepted."""
    from specdec_gemma4_mtp.drafter import Gemma4MTPBatch, Gemma4MTPDrafter

    model, folder, seqs, _ = trained("gemma4", kind)
    made = []
    real = Gemma4MTPDrafter.batch
    monkeypatch.setattr(
        Gemma4MTPDrafter, "batch", lambda self, ctx: made.append(real(self, ctx)) or made[-1]
    )
    pol = policy(folder)
    prompts = [seqs[0][:8], seqs[1][:5], seqs[2][:11], seqs[3][:7]]
    out = check_batch_identity(model, pol, prompts, max_tokens=[30, 14, 30, 22], max_rows=2)
    assert out["accepted"] > 0 and out["max_batch_rows"] == 2
    assert isinstance(made[0], Gemma4MTPBatch) and made[0].joint_rounds > 0
    rows = specdec.assemble(model, policy=pol).generate_batch(prompts, max_tokens=30)
    assert all(r.stats.per_drafter["gemma4_mtp"]["batched"] for r in rows)
    assert sum(r.stats.accepted for r in rows) > 0


def test_sampled_batch_rows_equal_the_same_policy_alone(trained):
    model, folder, seqs, _ = trained("gemma4", "dense")
    prompts = [seqs[1][:8], seqs[3][:6], seqs[4][:10]]
    kw = dict(max_tokens=20, temperature=0.7, seed=3, against="policy")
    assert check_batch_identity(model, policy(folder), prompts, max_rows=2, **kw)["accepted"] > 0
