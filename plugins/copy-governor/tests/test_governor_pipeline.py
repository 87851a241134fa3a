"""copy_governor in the core pipeline: it governs any drafter by name (here the test kit's oracle)."""

from __future__ import annotations

import pytest
import specdec
from specdec.testing import (
    check_greedy_identity,
    check_listed,
    make_tiny_model,
    plugin_host,
    require_installed,
)

PROMPT = [5, 17, 3, 42, 8, 23, 11, 60, 2, 31]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=64, seed=0)


@pytest.fixture(scope="module")
def reference(model):
    """Prompt + plain greedy output: what the oracle drafter copies from."""
    out = specdec.assemble(model, policy="none").generate(PROMPT, max_tokens=96).tokens
    return PROMPT + out


@pytest.fixture(autouse=True)
def host():
    # The kit's host registers the oracle drafter next to the installed plugins.
    with plugin_host() as h:
        yield h


def oracle_policy(reference, *, governor="copy_governor", corruption="none", block=16, **gov):
    options = {"oracle": {"reference": reference, "corruption": corruption, "block": block}}
    if governor and gov:
        options[governor] = gov
    return specdec.Policy(name="oracle", drafters=("oracle",), governor=governor, options=options)


def blocks_of(pipe, prompt, max_tokens):
    sizes = []
    out = pipe.generate(
        prompt, max_tokens=max_tokens, on_round=lambda r, caches: sizes.append(len(r.block))
    )
    return out, sizes


# -- installation ---------------------------------------------------------------------


def test_installed_through_entry_point():
    # require_installed skips when the tests run from a source tree, and fails under CI
    dist = require_installed("specdec-plugin-copy-governor")
    eps = [ep for ep in dist.entry_points if ep.group == "specdec"]
    assert [(ep.name, ep.value) for ep in eps] == [
        ("copy_governor", "specdec_copy_governor.plugin")
    ]
    info = specdec.get_plugin_host().get("governor", "copy_governor")
    assert info.distribution == "specdec-plugin-copy-governor"
    assert info.description


def test_listed_by_specdec_plugins():
    check_listed("specdec-plugin-copy-governor", {"governor": ["copy_governor"]})


def test_options_reach_the_governor_and_unknown_ones_fail(model, reference):
    pipe = specdec.assemble(model, policy=oracle_policy(reference, probation_cap=2))
    assert pipe.governor.probation_cap == 2
    with pytest.raises(specdec.PolicyError, match="accepted options"):
        specdec.assemble(model, policy=oracle_policy(reference, probation_caps=2))


# -- behaviour in the loop ---------------------------------------------------------------


def test_probation_then_full_blocks_for_a_good_drafter(model, reference):
    pipe = specdec.assemble(model, policy=oracle_policy(reference))
    out, sizes = blocks_of(pipe, PROMPT, 64)
    assert out.tokens == reference[len(PROMPT) : len(PROMPT) + 64]
    assert sizes[:3] == [4, 4, 16]  # probation (2 good rounds at cap 4), then the policy's 16
    s = out.stats
    assert s.drafted > 0 and s.accepted == s.drafted
    g = s.governor["drafters"]["oracle"]
    assert g["on_probation"] is False and g["cap"] is None and g["ema"] == 1.0
    assert s.governor["suspensions"] == 0


def test_suspends_a_drafter_that_is_always_wrong(model, reference):
    ungoverned = specdec.assemble(
        model, policy=oracle_policy(reference, governor=None, corruption="full")
    )
    governed = specdec.assemble(model, policy=oracle_policy(reference, corruption="full"))
    a = ungoverned.generate(PROMPT, max_tokens=64)
    b, sizes = blocks_of(governed, PROMPT, 64)
    assert a.tokens == b.tokens == reference[len(PROMPT) : len(PROMPT) + 64]
    assert a.stats.accepted == b.stats.accepted == 0
    assert b.stats.drafted > 0
    # 3 poor rounds at the probation cap, 8 rounds off, 3 poor, 16 off, 3 poor, 32 off...
    assert sizes[:3] == [4, 4, 4] and sizes[3:11] == [0] * 8 and sizes[11:14] == [4, 4, 4]
    assert sizes[14:30] == [0] * 16
    assert b.stats.drafted * 5 < a.stats.drafted
    g = b.stats.governor
    assert g["suspensions"] >= 3
    # the last round has no room for a draft (max_tokens), so the governor is not asked
    assert g["suspended_rounds"] == sizes[:-1].count(0)
    assert g["drafters"]["oracle"]["next_backoff"] == 64


def test_good_round_resets_the_backoff_in_the_loop(model, reference):
    # Half of each block wrong (accepted fraction about 0.5): good rounds keep the
    # drafter from being suspended at all.
    pipe = specdec.assemble(model, policy=oracle_policy(reference, corruption="partial"))
    out = pipe.generate(PROMPT, max_tokens=48)
    assert out.tokens == reference[len(PROMPT) : len(PROMPT) + 48]
    assert out.stats.accepted > 0
    assert out.stats.governor["suspensions"] == 0


@pytest.mark.parametrize("corruption", ["none", "partial", "full", 0.3])
def test_greedy_identity_under_the_governor(model, reference, corruption):
    pol = oracle_policy(reference, corruption=corruption, suspend_after=1, suspend_rounds=1)
    totals = check_greedy_identity(
        model, pol, PROMPT, max_tokens_list=range(1, 17), require_drafts=False
    )
    assert totals["drafted"] > 0
    if corruption != "full":
        assert totals["accepted"] > 0


def test_copy_preset_reports_governor_stats(model):
    pipe = specdec.assemble(model, policy="copy")
    prompt = PROMPT * 3
    out = pipe.generate(prompt, max_tokens=24)
    assert "ngram_copy" in out.stats.governor["drafters"]
    assert {"suspensions", "suspended_rounds", "drafters"} <= set(out.stats.governor)


# -- shadow scoring in the loop -------------------------------------------------------


class _Flip(specdec.BaseDrafter):
    """Copies the reference, wrongly before position ``switch`` and rightly after; its
    proposals are a lookup, so it answers ``shadow()`` too."""

    name = "flip"

    def __init__(self, reference=(), switch=0, block=8):
        self.reference, self.switch, self.block = list(reference), switch, block

    def session(self, ctx):
        d = self

        class S(specdec.BaseDrafterSession):
            def propose(self, history, max_len):
                n = len(history)
                toks = d.reference[n : n + min(max_len, d.block)]
                if n < d.switch:
                    toks = [(t + 1) % 64 for t in toks]
                return specdec.Draft(tokens=toks) if toks else None

            def shadow(self, history, max_len):
                return self.propose(history, max_len)

        return S()


def _flip_host():
    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("flip", _Flip)

    return plugin_host(P())


@pytest.mark.parametrize("shadow", [True, False])
def test_shadow_scoring_ends_a_suspension_once_the_drafter_is_right(model, reference, shadow):
    switch = len(PROMPT) + 12
    pol = specdec.Policy(
        name="flip",
        drafters=("flip",),
        governor="copy_governor",
        options={
            "flip": {"reference": reference, "switch": switch},
            "copy_governor": {"shadow": shadow, "suspend_rounds": 32},
        },
    )
    with _flip_host() as host:
        pipe = specdec.assemble(model, policy=pol, host=host)
        sizes = []
        out = pipe.generate(
            PROMPT,
            max_tokens=64,
            on_round=lambda r, c: sizes.append((r.start_position, len(r.block))),
        )
    assert out.tokens == reference[len(PROMPT) : len(PROMPT) + 64]
    g = out.stats.governor
    assert g["suspensions"] >= 1
    # The first drafted round after the drafter turned right.
    resumed = next(p for p, k in sizes if p >= switch and k > 0)
    if shadow:
        assert g["shadow_resumes"] >= 1 and out.stats.shadow_proposals > 0
        assert resumed <= switch + 2  # two matched shadow tokens, then drafting again
        assert out.stats.shadow_fraction < 0.02
    else:
        # The session says it reads no shadows: the core does not ask for them.
        assert g["shadow_resumes"] == 0 and out.stats.shadow_proposals == 0
        assert resumed > switch + 8  # the 32-round suspension runs out first
    assert out.stats.accepted > 0


def test_poor_shadows_keep_a_wrong_drafter_suspended(model, reference):
    pol = specdec.Policy(
        name="flip",
        drafters=("flip",),
        governor="copy_governor",
        options={"flip": {"reference": reference, "switch": 10**9}},
    )
    with _flip_host() as host:
        out = specdec.assemble(model, policy=pol, host=host).generate(PROMPT, max_tokens=64)
    assert out.tokens == reference[len(PROMPT) : len(PROMPT) + 64]
    g = out.stats.governor
    # One suspension, extended by its shadow outcomes instead of running out into probation.
    assert g["suspensions"] >= 2 and g["shadow_extensions"] >= 1
    assert out.stats.drafted <= 3 * 4 + 4  # three poor probation rounds, then at most one more
