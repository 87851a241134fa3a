"""Tests of the example plugin, written with specdec's test kit."""

from __future__ import annotations

import pytest
import specdec
import specdec_example_drafter
from specdec.testing import (
    ARCHITECTURES,
    FAULTS,
    check_caches_match_plain,
    check_drafter_faults,
    check_fewer_forwards,
    check_greedy_identity,
    check_sampled_identity,
    make_tiny_model,
    plugin_host,
    require_installed,
)
from specdec_example_drafter import RepeatDrafter

POLICY = specdec.Policy(drafters=("example_repeat",))
# A prompt with repetition in it, so the drafter has something to replay.
PROMPT = [3, 17, 5, 9, 3, 17, 5, 9, 3, 17, 40, 2]


# -- the plugin is found and registered ----------------------------------------


def test_registers_example_repeat():
    with plugin_host(specdec_example_drafter) as host:
        info = host.components["drafter"]["example_repeat"]
        assert info.description
        assert isinstance(host.create("drafter", "example_repeat"), RepeatDrafter)


def test_installed_through_entry_point(specdec_fresh_host):
    # specdec_fresh_host: a fixture of the test kit's pytest plugin (a freshly loaded host).
    # require_installed skips when the tests run from a source tree, and fails under CI.
    dist = require_installed("specdec-example-drafter")
    names = [ep.name for ep in dist.entry_points if ep.group == "specdec"]
    assert names == ["example_repeat"]
    info = specdec_fresh_host.components["drafter"]["example_repeat"]
    assert info.distribution == "specdec-example-drafter"


# -- the drafter on its own ----------------------------------------------------


def session(**options):
    """A request's session of a drafter built with ``options`` (no model needed)."""
    return RepeatDrafter(**options).session(None)


def test_proposes_what_followed_last_time():
    drafter = session()
    draft = drafter.propose([5, 6, 7, 5], max_len=3)
    assert draft.tokens == (6, 7, 5)
    assert draft.probs is None  # deterministic: point-mass acceptance under sampling


def test_most_recent_occurrence_wins():
    assert session().propose([1, 2, 1, 3, 1], max_len=2).tokens == (3, 1)


def test_no_previous_occurrence_means_no_draft():
    assert session().propose([1, 2, 3], max_len=4) is None
    assert session().propose([], max_len=4) is None


def test_max_len_option_caps_the_block():
    drafter = session(max_len=2)
    assert drafter.propose([5, 6, 7, 5], max_len=16).tokens == (6, 7)


def test_history_grows_incrementally():
    drafter = session()
    assert drafter.propose([1, 2, 1], max_len=2).tokens == (2, 1)
    assert drafter.propose([1, 2, 1, 3, 1], max_len=2).tokens == (3, 1)
    assert drafter.stats() == {"proposals": 2}


def test_sessions_do_not_share_state():
    drafter = RepeatDrafter()
    a, b = drafter.session(None), drafter.session(None)
    assert a.propose([1, 2, 1], max_len=2).tokens == (2, 1)
    assert b.propose([1, 9, 1], max_len=2).tokens == (9, 1)
    assert a.stats() == b.stats() == {"proposals": 1}


def test_bad_options_are_policy_errors():
    with pytest.raises(specdec.PolicyError, match="max_len"):
        RepeatDrafter(max_len=0)
    with plugin_host(specdec_example_drafter) as host:
        with pytest.raises(specdec.PolicyError, match="max_len"):
            host.create("drafter", "example_repeat", {"max_len": "four"})
        with pytest.raises(specdec.PolicyError, match="example_repeat"):
            host.create("drafter", "example_repeat", {"no_such_option": 1})


# -- the drafter inside the speculative loop ----------------------------------


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=64, seed=0)


def test_greedy_identity(model):
    with plugin_host(specdec_example_drafter):
        check_greedy_identity(model, POLICY, PROMPT, max_tokens_list=range(1, 17))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_identity_per_architecture(arch):
    # gemma3's sliding window wraps during the test: rollback must stay exact.
    policy = POLICY.with_options("example_repeat", max_len=3)
    with plugin_host(specdec_example_drafter):
        check_greedy_identity(make_tiny_model(arch), policy, PROMPT, max_tokens_list=range(1, 17))


def test_faults_end_in_a_named_error_or_identical_output(model):
    # The kit feeds the drafter its worst cases (ids outside the vocabulary, an over-long
    # block, bad q, exceptions on the first and n-th call): each must end in a
    # specdec error naming the drafter, or in plain decoding's output.
    with plugin_host(specdec_example_drafter):
        outcomes = check_drafter_faults(model, POLICY, PROMPT, max_tokens=16)
    assert {o.fault for o in outcomes} == set(FAULTS)


def test_caches_match_plain_decoding(model):
    with plugin_host(specdec_example_drafter):
        check_caches_match_plain(model, POLICY, PROMPT, max_tokens=24)


def test_sampled_run_equals_plain_seeded_run(model):
    # Deterministic drafts + position-keyed sampling: the same tokens as without speculation.
    with plugin_host(specdec_example_drafter):
        check_sampled_identity(model, POLICY, PROMPT, seeds=range(3), temperature=1.0)


def test_fewer_forwards(model):
    with plugin_host(specdec_example_drafter):
        plain, spec = check_fewer_forwards(model, POLICY, PROMPT, max_tokens=48)
    assert spec < plain
