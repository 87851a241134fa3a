"""copy_governor in the core pipeline: it governs any drafter by name (here the test kit's oracle)."""

from __future__ import annotations

import json
import subprocess

import pytest
import specdec
from specdec.testing import (
    check_greedy_identity,
    make_tiny_model,
    plugin_host,
    require_command,
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
    require_installed("specdec-plugin-copy-governor")
    exe = require_command("specdec")
    out = subprocess.run([exe, "plugins", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plugins = {p["distribution"]: p for p in json.loads(out.stdout)["plugins"]}
    assert "specdec-plugin-copy-governor" in plugins, sorted(plugins)
    assert plugins["specdec-plugin-copy-governor"]["components"] == {"governor": ["copy_governor"]}


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
