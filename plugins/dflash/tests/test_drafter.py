"""The ``dflash`` drafter in a pipeline: greedy output identical to plain decoding, the
context cache equal to one fed only the accepted text, sampled rounds with ``q``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from dflash_support import tiny_config, write_checkpoint
from specdec.testing import check_greedy_identity, make_tiny_model
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


def test_a_drafter_trained_for_seconds_drafts_blocks_that_are_accepted(setup, tmp_path):
    """A few seconds of self-distillation on the target's own greedy text: the drafter
    then proposes blocks the target accepts (deeper than one token), greedy output still
    plain decoding's."""
    from specdec_dflash import load_dflash
    from specdec_dflash.train import train_blocks

    target, folder = setup
    plain = specdec.assemble(target, None, "none")
    prompts = [[1 + i, 5, 9 + i, 2, 7, 3 + i] for i in range(6)]
    seqs = [p + plain.generate(p, max_tokens=40).tokens for p in prompts]
    module, _ = load_dflash(folder, target)
    losses = train_blocks(module, target, seqs, steps=150, lr=3e-3, anchors_per_sequence=24)
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    out_dir = tmp_path / "trained"
    from mlx.utils import tree_flatten

    out_dir.mkdir()
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(module.parameters())))
    (out_dir / "config.json").write_text((folder / "config.json").read_text())
    pol = _policy(out_dir)
    out = check_greedy_identity(target, pol, prompts[0], max_tokens_list=[8, 24, 40])
    assert out["accepted"] > out["runs"]  # more than one accepted token per run


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
