"""The built-in draft_model drafter: identity, its own cache rollback, rejection sampling."""

from __future__ import annotations

import pytest
import specdec
from specdec.testing import check_caches_match_plain, check_greedy_identity, make_tiny_model


def _policy(draft, n=4):
    return specdec.Policy(
        name="draft",
        drafters=("draft_model",),
        options={"draft_model": {"model": draft, "num_draft_tokens": n}},
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_model_greedy_identity(models, copy_prompts, arch):
    target = models[arch]
    # the target as its own draft: every draft accepted; another seed: some rejected
    full = check_greedy_identity(target, _policy(target), copy_prompts[arch])
    assert full["accepted"] == full["drafted"] > 0
    other = (
        make_tiny_model(arch, seed=1, sharpness=None)
        if arch == "gemma3"
        else make_tiny_model(arch, seed=3)
    )
    if other is target:
        other = make_tiny_model(arch, seed=5)
    part = check_greedy_identity(target, _policy(other), copy_prompts[arch], require_drafts=False)
    assert part["drafted"] > 0


def test_draft_model_target_caches_match_plain(models, copy_prompts):
    target = models["gemma3"]
    other = make_tiny_model("gemma3", seed=7)
    check_caches_match_plain(
        target, _policy(other), copy_prompts["gemma3"], max_tokens=24, require_drafts=False
    )


def test_draft_cache_tracks_the_committed_prefix(models, copy_prompts):
    target = models["llama"]
    draft = make_tiny_model("llama", seed=3)
    pipe = specdec.assemble(target, policy=_policy(draft, 5))
    d = pipe.drafters[0]
    sessions = []
    make = d.session
    d.session = lambda ctx: sessions.append(make(ctx)) or sessions[-1]
    offsets = []

    def rec(result, caches):
        # the draft cache never holds more than the committed history minus the last token
        s = sessions[-1]
        offsets.append((s.cache[0].offset, s.fed, result.start_position + len(result.committed)))

    out = pipe.generate(copy_prompts["llama"], max_tokens=20, on_round=rec)
    assert out.stats.drafted > 0
    for off, fed, hist in offsets:
        assert off == fed <= hist


def test_num_draft_tokens_is_the_block_drafted_per_round(models, copy_prompts):
    target = models["llama"]
    rounds = []
    pipe = specdec.assemble(target, policy=_policy(target, 3))
    out = pipe.generate(
        copy_prompts["llama"], max_tokens=24, on_round=lambda r, c: rounds.append(r)
    )
    drafted = [len(r.block) for r in rounds if r.drafter == "draft_model"]
    assert drafted and all(n == 3 for n in drafted[:-1]) and drafted[-1] <= 3
    assert out.stats.per_drafter["draft_model"]["num_draft_tokens"] == 3


def test_draft_model_from_assemble_shorthand(models, copy_prompts):
    pipe = specdec.assemble(models["llama"], policy="none", draft_model=models["llama"])
    assert pipe.policy.drafters == ("draft_model",)
    # with no policy named (the copy preset by default), the draft model drafts alone
    alone = specdec.assemble(models["llama"], draft_model=models["llama"])
    assert alone.policy.drafters == ("draft_model",) and alone.policy.name == "draft"
    assert specdec.assemble(models["llama"]).policy.name == specdec.default_policy().name
    out = pipe.generate(copy_prompts["llama"], max_tokens=12)
    assert out.stats.accepted > 0


def test_draft_model_without_model_option_is_a_policy_error(models):
    with pytest.raises(specdec.PolicyError, match="needs option 'model'"):
        specdec.assemble(models["llama"], policy="draft")
