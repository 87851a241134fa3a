"""The ``dflash`` drafter in a pipeline: greedy output identical to plain decoding, the
context cache equal to one fed only the accepted text, sampled rounds with ``q``."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest
import specdec
from dflash_support import tiny_config, trained_drafter, write_checkpoint
from specdec.testing import check_batch_identity, check_greedy_identity, make_tiny_model
from specdec_dflash import DFlashDrafter, DFlashLoadError


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    target = make_tiny_model(request.param)
    folder = tmp_path_factory.mktemp(f"dflash-{request.param}")
    write_checkpoint(folder, tiny_config(target, ids=(0, 1), block=6), seed=2)
    return target, folder


def _policy(folder, **options):
    return specdec.Policy(
        name="dflash",
        drafters=("dflash",),
        verifier="hidden",
        options={"dflash": {"path": str(folder), "sizing": "fixed", **options}},
    )


def test_greedy_output_is_plain_decoding_and_blocks_are_drafted(setup):
    target, folder = setup
    pol = _policy(folder)
    prompt = [1, 5, 9, 2, 7, 3, 11, 4]
    out = check_greedy_identity(
        target, pol, prompt, max_tokens_list=[*range(1, 17), 40], require_drafts=False
    )
    assert out["drafted"] > 0  # a block every round (random weights: rarely accepted)


def test_the_context_cache_holds_exactly_the_committed_positions(setup, monkeypatch):
    """After every round the drafter's context equals that of a drafter fed the features
    of the committed text alone (computed here by one plain forward over it)."""
    target, folder = setup
    sessions = []
    real = DFlashDrafter.session

    def keep(self, ctx):
        s = real(self, ctx)
        sessions.append(s)
        return s

    monkeypatch.setattr(DFlashDrafter, "session", keep)
    pipe = specdec.assemble(target, None, _policy(folder))
    prompt = [1, 5, 9, 2, 7, 3, 11, 4]
    tokens = list(prompt)
    seen = 0
    for r in pipe.stream(prompt, max_tokens=24):
        tokens.append(r.token)
        s = sessions[-1]
        if s.caches and s.fed > seen:
            seen = s.fed
            _check_context(target, s, tokens[: s.fed])
    assert seen >= len(prompt) - 1


def _check_context(target, s, committed):
    from mlx_lm.models.cache import make_prompt_cache
    from specdec.verifiers import HiddenStateVerifier

    v = HiddenStateVerifier(layers=list(s.ids))
    vr = v.verify(target, mx.array(committed), make_prompt_cache(target))
    feats = mx.concatenate([vr.layers[i] for i in s.ids], axis=-1)
    fresh = s.module.make_cache()
    s.module.append_context(feats[None], 0, fresh)
    for got, want in zip(s.caches, fresh):
        n = want.offset
        assert got.offset == n
        np.testing.assert_allclose(
            np.array(got.keys[..., :n, :]), np.array(want.keys[..., :n, :]), atol=1e-4
        )
        np.testing.assert_allclose(
            np.array(got.values[..., :n, :]), np.array(want.values[..., :n, :]), atol=1e-4
        )


def test_sampled_output_has_the_targets_distribution(setup):
    """Drafts drawn from the block's distributions with their q: rejection sampling keeps
    the target's joint distribution of the first tokens (chi-square)."""
    from specdec.testing import check_sampled_distribution

    target, folder = setup
    p = check_sampled_distribution(
        target,
        _policy(folder),
        [1, 5, 9, 2],
        temperature=1.0,
        max_tokens=2,
        n_samples=800,
        require_drafts=False,
    )
    assert p > 1e-3


def test_sampled_drafts_carry_q_and_keep_seeded_runs_reproducible(setup):
    target, folder = setup
    pipe = specdec.assemble(target, None, _policy(folder))
    a = pipe.generate([1, 5, 9, 2], max_tokens=20, temperature=1.0, seed=3)
    b = pipe.generate([1, 5, 9, 2], max_tokens=20, temperature=1.0, seed=3)
    assert a.tokens == b.tokens and a.stats.drafted > 0
    assert "rejection" in a.stats.acceptors or any("rejection" in k for k in a.stats.acceptors)


def test_a_missing_or_unfit_checkpoint_is_refused_at_assemble(setup, tmp_path):
    target, _ = setup
    with pytest.raises(specdec.PolicyError, match="option path is required"):
        specdec.assemble(target, None, specdec.Policy(drafters=("dflash",), verifier="hidden"))
    with pytest.raises(DFlashLoadError, match="no DFlash drafter folder"):
        specdec.assemble(target, None, _policy(tmp_path / "nothing"))


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    """The random drafter of ``setup`` self-distilled for seconds on the target's greedy
    answers to six prompts."""
    target, folder = setup
    prompts = [[1 + i, 5, 9 + i, 2, 7, 3 + i] for i in range(6)]
    out = tmp_path_factory.mktemp("trained")
    losses, result = trained_drafter(target, folder, out, prompts)
    return target, out, prompts, losses, result


def test_a_drafter_trained_for_seconds_drafts_blocks_that_are_accepted(trained):
    """A few seconds of self-distillation on the target's own greedy text: the drafter
    then proposes blocks the target accepts (deeper than one token), greedy output still
    plain decoding's for max_tokens 1..16 and 40, with the kit's stop token inside
    accepted blocks."""
    target, folder, prompts, losses, result = trained
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    pos = result["position_acceptance"]
    # the first draft is right often, two in a row sometimes (chance: 1 in 64)
    assert len(pos) == 5 and pos[0] > 0.3 and pos[1] > 0.05
    out = check_greedy_identity(
        target, _policy(folder), prompts[0], max_tokens_list=[*range(1, 17), 40]
    )
    assert out["accepted"] > out["runs"]  # more than one accepted token per run


def test_rows_of_a_batch_draft_their_own_blocks(trained):
    """As rows of a batch (each row's session drafts its own block), a fourth prompt
    joining when the first row leaves: every row is its prompt decoded alone."""
    target, folder, prompts, _, _ = trained
    batch = check_batch_identity(
        target,
        attrs.evolve(_policy(folder), max_batch=3),
        prompts[:4],
        max_tokens=[12, 30, 24, 20],
        max_rows=3,
    )
    assert batch["accepted"] > batch["runs"] and batch["max_batch_rows"] == 3


def test_copy_dflash_copies_where_the_context_has_a_match_and_diffuses_otherwise(trained):
    from specdec.testing import find_copy_prompt

    target, folder, prompts, _, _ = trained
    # blocks priced by the verify curve alone (the measured round overhead of a tiny
    # model depends on the machine's timing); the prompt is searched for, since this
    # tiny target's text repeats itself only by luck
    pol = (
        specdec.load_policy("copy-dflash")
        # the DFlash drafter drafts whenever it is asked (its own sizing is tested alone)
        .with_options("dflash", path=str(folder), sizing="fixed")
        .with_options("ngram_copy", round_overhead=False)
    )
    prompt = find_copy_prompt(
        target, pol, min_accepted=2, max_tokens=30, tries=32, drafter="ngram_copy"
    )
    check_greedy_identity(target, pol, prompt, max_tokens_list=(4, 30))
    pipe = specdec.assemble(target, None, pol)
    per = pipe.generate(prompt, max_tokens=30).stats.per_drafter
    assert per["ngram_copy"]["rounds"] > 0 and per["ngram_copy"]["accepted"] > 0
    assert per["dflash"]["feature_gaps"] == 0  # its context kept up with copied rounds
    # a prompt whose text the drafter was trained on: where the copy has no match the
    # DFlash drafter drafts, and its blocks are accepted
    check_greedy_identity(target, pol, prompts[0], max_tokens_list=(4, 40))
    per = pipe.generate(prompts[0], max_tokens=40).stats.per_drafter
    assert per["dflash"]["dflash_rounds"] > 0 and per["dflash"]["dflash_accepted"] > 0
    assert per["dflash"]["feature_gaps"] == 0


def test_a_hybrid_target_drafts_with_its_gdn_state_rolled_back(tmp_path):
    """qwen3_next (gated delta net layers and attention): rejected drafts roll the GDN
    state back exactly (gdn_transaction), output identical for max_tokens 1..16 and 40,
    blocks accepted."""
    from specdec_qwen_mtp_gdn import make_tiny_hybrid

    target = make_tiny_hybrid("qwen3_next", mixing=0.2)
    folder = tmp_path / "random"
    write_checkpoint(folder, tiny_config(target, ids=(0, 2), block=6), seed=2)
    prompts = [[1 + i, 5, 9 + i, 2, 7, 3 + i] for i in range(6)]
    losses, _ = trained_drafter(target, folder, tmp_path / "trained", prompts)
    assert losses[-1] < losses[0]
    pol = attrs.evolve(_policy(tmp_path / "trained"), rollback="gdn_transaction")
    out = check_greedy_identity(target, pol, prompts[0], max_tokens_list=[*range(1, 17), 40])
    assert out["accepted"] > out["runs"]


def test_a_request_from_a_prompt_cache_drafts_from_the_positions_it_prefilled(setup):
    """A prompt cache holds the first tokens: the drafter's context starts at the first
    position prefilled (no features for the cached ones), output still plain decoding's."""
    from mlx_lm.models.cache import make_prompt_cache

    target, folder = setup
    pipe = specdec.assemble(target, None, _policy(folder))
    plain = specdec.assemble(target, None, "none")
    prompt = [1, 5, 9, 2, 7, 3, 11, 4, 6, 8]
    cache = make_prompt_cache(target)
    target(mx.array(prompt[:6])[None], cache=cache)
    out = pipe.generate(prompt, max_tokens=20, prompt_cache=cache)
    assert out.tokens == plain.generate(prompt, max_tokens=20).tokens
    assert out.stats.cached_tokens == 6 and out.stats.drafted > 0
    assert out.stats.per_drafter["dflash"]["context_from"] == 6
